"""Side-by-side timing across Python environments.

The reference ``nvdlfw_inspect`` shares our package's import name, so it runs in its own environment
(``reference_python``). Each environment hosts one long-lived worker process that times one variant
per request; the driver interleaves requests so machine noise hits every variant alike.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import ctypes.util
import json
import os
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import venv
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
REFERENCE_VENV = ROOT / "benchmarks" / ".reference-venv"
REFERENCE_REQUIREMENT = "nvdlfw-inspect==0.2.2"
# A directory holding the reference (``pip install --target DIR``): used instead of the virtual
# environment, which needs the network; set but empty, the reference is not timed.
REFERENCE_PATH_VARIABLE = "NVDLFW_INSPECT_REFERENCE_PATH"


def reference_python() -> tuple[Path | None, str]:
    """The interpreter of an environment with the reference installed, created on first use, or with
    ``$NVDLFW_INSPECT_REFERENCE_PATH`` set, this interpreter seeing that directory instead of ``src/``.

    Returns ``(path, "")`` or ``(None, reason)`` when it cannot be set up (for example offline).
    """
    if REFERENCE_PATH_VARIABLE in os.environ:
        return _python_with_reference(os.environ[REFERENCE_PATH_VARIABLE])
    python = REFERENCE_VENV / "bin" / "python"
    stamp = REFERENCE_VENV / ".installed"
    if stamp.exists() and stamp.read_text() == REFERENCE_REQUIREMENT:
        return python, ""
    print(f"Setting up {REFERENCE_REQUIREMENT} in {REFERENCE_VENV} (once) ...", file=sys.stderr)
    venv.create(REFERENCE_VENV, with_pip=True, clear=True)
    command = [str(python), "-m", "pip", "install", "-q", "-c", str(ROOT / "constraints.txt"), "torch", REFERENCE_REQUIREMENT]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        return None, f"pip install {REFERENCE_REQUIREMENT} failed: {result.stderr.strip().splitlines()[-1:]}"
    stamp.write_text(REFERENCE_REQUIREMENT)
    return python, ""


def _python_with_reference(directory: str) -> tuple[Path | None, str]:
    """A launcher running this interpreter with ``PYTHONPATH`` = ``directory`` and ``benchmarks/`` only,
    checked to import the reference from ``directory`` (not our package from ``src/`` or an install)."""
    if not directory:
        return None, f"{REFERENCE_PATH_VARIABLE} is empty: no reference to time"
    target = Path(directory).resolve()
    launcher_dir = Path(tempfile.mkdtemp(prefix="nvdlfw-reference-"))
    atexit.register(shutil.rmtree, launcher_dir, ignore_errors=True)
    launcher = launcher_dir / "python"
    path = shlex.quote(os.pathsep.join([str(target), str(ROOT / "benchmarks")]))
    launcher.write_text(f'#!/bin/sh\nPYTHONPATH={path} exec {shlex.quote(sys.executable)} "$@"\n')
    launcher.chmod(0o755)
    find = "import importlib.util; spec = importlib.util.find_spec('nvdlfw_inspect'); print(spec.origin if spec else 'nowhere')"
    result = subprocess.run([str(launcher), "-c", find], capture_output=True, text=True)
    origin = result.stdout.strip()
    if result.returncode != 0 or not Path(origin).resolve().is_relative_to(target):
        return None, f"{REFERENCE_PATH_VARIABLE}={directory}: nvdlfw_inspect imports from {origin or result.stderr.strip()!r}"
    return launcher, ""


def write_json(path: str | Path, benchmark: str, device: str, measures: dict) -> None:
    """The benchmark's key numbers for scripts/gpu_check.sh, which tabulates them against the targets."""
    Path(path).write_text(json.dumps({"benchmark": benchmark, "device": device, "measures": measures}, indent=1) + "\n")


def git_commit() -> str:
    """The checkout's short commit, marked when tracked files differ from it: every results table names its code."""
    try:
        git = ["git", "-C", str(ROOT)]
        head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
    except OSError:
        return "unknown"
    if head.returncode != 0:
        return "unknown"
    return head.stdout.strip() + (" (with uncommitted changes)" if dirty.stdout.strip() else "")


def device_name(device: str | torch.device) -> str:
    """What a benchmark's JSON names as its device: the GPU's name, or ``cpu``."""
    return torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else "cpu"


def synchronize(device: str | torch.device) -> None:
    """Wait for the device's queued work, so a clock read afterwards covers it (CUDA only)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


class _OpCounter(TorchDispatchMode):
    """Counts every op that reaches the Python dispatcher, by name, and runs it unchanged."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.name()] += 1
        return func(*args, **(kwargs or {}))


def count_ops(fn: Callable[[], object]) -> Counter[str]:
    """The ops dispatched while ``fn()`` runs, by name (``aten::add.Tensor``, ``aten::mm``,
    ``nvdlfw_inspect::...``), each with how many times it ran.

    Counted with a ``TorchDispatchMode``, so each op is counted where it is dispatched: aten ops and
    custom ops registered through ``torch.library`` (the ops inside a custom op's own implementation are
    not counted again), in forward and in backward, whatever the device. Composite ops appear as the ops
    they decompose into; work done outside the dispatcher (Python, ctypes) is not seen.
    """
    with _OpCounter() as counter:
        fn()
    return counter.counts


def count_python_calls(fn: Callable[[], object]) -> int:
    """The function calls made while ``fn()`` runs, Python functions and builtins alike (``sys.setprofile``'s
    ``call`` and ``c_call`` events): an exact count of the host's Python work, where timings on a shared
    machine drift by more than the difference sought."""
    calls = 0

    def profile(frame: object, event: str, arg: object) -> None:
        nonlocal calls
        if event == "call" or (event == "c_call" and arg is not sys.setprofile):  # not the call that ends counting
            calls += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


# Ops that make the host wait for a GPU (``.item()``, host data into a tensor): the CPU's stand-in for syncs.
SYNC_PROXY_OPS = ("aten::_local_scalar_dense", "aten::lift_fresh", "aten::lift_fresh_copy")


def page_faults() -> int:
    """Page faults of this process so far (minor and major): memory the OS maps in on first touch, which a step pays
    for each buffer its allocator took from the OS anew."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_minflt + usage.ru_majflt


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
MMAP_THRESHOLD, TRIM_THRESHOLD = 32 << 20, 1 << 30  # the pinned thresholds (32 MiB: glibc's largest for mmap)
PINNED_MALLOC_ENVIRONMENT = {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD), "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD)}
"""The same thresholds set for a process from its start (glibc reads them from the environment)."""


def pin_malloc_thresholds() -> bool:
    """Fix glibc malloc's thresholds for the rest of the process (buffers up to 32 MiB from the heap, the heap's top
    handed back to the OS only beyond 1 GiB), so that freed memory stays mapped. By default glibc adapts both as the
    process frees, and whether a step's end hands the heap's top back (to fault it in again in the next step) then
    depends on how the process's allocations happen to lie: measured here, one model 0 and an identical one, with a
    few small tensors kept a step longer, ~1,400 page faults per step (8 x Linear(1024), ~10% of its step). False
    where there is no glibc ``mallopt``: nothing changed."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def count_syncs(fn: Callable[[], object], device: str | torch.device) -> int:
    """Host synchronizations while ``fn()`` runs: on CUDA, the warnings of the sync debug mode; on the
    CPU, where nothing waits, the ops that would synchronize on a GPU (``SYNC_PROXY_OPS``)."""
    if torch.device(device).type != "cuda":
        counts = count_ops(fn)
        return sum(counts[name] for name in SYNC_PROXY_OPS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchronizing" in str(warning.message) for warning in caught)


@contextlib.contextmanager
def debug_session(config: dict | None, log_dir: str) -> Iterator[bool]:
    """Runs the body with ``config`` initialized, with lowprec's features (None: without debugging); yields whether
    debugging is on. Ours is imported here only: a reference worker imports this module too."""
    if config is None:
        yield False
        return
    import lowprec
    import nvdlfw_inspect.api as debug_api

    debug_api.initialize(config_file=config, feature_dirs=[lowprec.FEATURE_DIR], log_dir=log_dir)
    try:
        yield True
    finally:
        debug_api.end_debug()


def mean_seconds(
    fn: Callable[[], object], steps: int, device: str | torch.device, cpu_seconds: list[float] | None = None
) -> float:
    """Seconds per call of ``fn`` over ``steps`` calls, after one warm-up call. ``cpu_seconds`` gets the same calls'
    process CPU time per call: the work done, which a shared machine's other load does not stretch as it stretches
    the wall clock (on a GPU it counts the host's work only)."""
    fn()
    synchronize(device)
    start, cpu_start = time.perf_counter(), time.process_time()
    for _ in range(steps):
        fn()
    synchronize(device)
    if cpu_seconds is not None:
        cpu_seconds.append((time.process_time() - cpu_start) / steps)
    return (time.perf_counter() - start) / steps


def serve(run_variant: Callable[[str], float]) -> None:
    """Worker loop: read a variant name per line from stdin, answer its seconds per step as JSON."""
    for line in sys.stdin:
        print(json.dumps(run_variant(line.strip())), flush=True)


class Worker:
    """A worker process running ``script --worker`` under ``python``."""

    def __init__(self, python: Path | str, script: Path, args: list[str]):
        self._process = subprocess.Popen(
            [str(python), str(script), "--worker", *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT
        )

        self._requests, self._answers = self._process.stdin, self._process.stdout

    def time(self, variant: str) -> float:
        self._requests.write(variant + "\n")
        self._requests.flush()
        answer = self._answers.readline()
        if not answer:
            raise RuntimeError(f"benchmark worker died while timing {variant!r} (exit code {self._process.wait()})")
        return json.loads(answer)

    def close(self) -> None:
        self._requests.close()
        self._process.wait()


class InProcess:
    """A worker that times variants in this process with ``run_variant(variant) -> seconds per step``."""

    def __init__(self, run_variant: Callable[[str], float]):
        self.time = run_variant

    def close(self) -> None:
        pass


def interleave(plan: list[tuple[str, Worker | InProcess, str]], repeats: int) -> dict[str, float]:
    """Fastest seconds per step of each ``(label, worker, variant)`` over ``repeats`` rounds, after one
    warm-up round. The minimum, not the median: other load on the machine only ever adds time."""
    samples: dict[str, list[float]] = {label: [] for label, _, _ in plan}
    for round_index in range(repeats + 1):
        for label, worker, variant in plan:
            seconds = worker.time(variant)
            if round_index > 0:
                samples[label].append(seconds)
    return {label: min(values) for label, values in samples.items()}


def print_ratio_table(title: str, fastest: dict[str, float], baseline: str, missing: dict[str, str]) -> None:
    width = max(24, *(len(label) for label in [*fastest, *missing]))
    print(title)
    print(f"{'variant':<{width}} {'ms/step':>9} {'ratio':>7}")
    for label, seconds in fastest.items():
        print(f"{label:<{width}} {seconds * 1e3:>9.2f} {seconds / fastest[baseline]:>7.3f}")
    for label, reason in missing.items():
        print(f"{label:<{width}} {'-':>9} {'-':>7}  ({reason})")
