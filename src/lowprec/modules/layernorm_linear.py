"""``lowprec.LayerNormLinear``: a LayerNorm or RMSNorm, then a ``Linear`` whose input is the normalised tensor."""

from __future__ import annotations

import torch

from lowprec.modules.base import NamedModule
from lowprec.modules.gemm_unit import GemmUnit
from lowprec.modules.linear import init_linear_parameters
from lowprec.modules.norm import Norm


class LayerNormLinear(NamedModule):
    """``Linear(norm(x))``. The debug ``activation`` of its GEMMs is the normalised input.

    ``layer_types: [layernorm_linear]`` selects it whatever its name (for example the
    ``self_attention.layernorm_qkv`` projection of a ``TransformerLayer``).
    """

    layer_types = ("layernorm_linear",)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        normalization: str = "LayerNorm",
        eps: float = 1e-5,
        name: str | None = None,
        return_layernorm_output: bool = False,
        device: torch.device | str | None = None,
        params_dtype: torch.dtype | None = None,
    ):
        super().__init__(name)
        self.in_features, self.out_features = in_features, out_features
        self.return_layernorm_output = return_layernorm_output
        factory = {"device": device, "dtype": params_dtype}
        self.norm = Norm(in_features, normalization, eps, **factory)
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, **factory))
        self.bias = torch.nn.Parameter(torch.empty(out_features, **factory)) if bias else None
        init_linear_parameters(self.weight, self.bias)
        self.gemm_unit = GemmUnit(self.layer_types)

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        normed = self.norm(x)
        out = self.gemm_unit.linear(self.name, normed, self.weight, self.bias, self.training)
        return (out, normed) if self.return_layernorm_output else out
