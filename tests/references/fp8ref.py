"""Hand-written FP8 references for the layer tests: what each GEMM must produce."""

from __future__ import annotations

import torch

from lowprec.formats.elements import E4M3, E5M2, FP8Format


def current_fake_quant(t: torch.Tensor, fmt: FP8Format = E4M3, margin: int = 0) -> torch.Tensor:
    """Quantize with scale fp8_max / (amax * 2**margin) and dequantize, computed from scratch in float64."""
    amax = t.detach().abs().max().double()
    scale = (torch.tensor(fmt.max, dtype=torch.float64) / amax / 2**margin).float()
    q = (t.detach().float() * scale).clamp(-fmt.max, fmt.max).to(fmt.dtype)
    return (q.float() * scale.reciprocal()).to(t.dtype)


def linear_grads(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, fprop, dgrad, wgrad):
    """``(y, dx, dw)`` of ``y = x W^T`` where each GEMM's operands pass through the given functions.

    Each of fprop/dgrad/wgrad maps ``(first operand, second operand)`` to the operands actually used.
    """
    x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    a, b = fprop(x2, w)
    y = (a.double() @ b.double().t()).float()
    g, wd = dgrad(dy2, w)
    dx = (g.double() @ wd.double()).float()
    g2, a2 = wgrad(dy2, x2)
    dw = (g2.double().t() @ a2.double()).float()
    return y.reshape(*x.shape[:-1], -1), dx.reshape(x.shape), dw


def hp(a, b):
    return a, b


def e4m3_both(a, b):
    return current_fake_quant(a), current_fake_quant(b)


def e5m2_first(a, b):
    """Gradient (E5M2 under HYBRID) first, the other operand E4M3."""
    return current_fake_quant(a, E5M2), current_fake_quant(b)


__all__ = ["E4M3", "E5M2", "current_fake_quant", "e4m3_both", "e5m2_first", "hp", "linear_grads"]
