"""The FP8 layers: ``Linear``, ``LayerNormLinear``, ``LayerNormMLP``, ``TransformerLayer`` and ``convert``."""

from lowprec.modules.convert import convert
from lowprec.modules.layernorm_linear import LayerNormLinear
from lowprec.modules.layernorm_mlp import LayerNormMLP
from lowprec.modules.linear import Linear
from lowprec.modules.transformer_layer import TransformerLayer

__all__ = ["LayerNormLinear", "LayerNormMLP", "Linear", "TransformerLayer", "convert"]
