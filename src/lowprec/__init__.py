"""FP8 training layers for plain PyTorch whose every GEMM can be inspected and steered by ``nvdlfw_inspect``.

Importing ``lowprec`` makes its debug features (config namespace ``transformer_engine``) load at every
``nvdlfw_inspect.api.initialize``.
"""

from lowprec.autocast import autocast, fp8_autocast
from lowprec.debug import FEATURE_DIR
from lowprec.formats.elements import E2M1, E2M3, E3M2, E4M3, E5M2, FP4Format, FP8Format, MiniFloatFormat
from lowprec.kernels import kernel_mode, set_kernel_mode
from lowprec.modules import (
    Conv1D,
    ConvertReport,
    GroupedLinear,
    LayerNormLinear,
    LayerNormMLP,
    Linear,
    TransformerLayer,
    convert,
    convert_with_report,
)
from lowprec.quant.protocol import BlockScaledTensor, Float8Tensor
from lowprec.recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MXBlockScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
)
from lowprec.study import QuantizedView, quantize
from nvdlfw_inspect.feature_loading import register_default_feature_dir

register_default_feature_dir(FEATURE_DIR)

__all__ = [
    "E2M1",
    "E2M3",
    "E3M2",
    "E4M3",
    "E5M2",
    "FEATURE_DIR",
    "BlockScaledTensor",
    "Conv1D",
    "ConvertReport",
    "DelayedScaling",
    "FP4Format",
    "FP8Format",
    "Float8BlockScaling",
    "Float8CurrentScaling",
    "Float8Tensor",
    "Format",
    "GroupedLinear",
    "LayerNormLinear",
    "LayerNormMLP",
    "Linear",
    "MXBlockScaling",
    "MXFP8BlockScaling",
    "MiniFloatFormat",
    "NVFP4BlockScaling",
    "QuantizedView",
    "TransformerLayer",
    "autocast",
    "convert",
    "convert_with_report",
    "fp8_autocast",
    "kernel_mode",
    "quantize",
    "set_kernel_mode",
]
