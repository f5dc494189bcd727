"""Every fused kernel of ``lowprec``: numbers and tensors in, tensors out.

The Triton modules (``cast``, ``scales``, ``block_fp8``, ``nvfp4``) import Triton, so callers import
them lazily, only once :func:`runs_on` said a kernel runs; ``cpu_cast`` is C for CPU tensors, compiled on first
use (its own ``runs_on``). Whether kernels run at all is one setting, :func:`set_kernel_mode`: ``"auto"`` (the
default) runs them wherever they can run, ``"emulated"`` casts with plain torch operations everywhere (the
reference the kernels equal bit for bit).
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from lowprec.errors import LowprecValueError

KERNEL_MODES = ("auto", "emulated")
_mode = "auto"


def set_kernel_mode(mode: str) -> str:
    """Run the fused kernels where they can run (``"auto"``) or never (``"emulated"``); returns the
    previous mode, so a caller can put it back."""
    global _mode
    if mode not in KERNEL_MODES:
        raise LowprecValueError(f"lowprec kernel mode must be one of {', '.join(map(repr, KERNEL_MODES))}; got {mode!r}")
    previous, _mode = _mode, mode
    return previous


def kernel_mode() -> str:
    """The mode :func:`set_kernel_mode` set last (``"auto"`` until then)."""
    return _mode


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.cache
def _has_fp8_conversions(device: torch.device) -> bool:
    """Triton's FP8 types need compute capability 8.9 or later (as do FP8 GEMMs)."""
    return torch.cuda.get_device_capability(device) >= (8, 9)


def runs_on(tensor: torch.Tensor) -> bool:
    """Whether the kernels cast ``tensor``: a 2-D tensor on a CUDA device with FP8 support, with Triton
    installed and the mode ``"auto"``, outside ``torch.compile`` (the compiler fuses the same torch
    operations itself)."""
    return (
        _mode == "auto"
        and not torch.compiler.is_compiling()
        and tensor.is_cuda
        and tensor.dim() == 2
        and _triton_installed()
        and _has_fp8_conversions(tensor.device)
    )
