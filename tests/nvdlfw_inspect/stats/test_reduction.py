"""reduce_partials without a process group: nothing to merge."""

from __future__ import annotations

import torch

from nvdlfw_inspect.stats import compute_partials, reduce_partials


def test_single_process_returns_the_partials_unchanged():
    p = compute_partials(torch.randn(10))
    assert reduce_partials(p) is p
    assert reduce_partials(p, to_last_rank=True) is p
