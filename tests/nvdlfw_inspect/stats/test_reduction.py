"""reduce_partials without a process group: world size 1, nothing to merge and nothing sent."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from nvdlfw_inspect.stats import compute_partials, reduce_partials
from nvdlfw_inspect.stats.partials import empty_partials


@pytest.fixture
def no_collectives(monkeypatch):
    """Any collective call would fail the test."""

    def forbidden(*args, **kwargs):
        raise AssertionError("no collective may run without a process group")

    for name in ("all_gather", "gather", "all_reduce", "all_gather_object", "broadcast"):
        monkeypatch.setattr(dist, name, forbidden)


@pytest.mark.parametrize(
    "partials",
    [compute_partials(torch.randn(10)), compute_partials(torch.ones(3), {"abs_min_nonzero"}), empty_partials()],
    ids=["random", "with-optional-field", "empty"],
)
@pytest.mark.parametrize("group", [None, object()], ids=["default-group", "some-group"])
@pytest.mark.parametrize("to_last_rank", [False, True])
def test_single_process_returns_the_partials_unchanged(no_collectives, partials, group, to_last_rank):
    assert not dist.is_initialized()
    before = partials.clone()
    assert reduce_partials(partials, group, to_last_rank=to_last_rank) is partials
    assert torch.equal(partials, before)
