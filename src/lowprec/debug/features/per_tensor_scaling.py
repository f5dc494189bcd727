"""``PerTensorScaling``: current scaling (one scale from the tensor's own amax) for chosen GEMM operands."""

from __future__ import annotations

import torch

import nvdlfw_inspect.api as debug_api
from lowprec.debug.features.api import ModifiesSelectedTensors
from lowprec.formats.elements import E4M3, E5M2
from lowprec.quant.per_tensor import CurrentScalingQuantizer
from lowprec.quant.protocol import Float8Tensor, Quantizer
from nvdlfw_inspect.errors import ConfigLocation, is_int
from nvdlfw_inspect.registry import Registry, api_method


def validate_margin(view: dict, location: ConfigLocation) -> None:
    margin = view.get("margin", 0)
    if not is_int(margin) or margin < 0:
        raise location.child("margin").error("must be a non-negative integer (amax is multiplied by 2**margin)", margin)


@Registry.register_feature(namespace="transformer_engine")
class PerTensorScaling(ModifiesSelectedTensors):
    """Quantizes the selected (GEMM, tensor) operands with per-tensor current scaling,
    ``scale = fp8_max / (amax * 2**margin)``, in the format the recipe gives the tensor (E4M3 for
    activation and weight, E5M2 for gradient when no recipe is active). Works under any recipe.

    Keys: ``gemms``/``gemms_struct``, ``tensors``/``tensors_struct`` (activation, weight, gradient),
    ``margin`` (default 0).
    """

    allowed_tensors = ("activation", "weight", "gradient")
    option_keys = frozenset({"margin"})

    def validate_options(self, view: dict, location: ConfigLocation) -> None:
        validate_margin(view, location)

    @api_method
    def modify_tensor(
        self,
        config: dict,
        layer_name: str,
        gemm: str,
        tensor_name: str,
        tensor: torch.Tensor,
        default_quantizer: Quantizer | None,
        iteration: int,
        out: Float8Tensor | None = None,
        dtype: torch.dtype | None = None,
    ) -> Float8Tensor | None:
        debug_api.log_message(
            f"Feature=PerTensorScaling, API=process_tensor: {gemm}, {tensor_name}",
            layer_name,
            extra_cachable_args=(gemm, tensor_name),
        )
        if default_quantizer is not None:
            fmt = default_quantizer.format
        else:
            fmt = E5M2 if tensor_name == "gradient" else E4M3
        quantized = CurrentScalingQuantizer(fmt, config.get("margin", 0)).quantize(tensor)
        if out is not None:
            out.data.copy_(quantized.data)
            out.scale_inv.copy_(quantized.scale_inv)
            return None
        return quantized
