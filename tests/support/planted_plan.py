"""A small model whose one layer is sensitive to narrow formats, for the tests of the plan search
(``lowprec.planner``): usable as ``compare --model planted_plan:factory`` (``tests/support`` on the path).

``model.a`` -> tanh -> x boost -> ``model.b`` -> tanh -> ``model.c``, regressing a fixed random target of the input.
The boost makes channel 7 of ``model.b``'s input 1000 times the others (an outlier channel, as LLMs' massive
activations), with a weight column 1000 times smaller so that it carries no more than the others: a block format
whose block scale that channel sets flushes its neighbours in ``model.b``'s fprop.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

import lowprec

WIDTH, TOKENS = 64, 64


class Planted(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = lowprec.Linear(WIDTH, WIDTH, name="model.a")
        self.b = lowprec.Linear(WIDTH, WIDTH, name="model.b")
        self.c = lowprec.Linear(WIDTH, 1, name="model.c")
        self.register_buffer("boost", torch.ones(WIDTH))
        self.boost[7] = 1000.0
        with torch.no_grad():
            self.b.weight[:, 7] /= 1000.0

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        hidden = torch.tanh(self.a(x)) * self.boost
        return torch.nn.functional.mse_loss(self.c(torch.tanh(self.b(hidden))), y)


TARGET = torch.randn(WIDTH, 1, generator=torch.Generator().manual_seed(1234))


def batch_of(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs from torch's random state (which compare seeds before each batch) and their target."""
    x = torch.randn(TOKENS, WIDTH)
    return x, torch.tanh(x @ TARGET)


def factory() -> tuple[torch.nn.Module, Callable[[int], tuple[torch.Tensor, torch.Tensor]]]:
    return Planted(), batch_of
