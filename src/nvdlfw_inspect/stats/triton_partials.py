"""The partial statistics of a CUDA tensor in one read: a Triton kernel, one program per block.

Each program loads its block once and writes the block's count, mean, M2 (two passes over the values
held in registers), min, max, sum of |x| and smallest non-zero |x|; ``merge_partials`` then merges
the block rows (Chan's formula, float64). With ``TRITON_INTERPRET=1`` the same kernel runs on CPU
tensors, which is how the tests check it on machines without a GPU.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from nvdlfw_inspect.stats.partials import FIELDS, identity_partials, merge_partials

BLOCK = 4096
OPTIONS = {"enable_fp_fusion": True}  # contracted multiply-adds are fine for statistics
CORE = FIELDS[:7]  # count, mean, m2, min, max, abs_sum, abs_min_nonzero: the fields the kernel writes


@triton.jit
def _block_partials(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offsets = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offsets < n
    x = tl.load(x_ptr + offsets, mask=valid, other=0.0).to(tl.float32)
    count = tl.sum(valid.to(tl.float32), axis=0)
    mean = tl.sum(x, axis=0) / count
    deviation = tl.where(valid, x - mean, 0.0)
    m2 = tl.sum(deviation * deviation, axis=0)
    has_nan = tl.sum((valid & (x != x)).to(tl.int32), axis=0) > 0
    low = tl.min(tl.where(valid, x, float("inf")), axis=0)
    high = tl.max(tl.where(valid, x, float("-inf")), axis=0)
    low = tl.where(has_nan, float("nan"), low)
    high = tl.where(has_nan, float("nan"), high)
    magnitude = tl.abs(x)
    abs_sum = tl.sum(magnitude, axis=0)
    smallest = tl.min(tl.where(valid & (magnitude > 0), magnitude, float("inf")), axis=0)
    smallest = tl.where(has_nan, float("nan"), smallest)
    row = out_ptr + pid.to(tl.int64) * 7
    tl.store(row + 0, count)
    tl.store(row + 1, mean)
    tl.store(row + 2, m2)
    tl.store(row + 3, low)
    tl.store(row + 4, high)
    tl.store(row + 5, abs_sum)
    tl.store(row + 6, smallest)


def triton_partials(tensor: torch.Tensor) -> torch.Tensor:
    """``compute_partials(tensor, every optional field)`` with one read of the (non-empty) tensor."""
    x = tensor.detach().reshape(-1)
    if not x.is_contiguous():
        x = x.contiguous()
    blocks = math.ceil(x.numel() / BLOCK)
    core = torch.empty(blocks, len(CORE), dtype=torch.float32, device=x.device)
    _block_partials[(blocks,)](x, core, x.numel(), BLOCK=BLOCK, **OPTIONS)
    rest = identity_partials(x.device)[len(CORE) :].expand(blocks, -1)
    return merge_partials(torch.cat([core.to(torch.float64), rest], dim=1))
