"""Fused block-scaled casts and decodes for CPU tensors (``cpu_cast.c``), compiled on first use.

On a CPU the torch emulation of a block cast (``BlockQuantizer._orientation``) is a chain of a dozen full-tensor
operations, each a pass over memory, and an emulated GEMM's decode a table gather plus two multiplies: together most
of a block-format training step. The C kernel makes each orientation's codes and scales in one pass and decodes in
one, with the same fp32 operations, so the results equal the emulation's bit for bit. It is built and cached as the
statistics kernel is (``nvdlfw_inspect.stats.kernels.cpu.load_library``: ``$CC``, ``$NVDLFW_INSPECT_CACHE``); where
no compiler works, or with ``LOWPREC_NATIVE=0``, or in the ``"emulated"`` kernel mode, the torch path runs instead
(same results, slower) and the log says why once.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import os
import subprocess
from importlib import resources

import torch

from lowprec import kernels
from lowprec.formats import hadamard
from lowprec.formats.elements import E2M1, FP8Format, MiniFloatFormat, decode_table
from lowprec.formats.scales import NVIDIA, Float8BlockScaleRule, MXScaleRule, NVFP4ScaleRule, ScaleRule, overflow_scale
from nvdlfw_inspect.stats.kernels.cpu import DTYPE_CODES, load_library

logger = logging.getLogger("lowprec")
RULE_MX_NVIDIA, RULE_MX_OCP, RULE_FP8_BLOCK, RULE_NVFP4 = range(4)


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The compiled kernel, or None (said once) where it cannot be built or ``LOWPREC_NATIVE=0`` turns it off."""
    if os.environ.get("LOWPREC_NATIVE", "1") == "0":
        logger.info("lowprec: CPU block casts use torch operations (LOWPREC_NATIVE=0)")
        return None
    source = resources.files(__package__).joinpath("cpu_cast.c").read_text(encoding="utf-8")
    try:
        library = load_library("cpu_cast", source)
        cast, decode, scan, probe = library.block_cast, library.block_decode, library.amax_and_probe, library.nonfinite_probe
        scale, lookup = library.scale_product, library.table_decode
    except (OSError, AttributeError, subprocess.SubprocessError) as error:  # AttributeError: a library without the symbol
        logger.warning(
            f"lowprec: CPU block casts use torch operations, several times slower: the C kernel is unavailable ({error}); "
            "install a C compiler (or point $CC at one) to build it"
        )
        return None
    i64, i32, f32, pointer = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    cast.restype = i32
    cast.argtypes = [pointer, i32, *[i64] * 4, *[i32] * 5, f32, i32, i32, f32, *[i32] * 3, ctypes.c_uint64, *[pointer] * 5]
    decode.restype = None
    decode.argtypes = [pointer, i64, i64, i32, i32, pointer, pointer, i32, f32, pointer]
    scan.restype = None
    scan.argtypes = [pointer, i32, i64, pointer, pointer]
    probe.restype = None
    probe.argtypes = [pointer, i32, i64, pointer]
    scale.restype = None
    scale.argtypes = [pointer, i64, i64, pointer, pointer, pointer, f32, pointer]
    lookup.restype = None
    lookup.argtypes = [pointer, i64, pointer, pointer]
    return library


def runs_on(x: torch.Tensor) -> bool:
    """Whether the C kernel casts 2-D ``x``: a CPU tensor of fp32, bf16 or fp16 in the ``"auto"`` kernel mode, outside
    ``torch.compile``, with the kernel built."""
    return x.dtype in DTYPE_CODES and decodes(x)


def supports(rule: ScaleRule, element: object) -> bool:
    """Whether the kernel has ``rule`` with ``element``: every rule of ``formats.scales`` with FP8 or mini-float
    elements (NVFP4: E2M1)."""
    if isinstance(rule, NVFP4ScaleRule):
        return element == E2M1
    return isinstance(rule, MXScaleRule | Float8BlockScaleRule) and isinstance(element, FP8Format | MiniFloatFormat)


def _element_arguments(element: FP8Format | MiniFloatFormat) -> tuple[int, int, float, int, int]:
    """(mantissa bits, first normal exponent, max, sign bit, NaN code: -1 for none) of ``element``."""
    if isinstance(element, FP8Format):
        return element.mantissa_bits, element.min_normal_exp, element.max, 0x80, 0x7F
    return element.mantissa_bits, 2 - 2 ** (element.exponent_bits - 1), element.max, element.sign_bit, -1


def quantize(
    x: torch.Tensor,
    rule: ScaleRule,
    element: FP8Format | MiniFloatFormat,
    block: tuple[int, int],
    dtype: torch.dtype,
    columnwise: bool,
    key: int | None = None,
    signs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``(data, scales, tensor_scale_inv, nonfinite_flags)`` of ``BlockScaledData``: the rowwise (``columnwise``: the
    columnwise, stored as ``x.t()``'s rows) cast of contiguous 2-D CPU ``x`` in ``block``s, made from values of a tensor
    of ``dtype``; ``key``: stochastic rounding's noise key (``RoundingStream.key``), None for round to nearest;
    ``signs``: the fp32 sign vector of the Hadamard transform the blocks go through first (``hadamard.random_signs``; a
    columnwise cast's 16-wide blocks of an fp32 or bf16 ``x``: :func:`transforms`), None for none. The flags: a 0-dim
    fp32 from the cast's own read of the values its blocks hold (``x``'s, or with ``signs`` the transformed ones), 0
    when they are all finite, NaN when one is NaN or inf."""
    if signs is not None and not columnwise:
        raise ValueError("the CPU cast applies the Hadamard transform to columnwise casts only (as the NVFP4 recipe does)")
    rows, cols = x.shape
    strides = (cols, 1)
    if columnwise:
        rows, cols, strides = cols, rows, (1, cols)
    height, width = block
    padded = (-(-rows // height) * height, -(-cols // width) * width)
    data = torch.empty(padded, dtype=torch.uint8)
    shape = (padded[0] // height, padded[1] // width)
    tensor_scale_inv = None
    if isinstance(rule, MXScaleRule):
        code = RULE_MX_NVIDIA if rule.convention == NVIDIA else RULE_MX_OCP
        param = 1.0 / element.max if code == RULE_MX_NVIDIA else float(math.frexp(element.max)[1] - 1)
        scales = torch.empty(shape, dtype=torch.uint8)
    elif isinstance(rule, Float8BlockScaleRule):
        code, param = RULE_FP8_BLOCK, overflow_scale(dtype)
        scales = torch.empty(shape, dtype=torch.float32)
    else:
        code, param = RULE_NVFP4, 1.0 / E2M1.max
        scales = torch.empty(shape, dtype=torch.uint8)
        tensor_scale_inv = torch.empty((), dtype=torch.float32)
    probe = torch.empty((), dtype=torch.float32)
    status = _library().block_cast(
        x.data_ptr(),
        DTYPE_CODES[x.dtype],
        rows,
        cols,
        *strides,
        height,
        width,
        code,
        *_element_arguments(element),
        param,
        int(getattr(rule, "power_2", False)),
        int(rule.marks_nan),
        int(key is not None),
        key or 0,
        None if signs is None else signs.data_ptr(),
        data.data_ptr(),
        scales.data_ptr(),
        None if tensor_scale_inv is None else tensor_scale_inv.data_ptr(),
        probe.data_ptr(),
    )
    if status != 0:
        raise MemoryError(f"lowprec's CPU block cast of a {rows} x {cols} tensor could not allocate its work buffers")
    if isinstance(element, FP8Format):
        data = data.view(element.dtype)
    if isinstance(rule, MXScaleRule):
        scales = scales.view(torch.float8_e8m0fnu)
    elif isinstance(rule, NVFP4ScaleRule):
        scales = scales.view(torch.float8_e4m3fn)
    return data, scales, tensor_scale_inv, probe


def transforms(x: torch.Tensor, block: tuple[int, int]) -> bool:
    """Whether :func:`quantize` applies the Hadamard transform to ``x`` itself: 16-wide blocks (the transform's chunks)
    of fp32 or bf16 (rounded to bf16 as ``hadamard.transform`` rounds; an fp16 input is transformed by torch first)."""
    return block[1] == hadamard.SIZE and x.dtype in (torch.float32, torch.bfloat16)


def decodes(data: torch.Tensor) -> bool:
    """Whether the kernel serves ``data`` at all (:func:`decode` decodes it): on a CPU, in the ``"auto"`` kernel mode,
    outside ``torch.compile``, with the kernel built."""
    return (
        data.device.type == "cpu"
        and kernels.kernel_mode() == "auto"
        and not torch.compiler.is_compiling()
        and _library() is not None
    )


def scans(x: torch.Tensor) -> bool:
    """Whether :func:`amax_and_probe` reads ``x``: a contiguous CPU tensor of fp32, bf16 or fp16 the kernel serves."""
    return x.dtype in DTYPE_CODES and x.is_contiguous() and decodes(x)


def amax_and_probe(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(amax, probe)`` of ``x`` (:func:`scans` it) in one read, both 0-dim fp32: the amax NaN ignored, as
    ``per_tensor.amax_of``; the probe 0 when every value is finite, NaN when one is NaN or infinite."""
    amax, probe = torch.empty((), dtype=torch.float32), torch.empty((), dtype=torch.float32)
    _library().amax_and_probe(x.data_ptr(), DTYPE_CODES[x.dtype], x.numel(), amax.data_ptr(), probe.data_ptr())
    return amax, probe


def nonfinite_probe(x: torch.Tensor) -> torch.Tensor | None:
    """The probe of :func:`amax_and_probe` where the kernel reads ``x`` (:func:`scans`), else None: on a CPU one
    vectorized pass, about three times faster than ``torch.aminmax``."""
    if not scans(x):
        return None
    probe = torch.empty((), dtype=torch.float32)
    _library().nonfinite_probe(x.data_ptr(), DTYPE_CODES[x.dtype], x.numel(), probe.data_ptr())
    return probe


def decode(
    data: torch.Tensor,
    element: FP8Format | MiniFloatFormat,
    block: tuple[int, int],
    scales: torch.Tensor,
    tensor_scale_inv: torch.Tensor | None,
) -> torch.Tensor:
    """``BlockScaledData.values`` of CPU ``data`` (padded to whole ``block``s) in one pass: each code's ``element`` value
    times its block's scale, times ``tensor_scale_inv`` where given."""
    codes = data.contiguous().view(torch.uint8)
    block_scales = scales.float().contiguous()
    table = decode_table(element, data.device)
    out = torch.empty(codes.shape, dtype=torch.float32)
    _library().block_decode(
        codes.data_ptr(),
        *codes.shape,
        *block,
        table.data_ptr(),
        block_scales.data_ptr(),
        int(tensor_scale_inv is not None),
        0.0 if tensor_scale_inv is None else float(tensor_scale_inv),
        out.data_ptr(),
    )
    return out


def decode_fp8(codes: torch.Tensor, element: FP8Format) -> torch.Tensor:
    """``element.decode`` of contiguous CPU FP8 ``codes`` the kernel serves (:func:`decodes`), in one pass: each byte's
    value looked up in ``decode_table``, with no 8-byte index tensor between (torch's ``index_select`` needs one)."""
    out = torch.empty(codes.shape, dtype=torch.float32)
    table = decode_table(element, codes.device)
    _library().table_decode(codes.view(torch.uint8).data_ptr(), codes.numel(), table.data_ptr(), out.data_ptr())
    return out


@functools.cache
def _overflow_limit(dtype: torch.dtype) -> float:
    """The least fp32 magnitude that rounds to infinity in ``dtype``: its largest value plus half its last step (the
    tie rounds to even, which is infinity's side); none for fp32 itself."""
    if dtype == torch.float32:
        return math.inf
    info = torch.finfo(dtype)
    return info.max + 2.0 ** math.floor(math.log2(info.max)) * info.eps / 2


def scales_product(
    product: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype
) -> bool:
    """Whether :func:`scale_product` serves this epilogue: a contiguous 2-D fp32 CPU ``product`` the kernel serves, fp32
    scales, an output of fp32, bf16 or fp16, and no bias or an fp32 one added in fp32."""
    return (
        product.dtype == torch.float32
        and product.dim() == 2
        and product.is_contiguous()
        and out_dtype in DTYPE_CODES
        and scale_a.dtype == scale_b.dtype == torch.float32
        and (
            bias is None
            or (out_dtype == bias.dtype == torch.float32 and bias.is_contiguous() and bias.shape == product.shape[1:])
        )
        and decodes(product)
    )


def scale_product(
    product: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype
) -> torch.Tensor:
    """An emulated FP8 GEMM's epilogue in one pass (:func:`scales_product` serves it), in place: ``product`` becomes
    ``product * (scale_a * scale_b) (+ bias)``, bit for bit torch's; returns the non-finite probe of the result in
    ``out_dtype`` (0-dim fp32: 0, or NaN when a value is NaN or infinite, or overflows ``out_dtype``)."""
    probe = torch.empty((), dtype=torch.float32)
    rows, cols = product.shape
    _library().scale_product(
        product.data_ptr(),
        rows,
        cols,
        scale_a.data_ptr(),
        scale_b.data_ptr(),
        None if bias is None else bias.data_ptr(),
        _overflow_limit(out_dtype),
        probe.data_ptr(),
    )
    return probe
