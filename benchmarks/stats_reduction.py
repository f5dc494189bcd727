"""Bytes each rank sends and receives per ``debug_api.step()`` to reduce the statistics, against the world size.

Runs ``--requests`` statistics requests (the issue's Llama-8B-like case: 32 layers x 7 GEMM layers x 3 tensors
= 672) on 2, 4 and 8 gloo processes of this machine, records every collective the statistics issue on their own group and
its payload, and turns the payloads into per-rank traffic with the ring algorithms' known costs (an all-reduce
of B bytes: 2(p-1)/p B sent and received; an all-gather of B bytes per rank: (p-1) B). The last rows
extrapolate to 1,024 and 16,384 ranks with the payload measured at the largest world (it does not depend on
it), beside the all-gather this replaced ((rows + 1) x 13 float64 per rank, gathered from every rank).

    python benchmarks/stats_reduction.py [--requests 672] [--steps 4] [--worlds 2,4,8]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nvdlfw_inspect.stats.fields import FIELDS

EXTRAPOLATED = (1024, 16384)


def all_gather_payload(rows: int) -> int:
    """Bytes per rank of the all-gather the all-reduces replaced: the rows and a stamp row of float64 partials."""
    return (rows + 1) * len(FIELDS) * 8


def traffic(op: str, payload: int, world: int) -> tuple[float, float]:
    """(bytes sent, bytes received) by one rank for ``op`` of ``payload`` bytes per rank, ring algorithms."""
    if op == "all_reduce":
        moved = 2 * (world - 1) / world * payload
        return moved, moved
    return (world - 1) * payload, (world - 1) * payload  # all_gather


def record_collectives(group_class: type) -> list[tuple[str, int]]:
    """Wrap the collectives of ``group_class`` (the statistics' own group, ``OwnGroup``) to record ``(op, payload
    bytes of this rank)`` for each call; its object gather is two all-gathers (of the sizes, of the bytes)."""
    calls: list[tuple[str, int]] = []

    def wrap(name: str) -> None:
        original = getattr(group_class, name)

        def recorded(self, tensor, *args, **kwargs):
            calls.append((name, tensor.numel() * tensor.element_size()))
            return original(self, tensor, *args, **kwargs)

        setattr(group_class, name, recorded)

    wrap("all_reduce")
    wrap("all_gather")
    return calls


def worker(rank: int, world: int, out_dir: Path, requests: int = 24, steps: int = 3) -> None:
    """``steps`` steps of ``requests`` statistics requests (mean, std, min, max of small tensors) reduced over
    every rank; saves, per step, the collectives issued and their payloads (``bytes{rank}.json``)."""
    import nvdlfw_inspect.api as debug_api
    from nvdlfw_inspect.logging import BaseLogger
    from nvdlfw_inspect.stats.desync import OwnGroup

    calls = record_collectives(OwnGroup)

    class Drop(BaseLogger):
        def log_scalar(self, name, value, iteration):
            pass

    stats = ["mean", "std", "min", "max"]
    config = {
        "all": {
            "enabled": True,
            "layers": {"layer_name_regex_pattern": ".*"},
            "LogTensorStats": {"enabled": True, "tensors": ["activation", "gradient", "weight"], "stats": stats},
        }
    }
    debug_api.initialize(config_file=config, log_dir=str(out_dir / f"logs{rank}"), statistics_logger=Drop())
    debug_api.set_tensor_reduction_group(dist.group.WORLD)
    generator = torch.Generator().manual_seed(rank)
    per_step = []
    for _ in range(steps):
        for i in range(requests):
            layer, tensor = divmod(i, 3)
            values = torch.randn(64, generator=generator)
            debug_api.log_tensor_stats(
                layer_name=f"layers.{layer}", tensor=values, tensor_name=("activation", "gradient", "weight")[tensor]
            )
        del calls[:]
        debug_api.step()
        per_step.append(list(calls))
    debug_api.end_debug()
    (out_dir / f"bytes{rank}.json").write_text(json.dumps({"requests": requests, "steps": per_step}))


def per_rank_traffic(calls: list[tuple[str, int]], world: int) -> tuple[float, float]:
    sent = received = 0.0
    for op, payload in calls:
        s, r = traffic(op, payload, world)
        sent, received = sent + s, received + r
    return sent, received


def _entry(rank: int, world: int, init: str, out_dir: str, requests: int, steps: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        worker(rank, world, Path(out_dir), requests, steps)
    finally:
        dist.destroy_process_group()


def measure(world: int, requests: int, steps: int) -> list[list[tuple[str, int]]]:
    """Rank 0's collectives per step at ``world`` gloo processes."""
    with tempfile.TemporaryDirectory() as directory:
        mp.start_processes(
            _entry, args=(world, f"{directory}/init", directory, requests, steps), nprocs=world, start_method="spawn"
        )
        return [[tuple(call) for call in step] for step in json.loads(Path(directory, "bytes0.json").read_text())["steps"]]


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000:
            return f"{n:.3g} {unit}"
        n /= 1000
    return f"{n:.3g} PB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=672)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--worlds", default="2,4,8")
    args = parser.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    rows = args.requests  # one row per request
    old_payload = all_gather_payload(rows)
    print(f"# statistics reduction traffic per step() and rank, {args.requests} requests (torch {torch.__version__})")
    columns = ["ranks", "how", "collectives per step (steady)", "payload per rank", "sent per rank", "received per rank"]
    print("| " + " | ".join([*columns, "received by the all-gather it replaced"]) + " |")
    print("|---" * (len(columns) + 1) + "|")

    def row(world: int, how: str, calls: list[tuple[str, int]]) -> None:
        sent, received = per_rank_traffic(calls, world)
        cells = [str(world), how, " + ".join(op for op, _ in calls), _size(sum(b for _, b in calls)), _size(sent)]
        cells += [_size(received), _size(traffic("all_gather", old_payload, world)[1])]
        print("| " + " | ".join(cells) + " |")

    for world in worlds:
        started = time.perf_counter()
        steps = measure(world, args.requests, args.steps)
        row(world, f"measured ({time.perf_counter() - started:.0f} s)", steps[-1])
    for world in EXTRAPOLATED:
        row(world, "extrapolated", steps[-1])
    first = steps[0]
    print(f"\nfirst step (the ranks agree on the order of the rows once): {', '.join(f'{op} {_size(b)}' for op, b in first)}")


if __name__ == "__main__":
    sys.exit(main())
