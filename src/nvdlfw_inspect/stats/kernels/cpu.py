"""The one-read statistics kernel for CPU tensors (``cpu_partials.c``), compiled on first use.

The C source ships with the package; the first process that needs it compiles it, after the partials
layout generated from ``stats.fields`` (``layout_header``: the field indices, merge rules and
identities), with the system's C compiler (``$CC`` or ``cc``) into a per-user cache
(``$NVDLFW_INSPECT_CACHE``, default ``~/.cache/nvdlfw_inspect``), keyed by the hash of the source, the
layout and the CPU it is built for. Where no compiler works, or with ``NVDLFW_INSPECT_NATIVE=0``,
statistics use several torch reductions instead (same results, slower), and the debug log says why once.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import math
import os
import platform
import subprocess
import tempfile
from array import array
from collections.abc import Callable, Sequence
from importlib import resources
from pathlib import Path

import torch

from nvdlfw_inspect.stats.fields import LAYOUT, MERGE_RULES

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # float64 keeps the torch path
FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-ffp-contract=off", "-shared", "-fPIC"]
logger = logging.getLogger("nvdlfw_inspect")


def c_name(field: str) -> str:
    """The C enum constant of a field: ``abs_min_nonzero`` -> ``F_ABS_MIN_NONZERO``."""
    return "F_" + field.upper()


def _c_double(value: float) -> str:
    return {math.inf: "INFINITY", -math.inf: "-INFINITY"}.get(value, repr(float(value)))


def layout_header() -> str:
    """The partials layout of ``stats.fields`` as C: ``F_<FIELD>`` indices and ``N_FIELDS``, each field's
    merge rule (``FIELD_RULE``) and identity (``FIELD_IDENTITY``). Compiled before ``cpu_partials.c``, which
    defines no layout of its own."""
    rules = ", ".join(f"RULE_{rule.upper()}" for rule in MERGE_RULES)
    indices = ", ".join(f"{c_name(field.name)} = {i}" for i, field in enumerate(LAYOUT))
    return (
        "/* Generated from nvdlfw_inspect/stats/fields.py by kernels/cpu.py: the partials layout. */\n"
        "#include <math.h>\n"
        f"enum {{ {rules} }};\n"
        f"enum {{ {indices}, N_FIELDS = {len(LAYOUT)} }};\n"
        f"static const int FIELD_RULE[N_FIELDS] = {{{', '.join(f'RULE_{field.merge.upper()}' for field in LAYOUT)}}};\n"
        f"static const double FIELD_IDENTITY[N_FIELDS] = {{{', '.join(_c_double(field.identity) for field in LAYOUT)}}};\n"
        '#line 1 "cpu_partials.c"\n'
    )


def _cache_dir() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "nvdlfw_inspect"
    return Path(os.environ.get("NVDLFW_INSPECT_CACHE", default))


def _cpu_identity() -> str:
    """What ``-march=native`` compiles for: a cache shared by different machines keeps one build each."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            flags = next((line for line in cpuinfo if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def _compile(source: str, library: Path, stem: str) -> None:
    """Compile into a temporary file first, then rename: ranks starting together never see half a file."""
    library.parent.mkdir(parents=True, exist_ok=True)
    compiler = os.environ.get("CC", "cc")
    with tempfile.TemporaryDirectory(dir=library.parent) as work:
        source_path, built = Path(work) / f"{stem}.c", Path(work) / library.name
        source_path.write_text(source)
        command = [compiler, *FLAGS, "-o", str(built), str(source_path), "-lm"]
        result = subprocess.run(command, capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            raise OSError(f"{' '.join(command)} failed: {result.stderr.strip()[-2000:]}")
        os.replace(built, library)


def load_library(stem: str, source: str) -> ctypes.CDLL:
    """The shared library of C ``source``, compiled on first use into the per-user cache as ``<stem>-<hash>.so``
    (the hash of the source, the flags and the CPU), so every kernel of the project builds and caches alike
    (``lowprec`` casts with it too). Raises OSError or SubprocessError where no compiler works."""
    digest = hashlib.sha256((source + " ".join(FLAGS) + _cpu_identity()).encode()).hexdigest()[:16]
    library = _cache_dir() / f"{stem}-{digest}.so"
    if not library.exists():
        _compile(source, library, stem)
    return ctypes.CDLL(str(library))


@functools.cache
def _statistics_library() -> ctypes.CDLL | None:
    """``cpu_partials.c`` built after the partials layout, or None (said once in the log) where it cannot be."""
    if os.environ.get("NVDLFW_INSPECT_NATIVE", "1") == "0":
        return None
    source = layout_header() + resources.files(__package__).joinpath("cpu_partials.c").read_text(encoding="utf-8")
    try:
        library = load_library("cpu_partials", source)
        for symbol in ("tensor_stats", "column_amax"):  # a library without them fails here
            getattr(library, symbol)
    except (OSError, AttributeError, subprocess.SubprocessError) as error:
        logger.info(f"statistics of CPU tensors use torch reductions: the C kernel is unavailable ({error})")
        return None
    return library


def forget_library() -> None:
    """Load (or build) the kernel anew at the next use, as after a change of ``$CC``, the cache or the switch."""
    for loader in (_statistics_library, native_kernel, column_amax_kernel):
        loader.cache_clear()


@functools.cache
def column_amax_kernel() -> Callable[[torch.Tensor], torch.Tensor | None] | None:
    """``amax(x)``: the largest magnitude of each column of the contiguous 2-D CPU tensor ``x`` (float32, bfloat16 or
    float16), NaN ignored, as float64 in one read (None where memory ran out); None when the kernel cannot be built."""
    library = _statistics_library()
    if library is None:
        return None
    function = library.column_amax
    function.restype = ctypes.c_int
    function.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p]

    def amax(x: torch.Tensor) -> torch.Tensor | None:
        out = torch.empty(x.shape[1], dtype=torch.float64)
        status = function(x.data_ptr(), x.shape[0], x.shape[1], DTYPE_CODES[x.dtype], out.data_ptr())
        return out if status == 0 else None

    return amax


@functools.cache
def native_kernel() -> Callable[..., None] | None:
    """``kernel(x, table, rows, row_variants, scales, grid_max, grid_min_exp, grid_mantissa, want_abs_min,
    call_out, amax_out, want_moments)`` (the operator's arguments): the statistics of the contiguous CPU tensor ``x``
    (float32, bfloat16 or float16) merged into rows of the float64 ``table`` (see ``kernels.tensor_stats``);
    None when the kernel cannot be built."""
    library = _statistics_library()
    if library is None:
        return None
    function = library.tensor_stats
    function.restype = None
    pointer = ctypes.c_void_p
    function.argtypes = [pointer, ctypes.c_int64, *[ctypes.c_int] * 4, *[pointer] * 4, ctypes.c_int]
    function.argtypes += [pointer] * 5

    def kernel(
        x: torch.Tensor,
        table: torch.Tensor,
        rows: Sequence[int],
        row_variants: Sequence[int],
        scales: Sequence[torch.Tensor],
        grid_max: Sequence[float],
        grid_min_exp: Sequence[int],
        grid_mantissa: Sequence[int],
        want_abs_min: bool,
        call_out: torch.Tensor | None = None,
        amax_out: torch.Tensor | None = None,
        want_moments: bool = False,
    ) -> None:
        # The C arrays are Python ``array``s passed by address: building ctypes array types costs
        # microseconds per call, and this runs once per inspected tensor.
        rows_array, variants_array = array("q", rows), array("i", row_variants)
        grids = (None,) * 4  # NULL pointers
        if scales:
            scale_pointers = array("Q", [scale.data_ptr() for scale in scales])
            grid_arrays = (scale_pointers, array("f", grid_max), array("i", grid_min_exp), array("i", grid_mantissa))
            grids = tuple(values.buffer_info()[0] for values in grid_arrays)
        function(
            x.data_ptr(),
            x.numel(),
            DTYPE_CODES[x.dtype],
            int(want_abs_min),
            int(want_moments),
            len(scales),
            *grids,
            len(rows),
            rows_array.buffer_info()[0] if rows else None,
            variants_array.buffer_info()[0] if rows else None,
            table.data_ptr(),
            call_out.data_ptr() if call_out is not None else None,
            amax_out.data_ptr() if amax_out is not None else None,
        )

    return kernel
