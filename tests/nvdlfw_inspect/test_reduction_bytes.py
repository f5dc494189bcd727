"""The statistics reduction costs each rank the same bytes whatever the world size: two packed all-reduces
per step, measured at 2, 4 and 8 gloo processes with ``benchmarks/stats_reduction.py``'s worker."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import spawning

from nvdlfw_inspect.stats.fields import FIELDS
from nvdlfw_inspect.stats.reduce import HEADER, MIN_WIDTH, SUM_WIDTH

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "stats_reduction.py"
sys.path.insert(0, str(BENCHMARK.parent))
from stats_reduction import all_gather_payload, per_rank_traffic, traffic  # noqa: E402

REQUESTS = 24


@spawning.needs_gloo
def test_bytes_per_step_are_flat_in_the_world_size(tmp_path):
    steady = {}
    for world in (2, 4, 8):
        out = spawning.spawn(BENCHMARK, "worker", world, tmp_path / str(world), limit_s=240)
        for rank in range(world):
            steps = json.loads((out / f"bytes{rank}.json").read_text())["steps"]
            first, *rest = [[tuple(call) for call in step] for step in steps]
            # the first step agrees on the rows' order (an object gather: its sizes, then its bytes), then reduces
            assert [op for op, _ in first] == ["all_reduce", "all_gather", "all_gather", "all_reduce", "all_reduce"]
            assert all(step == rest[0] for step in rest)
            steady[(world, rank)] = rest[0]
    packed = [("all_reduce", 8 * (HEADER + REQUESTS * MIN_WIDTH)), ("all_reduce", 8 * REQUESTS * SUM_WIDTH)]
    assert set(map(tuple, steady.values())) == {tuple(packed)}  # every rank, every world: the same two payloads
    payload = sum(b for _, b in packed)
    for world in (2, 4, 8, 1024, 16384):
        sent, received = per_rank_traffic(packed, world)
        assert sent == received < 2 * payload  # flat: at most twice the payload, whatever the world
    # the all-gather it replaced: (rows + 1) x one float64 per field from every other rank
    assert all_gather_payload(REQUESTS) == (REQUESTS + 1) * len(FIELDS) * 8
    assert traffic("all_gather", all_gather_payload(REQUESTS), 16384)[1] > 1000 * per_rank_traffic(packed, 16384)[1]
