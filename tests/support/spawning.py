"""Gloo worker processes for the distributed tests: ``spawn`` runs one function of a workers module on
every rank, with a deadline, and turns a rank's failure into one AssertionError carrying its traceback."""

from __future__ import annotations

import importlib
import os
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SPAWN_LIMIT_S = 120.0
needs_gloo = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is not available"
)
"""The mark of a test that spawns gloo ranks: skipped where torch has no gloo backend."""


def spawn(workers: Path, body: str, world: int, tmp_path: Path, limit_s: float = SPAWN_LIMIT_S) -> Path:
    """Run ``body(rank, world, out_dir)`` of the module file ``workers`` on ``world`` gloo ranks, killing
    them after ``limit_s`` seconds; returns ``out_dir`` (``tmp_path / "logs"``), where they write."""
    out_dir, errors = tmp_path / "logs", tmp_path / "errors"
    out_dir.mkdir(parents=True, exist_ok=True)
    errors.mkdir()
    args = (str(workers), world, str(tmp_path / "init"), str(out_dir), str(errors), body)
    context = mp.start_processes(_entry, args=args, nprocs=world, start_method="spawn", join=False)
    deadline = time.monotonic() + limit_s
    try:
        while not context.join(max(deadline - time.monotonic(), 0.0)):  # False while some rank runs
            assert time.monotonic() < deadline, f"the ranks did not finish within {limit_s} s"
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as failure:
        details = "\n".join(p.read_text() for p in sorted(errors.iterdir()))
        raise AssertionError(f"a worker failed:\n{details}") from failure
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    return out_dir


def _entry(rank: int, workers: str, world: int, init_file: str, out_dir: str, errors: str, body: str) -> None:
    """A rank: set up a gloo group, run the body, tear down; a failure is written for the parent to show."""
    support = Path(__file__).resolve().parent  # tests/support, and tests/references beside it
    sys.path[:0] = [str(Path(workers).parent), str(support), str(support.parent / "references")]
    try:
        torch.set_num_threads(1)  # the ranks share the machine's cores
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        getattr(importlib.import_module(Path(workers).stem), body)(rank, world, Path(out_dir))
    except BaseException:
        Path(errors, f"rank{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        import nvdlfw_inspect.api as debug_api

        debug_api.end_debug()
        if dist.is_initialized():
            dist.destroy_process_group()
    # Every rank has finished and torn down. Skip the interpreter's finalization: there gloo rarely aborts
    # ("terminate called without an active exception", SIGABRT; about 1 run in 40 on a loaded 2-core
    # machine) after both ranks had destroyed their groups, with no reference to a group left in
    # nvdlfw_inspect. What the tests check was written and closed before this point.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
