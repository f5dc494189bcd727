"""``lowprec.Conv1D``: Hugging Face's ``Conv1D`` (GPT-2's linear layer) on lowprec's GEMM path."""

from __future__ import annotations

import torch

from lowprec.modules.base import NamedModule
from lowprec.modules.gemm_unit import GemmUnit
from lowprec.modules.linear import init_linear_parameters


class Conv1D(NamedModule):
    """``y = x W + b`` with ``weight`` of shape ``(in_features, out_features)``, as in ``transformers``.

    The weight keeps Hugging Face's layout so checkpoints and shared Parameters stay as they are; each
    forward hands its transposed view to the same GEMMs as ``lowprec.Linear`` (gradients flow back
    through the view), so ``layer_types: [linear]`` selects it too.
    """

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
        self.weight = torch.nn.Parameter(torch.empty(in_features, out_features, **factory))
        self.bias = torch.nn.Parameter(torch.empty(out_features, **factory)) if bias else None
        init_linear_parameters(self.weight.t(), self.bias)
        self.gemm_unit = GemmUnit(self.layer_types)

    @classmethod
    def from_hf(cls, module: torch.nn.Module, name: str) -> Conv1D:
        """A ``lowprec.Conv1D`` sharing the parameters of a Hugging Face ``Conv1D`` (weight ``(nx, nf)``)."""
        in_features, out_features = module.weight.shape
        layer = cls(in_features, out_features, bias=module.bias is not None, name=name, device="meta")
        layer.weight = module.weight
        layer.bias = module.bias
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemm_unit.linear(self.name, x, self.weight.t(), self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            + super().extra_repr()
        )
