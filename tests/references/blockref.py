"""Float64 and bit-exact references of the block formats, written from their definitions (not through
lowprec's casts): the statistics of a block-scaled FP8 quantization, MXFP8 and NVFP4 by hand."""

from __future__ import annotations

import torch

from lowprec.formats.elements import MAGNITUDES, FP8Format

E2M1_GRID = torch.tensor(MAGNITUDES, dtype=torch.float64)


def fp8_round(x: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    return x.double().clamp(-fmt.max, fmt.max).float().to(fmt.dtype).double()


def block_ref(x: torch.Tensor, fmt: FP8Format, scales: torch.Tensor, scale_inv_logged: torch.Tensor) -> dict[str, float]:
    """Stats of a quantization where ``scales`` (same shape as x) multiply each element before the cast."""
    x = x.double()
    q = fp8_round(x * scales, fmt)
    nonzero = scale_inv_logged[scale_inv_logged != 0]
    return {
        "underflows%": 100 * ((x != 0) & (q == 0)).sum().item() / x.numel(),
        "mse": (x - q / scales).square().mean().item(),
        "scale_inv_min": nonzero.min().item() if nonzero.numel() else 0.0,
        "scale_inv_max": scale_inv_logged.max().item(),
    }


def mxfp8_ref(x2d: torch.Tensor, fmt: FP8Format, columnwise: bool) -> dict[str, float]:
    x = x2d.t() if columnwise else x2d
    blocks = x.double().reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    exponent = torch.where(amax > 0, torch.ceil(torch.log2(amax / fmt.max)), -127.0)
    scales = torch.pow(2.0, -exponent).expand_as(blocks).reshape(x.shape)
    return block_ref(x, fmt, scales, (exponent + 127).reshape(-1))


def mx_fake(x: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    """MXFP8 by hand: blocks of 32 along the last dimension, scale 2**ceil(log2(amax / fp8_max))."""
    blocks = x.double().reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    scale_inv = torch.where(amax > 0, torch.pow(2.0, torch.ceil(torch.log2(amax / fmt.max))), 2.0**-127)
    q = (blocks / scale_inv).float().to(fmt.dtype).double() * scale_inv
    return q.reshape(x.shape).float()


def e2m1_round(v: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 value, ties to the even code (even index in the magnitude list), saturating at 6."""
    magnitude = v.abs().clamp(max=6.0)
    distance = (magnitude[..., None] - E2M1_GRID).abs()
    best = distance.min(-1, keepdim=True).values
    candidates = torch.where(distance == best, torch.arange(8, dtype=torch.float64), 99.0)
    even_first = candidates + (candidates % 2) * 0.5  # an even index wins a tie
    index = even_first.argmin(-1)
    return torch.where(v < 0, -E2M1_GRID[index], E2M1_GRID[index])


def nvfp4_ref(x: torch.Tensor, block: tuple[int, int] = (1, 16)) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4 by hand: ``(dequantized, E2M1 values, E4M3 block scales)`` of a 2-D tensor."""
    h, w = block
    r, c = x.shape
    tiles = x.double().reshape(r // h, h, c // w, w)
    s_enc = torch.tensor(448.0 * 6.0 / x.abs().max().item(), dtype=torch.float32).double()
    block_amax = tiles.abs().amax(dim=(1, 3), keepdim=True)
    scale = (block_amax * (s_enc / 6.0)).float().to(torch.float8_e4m3fn).double()
    multiplier = torch.where(scale > 0, s_enc / scale, 0.0)
    values = e2m1_round((tiles * multiplier).float().double())
    dequantized = torch.where(scale > 0, values * scale / s_enc, 0.0)
    return dequantized.reshape(r, c), values.reshape(r, c), scale.reshape(-1)
