"""``FakeQuant``: round chosen GEMM operands to an FP8 format and back, then run the GEMM in high precision."""

from __future__ import annotations

import torch

import nvdlfw_inspect.api as debug_api
from lowprec.debug.features.api import ModifiesSelectedTensors
from lowprec.debug.features.per_tensor_scaling import validate_margin
from lowprec.formats import FP8_FORMATS
from lowprec.quantization import CurrentScalingQuantizer
from nvdlfw_inspect.errors import ConfigLocation, ErrorCollector
from nvdlfw_inspect.registry import Registry, api_method


def fake_quantize(tensor: torch.Tensor, quant_format: str, margin: int = 0) -> torch.Tensor:
    """``dequantize(quantize(tensor))`` with per-tensor current scaling, in ``tensor``'s dtype."""
    return CurrentScalingQuantizer(FP8_FORMATS[quant_format], margin).quantize(tensor).dequantize(tensor.dtype)


@Registry.register_feature(namespace="transformer_engine")
class FakeQuant(ModifiesSelectedTensors):
    """Fake-quantizes the selected (GEMM, tensor) operands with per-tensor current scaling,
    ``scale = fp8_max / (amax * 2**margin)``, and runs the listed GEMMs in high precision (so the other
    operand of each is not quantized unless FakeQuant selects it too).

    Keys: ``gemms``/``gemms_struct``, ``tensors``/``tensors_struct``, ``quant_format`` (FP8E4M3 or
    FP8E5M2, required), ``margin`` (default 0).
    """

    option_keys = frozenset({"quant_format", "margin"})

    def validate_options(self, view: dict, location: ConfigLocation) -> None:
        collector = ErrorCollector()
        if "quant_format" not in view:
            collector.add(location.error("FakeQuant needs 'quant_format'", allowed=sorted(FP8_FORMATS)))
        elif view["quant_format"] not in FP8_FORMATS:
            collector.add(location.child("quant_format").error("unsupported format", view["quant_format"], sorted(FP8_FORMATS)))
        with collector.check():
            validate_margin(view, location)
        collector.raise_errors()

    @api_method
    def fp8_gemm_enabled(self, config: dict, layer_name: str, gemm: str, iteration: int) -> tuple[bool, int]:
        return False, iteration + 1

    @api_method
    def modify_tensor(
        self,
        config: dict,
        layer_name: str,
        gemm: str,
        tensor_name: str,
        tensor: torch.Tensor,
        iteration: int,
        dtype: torch.dtype | None = None,
        **kwargs: object,
    ) -> torch.Tensor:
        debug_api.log_message(
            f"Feature=FakeQuant, API=process_tensor: {gemm}, {tensor_name}", layer_name, extra_cachable_args=(gemm, tensor_name)
        )
        result = fake_quantize(tensor, config["quant_format"], config.get("margin", 0))
        return result if dtype is None else result.to(dtype)
