"""Time of ``initialize`` for a config of many sections: ours next to the reference ``nvdlfw-inspect`` 0.2.2.

A config generated per layer (one section a layer, as tools writing per-layer plans do) must load in about the
time the reference takes: ``initialize`` compares no two sections pairwise (only hashing finds the overlaps it
warns about). Two selector kinds, each section selecting one layer with ``LogTensorStats``:

  exact    ``exact_layer_names: [model.layers.I.fc1]``
  regex    ``layer_name_regex_pattern: layers\\.I\\.fc1$``

Each is the fastest of ``--repeats`` interleaved rounds (one ``initialize`` + ``end_debug()`` each), one thread.

Run: ``python benchmarks/config_load.py [--sections N] [--repeats R] [--no-reference]``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from harness import InProcess, Worker, interleave, reference_python, serve

KINDS = ("exact", "regex")


def config(sections: int, kind: str) -> dict:
    """``sections`` one-layer sections of ``kind``, each configuring ``LogTensorStats``."""

    def selector(i: int) -> dict:
        if kind == "exact":
            return {"exact_layer_names": [f"model.layers.{i}.fc1"]}
        return {"layer_name_regex_pattern": rf"layers\.{i}\.fc1$"}

    stats = {"enabled": True, "stats": ["max"], "tensors": ["activation"], "freq": 1}
    return {f"layer_{i}": {"enabled": True, "layers": selector(i), "LogTensorStats": dict(stats)} for i in range(sections)}


def seconds_to_load(sections: int, kind: str) -> float:
    """Seconds of one ``initialize`` of the config (``end_debug`` not counted)."""
    import nvdlfw_inspect.api as debug_api

    torch.set_num_threads(1)
    cfg = config(sections, kind)
    with tempfile.TemporaryDirectory() as log_dir, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        start = time.perf_counter()
        debug_api.initialize(config_file=cfg, log_dir=log_dir)
        seconds = time.perf_counter() - start
        debug_api.end_debug()
    return seconds


def measure(args: argparse.Namespace) -> tuple[dict[str, float], str | None]:
    """Fastest seconds per label (``ours exact``, ``reference regex``, ...) and why the reference is missing."""
    ours = InProcess(lambda kind: seconds_to_load(args.sections, kind))
    plan = [(f"ours {kind}", ours, kind) for kind in KINDS]
    workers: list[Worker] = []
    reason = "skipped (--no-reference)" if args.no_reference else None
    if not args.no_reference:
        python, reason = reference_python()
        if python is not None:
            reference = Worker(python, Path(__file__), ["--sections", str(args.sections)])
            workers.append(reference)
            plan += [(f"reference {kind}", reference, kind) for kind in KINDS]
            reason = None
    try:
        return interleave(plan, args.repeats), reason
    finally:
        for worker in workers:
            worker.close()


def print_table(sections: int, fastest: dict[str, float], reason: str | None) -> None:
    print(f"initialize with {sections} one-layer sections, 1 thread ({sys.platform}, torch {torch.__version__})")
    print(f"{'selectors':<10} {'ours s':>8} {'reference s':>12} {'ours/reference':>15}")
    for kind in KINDS:
        ours, reference = fastest[f"ours {kind}"], fastest.get(f"reference {kind}")
        shown = f"{reference:>12.3f} {ours / reference:>15.2f}" if reference else f"{'-':>12} {'-':>15}"
        print(f"{kind:<10} {ours:>8.3f} {shown}")
    if reason:
        print(f"reference: not measured ({reason})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", type=int, default=6000, help="sections in the config (default 6000)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds (fastest reported)")
    parser.add_argument("--no-reference", action="store_true", help="do not time the reference nvdlfw-inspect")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        serve(lambda kind: seconds_to_load(args.sections, kind))
        return
    fastest, reason = measure(args)
    print_table(args.sections, fastest, reason)


if __name__ == "__main__":
    main()
