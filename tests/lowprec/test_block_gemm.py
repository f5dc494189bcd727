"""GEMMs of block-scaled operands: each GEMM reads its operands blocked along its inner dimension, in fp32
with fp32 accumulation; Hadamard-transformed wgrad operands multiply as transformed; mixed operands run
in high precision."""

from __future__ import annotations

import pytest
import torch

from lowprec.formats.elements import E4M3
from lowprec.gemm import emulated_block_gemm, gemm
from lowprec.quant.per_tensor import CurrentScalingQuantizer
from lowprec.recipe import Float8BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling

RECIPES = {"mxfp8": MXFP8BlockScaling(), "float8-block": Float8BlockScaling(), "nvfp4": NVFP4BlockScaling()}


def operands(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(40, 72, generator=g), torch.randn(24, 72, generator=g), torch.randn(40, 24, generator=g)


@pytest.mark.parametrize("recipe", RECIPES.values(), ids=RECIPES.keys())
def test_the_three_gemms_of_a_linear_layer(recipe):
    x, w, dy = operands()
    q = recipe.quantizers("fc1")
    qx, qw, qdy = q["activation"].quantize(x, True), q["weight"].quantize(w, True), q["gradient"].quantize(dy, True)
    # fprop x W^T: x rowwise (blocks along K) and W rowwise; dgrad dy W: dy rowwise and W columnwise (along N)
    assert torch.equal(gemm(qx, qw.t(), torch.float32), qx.rowwise.dequantize() @ qw.rowwise.dequantize().t())
    assert torch.equal(gemm(qdy, qw, torch.float32), qdy.rowwise.dequantize() @ qw.columnwise.dequantize().t())
    # wgrad dy^T x: both columnwise (blocks along the 40 tokens)
    wgrad = gemm(qdy.t(), qx, torch.float32)
    assert torch.allclose(wgrad, qdy.columnwise.dequantize() @ qx.columnwise.dequantize().t(), rtol=1e-5, atol=1e-4)
    for got, exact in ((gemm(qx, qw.t(), torch.float32), x @ w.t()), (wgrad, dy.t() @ x)):
        assert (got - exact).norm() / exact.norm() < (0.2 if isinstance(recipe, NVFP4BlockScaling) else 0.05)
    assert gemm(qx, qw.t(), torch.bfloat16).dtype == torch.bfloat16


def test_hadamard_operands_multiply_as_transformed():
    x, _, dy = operands(1)
    q = NVFP4BlockScaling(disable_stochastic_rounding=True).quantizers("fc1")
    qx, qdy = q["activation"].quantize(x, True), q["gradient"].quantize(dy, True)
    transformed = (qdy.columnwise.values() @ qx.columnwise.values().t())[:24, :72]
    assert torch.equal(emulated_block_gemm(qdy.t(), qx, torch.float32), transformed)
    # the same product as the dequantized (transform undone) operands, within float rounding
    assert torch.allclose(transformed, qdy.columnwise.dequantize() @ qx.columnwise.dequantize().t(), rtol=1e-4, atol=1e-4)


def test_a_right_operand_needs_its_columnwise_quantization():
    x, w, _ = operands()
    q = MXFP8BlockScaling().quantizers("fc1")
    with pytest.raises(
        ValueError, match="no quantization blocked along the GEMM's inner dimension: quantize with transpose=True"
    ):
        gemm(q["activation"].quantize(x), q["weight"].quantize(w), torch.float32)


def test_mixed_operands_run_in_high_precision():
    x, w, _ = operands()
    qw = MXFP8BlockScaling().quantizers("fc1")["weight"].quantize(w, True)
    assert torch.equal(gemm(x, qw.t(), torch.float32), x @ qw.dequantize().t())
    qx = CurrentScalingQuantizer(E4M3).quantize(x)
    assert torch.equal(gemm(qx, qw.t(), torch.float32), qx.dequantize() @ qw.dequantize().t())
    assert torch.equal(gemm(qw, x.t(), torch.float32), qw.dequantize() @ x.t())
