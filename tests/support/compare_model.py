"""A model of the user's own for ``compare --model compare_model:make``: two linear layers regressing a fixed
random map, small enough that a step takes milliseconds."""

from __future__ import annotations

import torch


class TwoLayers(torch.nn.Module):
    """``fc1``, ReLU, ``fc2``; its forward takes ``(inputs, targets)`` and returns the mean squared error."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(32, 64)
        self.fc2 = torch.nn.Linear(64, 16)

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, targets = batch
        return torch.nn.functional.mse_loss(self.fc2(torch.relu(self.fc1(inputs))), targets)


def make() -> tuple[torch.nn.Module, object]:
    """The model and its batches: 16 random inputs per step and their image under a random map drawn with the model."""
    target_map = torch.randn(32, 16)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = torch.randn(16, 32)
        return inputs, inputs @ target_map / 32**0.5  # targets of variance 1

    return TwoLayers(), batch


def not_a_pair() -> torch.nn.Module:
    """A factory that breaks the contract: the model alone."""
    return TwoLayers()
