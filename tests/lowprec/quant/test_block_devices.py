"""The block recipes' casts are the same bits on every device: a CUDA GPU, through the fused Triton kernels or
through the torch emulation, casts exactly as the CPU does (noise and Hadamard transform included)."""

from __future__ import annotations

import pytest
import torch

import lowprec
from lowprec import kernels

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs a CUDA GPU with FP8 conversions"
)
RECIPES = [
    lowprec.MXFP8BlockScaling(),
    lowprec.MXFP8BlockScaling(enable_2d_quantization=True),
    lowprec.Float8BlockScaling(),
    lowprec.Float8BlockScaling(use_f32_scales=True),
    lowprec.NVFP4BlockScaling(seed=3),
    lowprec.MXBlockScaling("e4m3", scale_rule="ocp"),  # the OCP rule and the FP6 and FP4 elements: emulated on CUDA too
    lowprec.MXBlockScaling("e3m2", gradient_element="e2m3", scale_rule="nvidia"),
    lowprec.MXBlockScaling("e2m1"),
]


def casts(recipe, device: str, x: torch.Tensor) -> list[torch.Tensor]:
    """Every tensor of two casts (with the transpose) by each of a fresh layer's quantizers, on ``device``."""
    out = []
    for quantizer in recipe.quantizers("fc1").values():
        for _ in range(2):  # a second cast takes the next stochastic-rounding offset
            out += [t.cpu() for t in quantizer.quantize(x.to(device), transpose=True).inner_tensors().values() if t is not None]
    return out


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: repr(r)[:60])
@pytest.mark.parametrize("fused", [True, False], ids=["triton", "torch"])
def test_cuda_casts_equal_the_cpu_casts_bit_for_bit(recipe, fused, monkeypatch):
    monkeypatch.setattr(kernels, "_mode", "auto" if fused else "emulated")
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(300, 520, generator=g) * torch.logspace(-8, 8, 520)).to(torch.bfloat16)
    x[0, :4] = torch.tensor([float("nan"), float("inf"), -0.0, 1e-40])
    assert kernels.runs_on(x.cuda()) == fused
    for got, want in zip(casts(recipe, "cuda", x), casts(recipe, "cpu", x), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))
