"""lowprec.convert: every torch.nn.Linear of a model becomes a named lowprec.Linear sharing its parameters."""

from __future__ import annotations

import torch

import lowprec


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = torch.nn.MultiheadAttention(16, 2, batch_first=True)  # keeps its own out_proj
        self.mlp = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))

    def forward(self, x):
        return x + self.mlp(x + self.attention(x, x, x)[0])


def test_convert_replaces_linears_keeping_parameters_and_outputs():
    torch.manual_seed(0)
    model = torch.nn.Sequential(Block(), torch.nn.Linear(16, 4))
    x = torch.randn(2, 5, 16)
    before = model(x)
    params = {name: p for name, p in model.named_parameters()}
    assert lowprec.convert(model) is model
    assert isinstance(model[0].mlp[0], lowprec.Linear) and isinstance(model[1], lowprec.Linear)
    assert type(model[0].attention.out_proj) is not lowprec.Linear  # a Linear subclass MHA reads directly
    assert model[0].mlp[2].name == "model.0.mlp.2" and model[1].name == "model.1"
    assert {name: p for name, p in model.named_parameters()} == params  # same names, same Parameter objects
    assert torch.equal(model(x), before)
    with lowprec.fp8_autocast():
        y = model(x)
    assert not torch.equal(y, before) and torch.allclose(y, before, atol=0.2)


def test_convert_a_bare_linear():
    layer = torch.nn.Linear(3, 2)
    converted = lowprec.convert(layer, prefix="head")
    assert isinstance(converted, lowprec.Linear) and converted.name == "head" and converted.weight is layer.weight
