"""``lowprec.Linear``: ``torch.nn.Linear`` whose three GEMMs run in FP8 under autocast and obey the debug hooks."""

from __future__ import annotations

import math

import torch

from lowprec.modules.base import NamedModule
from lowprec.modules.gemm_unit import GemmUnit


def init_linear_parameters(weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """The initialisation of ``torch.nn.Linear``: uniform in +-1/sqrt(in_features)."""
    torch.nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    if bias is not None:
        bound = 1 / math.sqrt(weight.shape[1]) if weight.shape[1] > 0 else 0
        torch.nn.init.uniform_(bias, -bound, bound)


class GemmLayer(NamedModule):
    """A layer that is one GEMM with its weight and bias: ``lowprec.Linear`` and ``lowprec.Conv1D`` (which keeps
    Hugging Face's transposed weight, so it must not pass for a ``torch.nn.Linear``)."""

    layer_types = ("linear",)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        name: str | None = None,
        device: torch.device | str | None = None,
        params_dtype: torch.dtype | None = None,
    ):
        super().__init__(name)
        self.in_features, self.out_features = in_features, out_features
        factory = {"device": device, "dtype": params_dtype}
        self.weight = torch.nn.Parameter(torch.empty(self.weight_shape(in_features, out_features), **factory))
        self.bias = torch.nn.Parameter(torch.empty(out_features, **factory)) if bias else None
        init_linear_parameters(self.gemm_weight(), self.bias)
        self.gemm_unit = GemmUnit(self.layer_types)

    @staticmethod
    def weight_shape(in_features: int, out_features: int) -> tuple[int, int]:
        return out_features, in_features

    def gemm_weight(self) -> torch.Tensor:
        """The weight as the GEMMs take it: ``(out_features, in_features)``."""
        return self.weight

    @classmethod
    def sharing(
        cls, in_features: int, out_features: int, weight: torch.Tensor, bias: torch.Tensor | None, name: str
    ) -> GemmLayer:
        """A layer of this class whose Parameters are ``weight`` and ``bias`` themselves."""
        layer = cls(in_features, out_features, bias=bias is not None, name=name, device="meta")
        layer.weight = weight
        layer.bias = bias
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemm_unit.linear(self.name, x, self.gemm_weight(), self.bias, self.training)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            + super().extra_repr()
        )


class Linear(GemmLayer, torch.nn.Linear):
    """``y = x W^T + b`` with ``weight`` of shape ``(out_features, in_features)``: a ``torch.nn.Linear`` (code that
    checks ``isinstance(m, nn.Linear)``, PEFT's LoRA, transformers' ``resize_token_embeddings``, keeps working).

    Inside ``lowprec.autocast`` the fprop, dgrad and wgrad GEMMs run in FP8 with the recipe's scaling;
    outside it the layer is exactly ``torch.nn.Linear``. ``name`` identifies the layer in debug configs
    and logs; ``layer_types: [linear]`` also selects it.
    """

    @classmethod
    def from_torch(cls, module: torch.nn.Linear, name: str) -> Linear:
        """A ``lowprec.Linear`` sharing ``module``'s parameters (the optimizer keeps working on them)."""
        return cls.sharing(module.in_features, module.out_features, module.weight, module.bias, name)
