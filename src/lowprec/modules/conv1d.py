"""``lowprec.Conv1D``: Hugging Face's ``Conv1D`` (GPT-2's linear layer) on lowprec's GEMM path."""

from __future__ import annotations

import torch

from lowprec.modules.linear import GemmLayer


class Conv1D(GemmLayer):
    """``y = x W + b`` with ``weight`` of shape ``(in_features, out_features)``, as in ``transformers``.

    The weight keeps Hugging Face's layout so checkpoints and shared Parameters stay as they are; each
    forward hands its transposed view to the GEMMs of ``lowprec.Linear`` (gradients flow back through
    the view), so ``layer_types: [linear]`` selects it too. It is not a ``torch.nn.Linear``: its weight is transposed.
    """

    @staticmethod
    def weight_shape(in_features: int, out_features: int) -> tuple[int, int]:
        return in_features, out_features

    def gemm_weight(self) -> torch.Tensor:
        return self.weight.t()

    @classmethod
    def from_hf(cls, module: torch.nn.Module, name: str) -> Conv1D:
        """A ``lowprec.Conv1D`` sharing the parameters of a Hugging Face ``Conv1D`` (weight ``(nx, nf)``)."""
        in_features, out_features = module.weight.shape
        return cls.sharing(in_features, out_features, module.weight, module.bias, name)
