"""The FP8 layers: ``Linear``, ``Conv1D``, ``LayerNormLinear``, ``LayerNormMLP``, ``TransformerLayer``, ``GroupedLinear``
and ``convert``."""

from lowprec.modules.conv1d import Conv1D
from lowprec.modules.convert import ConvertReport, convert, convert_with_report
from lowprec.modules.grouped_linear import GroupedLinear
from lowprec.modules.layernorm_linear import LayerNormLinear
from lowprec.modules.layernorm_mlp import LayerNormMLP
from lowprec.modules.linear import Linear
from lowprec.modules.transformer_layer import TransformerLayer

__all__ = [
    "Conv1D",
    "ConvertReport",
    "GroupedLinear",
    "LayerNormLinear",
    "LayerNormMLP",
    "Linear",
    "TransformerLayer",
    "convert",
    "convert_with_report",
]
