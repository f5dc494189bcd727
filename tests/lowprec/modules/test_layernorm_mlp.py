"""lowprec.LayerNormMLP: norm, fc1, activation, fc2, with the debug names {name}.fc1 and {name}.fc2."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fp8ref import current_fake_quant

import lowprec
from lowprec.modules.layernorm_mlp import ACTIVATIONS


def reference(mlp: lowprec.LayerNormMLP, x: torch.Tensor, quant=lambda t: t) -> torch.Tensor:
    normed = F.layer_norm(x, (x.shape[-1],), mlp.norm.weight, mlp.norm.bias, mlp.norm.eps)
    hidden = quant(normed) @ quant(mlp.fc1_weight).t() + mlp.fc1_bias
    act = ACTIVATIONS[mlp.activation][0](hidden)
    return quant(act) @ quant(mlp.fc2_weight).t() + mlp.fc2_bias


@pytest.mark.parametrize("activation", ["gelu", "relu", "swiglu", "geglu"])
def test_high_precision_matches_reference(activation):
    mlp = lowprec.LayerNormMLP(16, 24, activation=activation, name="mlp")
    widen = 2 if activation in ("swiglu", "geglu") else 1
    assert mlp.fc1_weight.shape == (widen * 24, 16) and mlp.fc2_weight.shape == (16, 24)
    x = torch.randn(5, 16)
    assert torch.allclose(mlp(x), reference(mlp, x), atol=1e-5)


def test_fp8_current_scaling_quantizes_both_gemm_layers():
    mlp = lowprec.LayerNormMLP(16, 32, name="mlp")
    x = torch.randn(6, 16)
    with lowprec.fp8_autocast(fp8_recipe=lowprec.Float8CurrentScaling()):
        y = mlp(x)
    assert torch.allclose(y, reference(mlp, x, current_fake_quant), rtol=1e-4, atol=1e-5)


def test_swiglu_math():
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    assert torch.allclose(ACTIVATIONS["swiglu"][0](x), F.silu(torch.tensor([[1.0, 2.0]])) * torch.tensor([[3.0, 4.0]]))


def test_bad_activation():
    with pytest.raises(ValueError, match=r"activation must be one of .*'swiglu'.*got 'tanh'"):
        lowprec.LayerNormMLP(4, 4, activation="tanh")
