"""lowprec.LayerNormLinear: norm then linear, LayerNorm or RMSNorm, FP8 on the normalised input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fp8ref import current_fake_quant

import lowprec


def reference(layer: lowprec.LayerNormLinear, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if layer.norm.normalization == "LayerNorm":
        normed = F.layer_norm(x, (x.shape[-1],), layer.norm.weight, layer.norm.bias, layer.norm.eps)
    else:
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + layer.norm.eps) * layer.norm.weight
    return F.linear(normed, layer.weight, layer.bias), normed


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_high_precision_matches_reference(normalization):
    layer = lowprec.LayerNormLinear(16, 8, normalization=normalization, name="ln_lin")
    with torch.no_grad():
        layer.norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 4, 16, requires_grad=True)
    y = layer(x)
    expected, _ = reference(layer, x)
    assert torch.allclose(y, expected, atol=1e-6)
    y.sum().backward()
    x_ref = x.detach().clone().requires_grad_()
    reference(layer, x_ref)[0].sum().backward()
    assert torch.allclose(x.grad, x_ref.grad, atol=1e-5)
    assert (layer.norm.bias is None) == (normalization == "RMSNorm")


def test_fp8_quantizes_the_normalised_input():
    layer = lowprec.LayerNormLinear(16, 8, name="ln_lin", return_layernorm_output=True)
    x = torch.randn(10, 16) * 4 + 2
    with lowprec.fp8_autocast(fp8_recipe=lowprec.Float8CurrentScaling()):
        y, normed = layer(x)
    _, expected_normed = reference(layer, x)
    assert torch.allclose(normed, expected_normed)
    expected = current_fake_quant(expected_normed) @ current_fake_quant(layer.weight).t() + layer.bias
    assert torch.allclose(y, expected, rtol=1e-5, atol=1e-5)


def test_bad_normalization():
    with pytest.raises(ValueError, match=r"normalization must be one of \['LayerNorm', 'RMSNorm'\], got 'BatchNorm'"):
        lowprec.LayerNormLinear(4, 4, normalization="BatchNorm")
