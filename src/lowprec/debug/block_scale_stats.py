"""Statistics of the block scales themselves, as separate statistics requests so that they reduce exactly
over micro-batches and ranks.

- ``scale_inv_std``: the standard deviation of the logged scale_inv values over every block (MXFP8: the
  E8M0 byte, i.e. the exponent; NVFP4: the E4M3 block scale; FP8 block scaling: the fp32 scale_inv),
  merged with Chan's formula as any tensor's ``std``.
- ``scale_exp_hist``: how many blocks sit at each power of two, the exponent being ``floor(log2)`` of a
  block's whole dequantization scale (MXFP8: ``2**(byte - 127)``; FP8 block scaling: its scale_inv;
  NVFP4: the E4M3 block scale times the per-tensor decode scale). Logged as the counts
  ``scale_exp_hist_m32`` ... ``_m1``, ``_0``, ``_p1`` ... ``_p15`` (bin ``m10`` counts scales in
  ``[2**-10, 2**-9)``), ``_under`` (below ``2**-32``: MXFP8's ``2**-127`` of all-zero blocks, the zero
  scale of NVFP4's, and any NaN scale) and ``_over`` (``2**16`` and above); the counts add up over ranks and
  micro-batches. Every FP8 block scaling block of zeros has scale 1: bin ``0``.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch

from nvdlfw_inspect.stats.buffers import STATS_BUFFERS
from nvdlfw_inspect.stats.fields import empty_partials, set_fields
from nvdlfw_inspect.stats.kernels import compute_partials

STD, HIST = "scale_inv_std", "scale_exp_hist"
SCALE_STATS = (STD, HIST)
HIST_MIN, HIST_MAX = -32, 15
COLUMNWISE = "_columnwise"


def _tag(exponent: int) -> str:
    return "0" if exponent == 0 else f"{'m' if exponent < 0 else 'p'}{abs(exponent)}"


HIST_TAGS = ("under", *(_tag(e) for e in range(HIST_MIN, HIST_MAX + 1)), "over")


def exponent_bins(scales: torch.Tensor) -> torch.Tensor:
    """Blocks per histogram bin (``HIST_TAGS`` order) of the dequantization ``scales``, on their device."""
    scales = scales.reshape(-1).float()
    positive = scales > 0
    exponent = torch.frexp(torch.where(positive, scales, 1.0))[1] - 1  # floor(log2), exact
    index = (exponent - HIST_MIN + 1).clamp(0, len(HIST_TAGS) - 1)
    index = torch.where(positive & scales.isfinite(), index, torch.where(scales.isinf(), len(HIST_TAGS) - 1, 0))
    counts = torch.zeros(len(HIST_TAGS), dtype=torch.float64, device=scales.device)
    return counts.scatter_add_(0, index, torch.ones_like(index, dtype=torch.float64))  # bincount would wait for the device


def feed_scale_stats(
    key: Hashable, logged_scale_inv: torch.Tensor, scales: torch.Tensor, stats: list[tuple[str, str]], **request: Any
) -> None:
    """Feed ``stats`` (``(written, name)`` with name in ``SCALE_STATS``) of one cast: one request for the
    standard deviation, one per histogram bin (logged as ``{written}_{bin}``, before a ``_columnwise``
    suffix), each keyed under ``key``."""
    for written, name in stats:
        if name == STD:
            STATS_BUFFERS.feed((key, written), stats=[(written, "std")], partials=compute_partials(logged_scale_inv), **request)
            continue
        base = written.removesuffix(COLUMNWISE)
        suffix = written[len(base) :]
        counts = exponent_bins(scales)
        for i, tag in enumerate(HIST_TAGS):
            partials = set_fields(empty_partials(scales.device), {"count": counts[i]})
            STATS_BUFFERS.feed((key, written, tag), stats=[(f"{base}_{tag}{suffix}", "count")], partials=partials, **request)
