"""``FakeQuant``: round chosen GEMM operands to a low-precision format and back, then run the GEMM in high precision."""

from __future__ import annotations

import torch

import nvdlfw_inspect.api as debug_api
from lowprec.debug.features.api import ModifiesSelectedTensors
from lowprec.debug.features.per_tensor_scaling import validate_margin
from lowprec.formats.elements import E2M1, E2M3, E3M2, E4M3, E5M2, FP8_FORMATS
from lowprec.formats.scales import MX_SCALE_RULES, NVFP4_BLOCK, NVFP4ScaleRule, default_mx_scale_rule
from lowprec.quant.block import BlockQuantizer, mx_quantizer
from lowprec.quant.per_tensor import CurrentScalingQuantizer
from nvdlfw_inspect.errors import ConfigLocation, ErrorCollector
from nvdlfw_inspect.registry import Registry, api_method

# Block formats quantize along the tensor's last dimension (its rows), as Transformer Engine's FakeQuant does
# with MXFP8; NVFP4 without the random Hadamard transform or stochastic rounding, so the rounding is repeatable.
MX_FORMATS = {"MXFP8E4M3": E4M3, "MXFP8E5M2": E5M2, "MXFP6E3M2": E3M2, "MXFP6E2M3": E2M3, "MXFP4": E2M1}
"""The MX formats by ``quant_format``, each under its element's default scale rule unless ``scale_rule`` says."""
MX_QUANTIZERS = {(name, rule): mx_quantizer(element, rule) for name, element in MX_FORMATS.items() for rule in MX_SCALE_RULES}
NVFP4 = BlockQuantizer(NVFP4ScaleRule(), E2M1, (1, NVFP4_BLOCK), E4M3)
BLOCK_FORMATS = (*MX_FORMATS, "NVFP4")
QUANT_FORMATS = (*FP8_FORMATS, *BLOCK_FORMATS)


def fake_quantize(tensor: torch.Tensor, quant_format: str, margin: int = 0, scale_rule: str | None = None) -> torch.Tensor:
    """``dequantize(quantize(tensor))`` in ``tensor``'s dtype and shape: per-tensor current scaling for the
    FP8 formats, one scale per block of the last dimension for the MX formats (32, E8M0 scales under
    ``scale_rule``, None: the element's default) and NVFP4 (16)."""
    if quant_format in MX_FORMATS:
        rule = scale_rule or default_mx_scale_rule(MX_FORMATS[quant_format])
        return MX_QUANTIZERS[(quant_format, rule)].quantize(tensor).dequantize(tensor.dtype).reshape(tensor.shape)
    if quant_format == "NVFP4":
        return NVFP4.quantize(tensor).dequantize(tensor.dtype).reshape(tensor.shape)
    return CurrentScalingQuantizer(FP8_FORMATS[quant_format], margin).quantize(tensor).dequantize(tensor.dtype)


@Registry.register_feature(namespace="transformer_engine")
class FakeQuant(ModifiesSelectedTensors):
    """Fake-quantizes the selected (GEMM, tensor) operands and runs the listed GEMMs in high precision (so the
    other operand of each is not quantized unless FakeQuant selects it too). FP8 formats use per-tensor
    current scaling, ``scale = fp8_max / (amax * 2**margin)``; the MX formats and NVFP4 scale blocks of the last dimension.

    Keys: ``gemms``/``gemms_struct``, ``tensors``/``tensors_struct``, ``quant_format`` (FP8E4M3, FP8E5M2,
    MXFP8E4M3, MXFP8E5M2, MXFP6E3M2, MXFP6E2M3, MXFP4 or NVFP4, required), ``margin`` (default 0; FP8
    formats only), ``scale_rule`` (MX formats only: ``nvidia``, rounded up, the default for MXFP8, or
    ``ocp``, the specification's floor, the default for MXFP6 and MXFP4).
    """

    option_keys = frozenset({"quant_format", "margin", "scale_rule"})

    def validate_options(self, view: dict, location: ConfigLocation) -> None:
        collector = ErrorCollector()
        quant_format = view.get("quant_format")
        if "quant_format" not in view:
            collector.add(location.error("FakeQuant needs 'quant_format'", allowed=list(QUANT_FORMATS)))
        elif quant_format not in QUANT_FORMATS:
            collector.add(location.child("quant_format").error("unsupported format", quant_format, list(QUANT_FORMATS)))
        elif quant_format in BLOCK_FORMATS and "margin" in view:
            problem = f"block formats take no margin ({quant_format} scales each block)"
            collector.add(location.child("margin").error(problem, view["margin"]))
        if "scale_rule" in view and quant_format in QUANT_FORMATS and quant_format not in MX_FORMATS:
            problem = f"scale_rule chooses the E8M0 scales of the MX formats ({', '.join(MX_FORMATS)}); {quant_format} has none"
            collector.add(location.child("scale_rule").error(problem, view["scale_rule"]))
        elif "scale_rule" in view and view["scale_rule"] not in MX_SCALE_RULES:
            collector.add(location.child("scale_rule").error("unknown scale rule", view["scale_rule"], list(MX_SCALE_RULES)))
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
        result = fake_quantize(tensor, config["quant_format"], config.get("margin", 0), config.get("scale_rule"))
        return result if dtype is None else result.to(dtype)
