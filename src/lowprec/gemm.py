"""One matrix-multiply entry point for high-precision, FP8 and block-scaled operands.

``gemm(a, b, out_dtype, bias)`` computes ``a @ b (+ bias)`` for 2-D operands. Two ``Float8Tensor``s give an FP8
GEMM: ``torch._scaled_mm`` on CUDA devices of compute capability 8.9 and later when the shapes allow,
otherwise an emulation with the same numerics (exact products of the FP8 values summed in fp32, then
scaled). Two ``BlockScaledTensor``s (MXFP8, FP8 block scaling, NVFP4) give an emulated block-scaled
GEMM: ``a``'s rowwise and ``b``'s columnwise quantization (both blocked along the inner dimension)
dequantized to fp32 and multiplied with fp32 accumulation. If only one operand is quantized, or the
two are of different kinds, each quantized one is dequantized (as the GEMM would read it) and the
GEMM runs in high precision, so both operands of a GEMM always share a precision.

The two agree to the accumulation, not bit for bit: products of FP8 values are exact in both, but
Hopper's FP8 tensor cores add them with fewer bits than fp32 (about 14 significant bits for the
partial sums, which cuBLAS promotes to fp32 registers every few instructions), while the emulation
adds in fp32. On an H100 the two differed by up to 2.3e-4 relative (K=128). ``ACCUMULATION_BOUND``
states the promise: ``|_scaled_mm - emulation| <= ACCUMULATION_BOUND * (|qa| @ |qb|) * scale_inv_a *
scale_inv_b`` for every output.
"""

from __future__ import annotations

import torch

from lowprec.formats.elements import E5M2
from lowprec.kernels import cpu_cast
from lowprec.quant.protocol import BlockScaledTensor, Float8Tensor, QuantizedTensor
from nvdlfw_inspect.logging import say_once

Operand = torch.Tensor | Float8Tensor | BlockScaledTensor

ACCUMULATION_BOUND = 2.0**-11  # relative to the sum of |products|: 8x the ~14-bit partial sums' rounding


def gemm(a: Operand, b: Operand, out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b + bias`` in ``out_dtype``. In high precision the bias is added inside the GEMM (``addmm``,
    rounded once), as ``F.linear`` adds it; after a quantized GEMM it is added to the result."""
    return gemm_and_probe(a, b, out_dtype, bias)[0]


def gemm_and_probe(
    a: Operand, b: Operand, out_dtype: torch.dtype, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``gemm``'s result and, where the GEMM's own last pass over it tells, its non-finite probe (0-dim fp32: 0, or
    NaN when the result holds a NaN or an infinity): an emulated per-tensor FP8 GEMM on a CPU scales its product in
    the C kernel, which checks it on the way. ``NonfiniteGuard`` takes the probe instead of reading the result."""
    if isinstance(a, Float8Tensor) and isinstance(b, Float8Tensor):
        reason = scaled_mm_unsupported(a, b)
        if reason is None:
            return _with_bias(_scaled_mm(a, b, out_dtype), bias, out_dtype), None
        if a.device.type == "cuda":
            say_once(f"lowprec: FP8 GEMM emulated on {a.device}: {reason}", warning=RuntimeWarning, call_site=__name__)
        return _emulated_fp8_gemm(a, b, out_dtype, bias)
    if isinstance(a, BlockScaledTensor) and isinstance(b, BlockScaledTensor):
        if a.device.type == "cuda":
            element = (a.rowwise or a.columnwise).layout.element.name
            say_once(
                f"lowprec: block-scaled GEMM ({element} elements) emulated on {a.device}: lowprec has no kernel for block "
                "formats (dequantized to fp32, fp32 accumulation); per-tensor FP8 GEMMs run torch._scaled_mm",
                warning=RuntimeWarning,
                call_site=__name__,
            )
        return _with_bias(emulated_block_gemm(a, b, out_dtype), bias, out_dtype), None
    if isinstance(a, QuantizedTensor) or isinstance(b, QuantizedTensor):
        say_once(
            "lowprec: a GEMM got one quantized and one high-precision operand, or two of different formats; "
            "it runs in high precision",
            warning=RuntimeWarning,
            call_site=__name__,
        )
        a = a.dequantize(out_dtype) if isinstance(a, QuantizedTensor) else a
        b = b.t().dequantize(out_dtype).t() if isinstance(b, QuantizedTensor) else b  # a right operand as the GEMM reads it
    a, b = a.to(out_dtype), b.to(out_dtype)
    return (torch.matmul(a, b) if bias is None else torch.addmm(bias.to(out_dtype), a, b)), None


def _with_bias(out: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """A quantized GEMM's result plus ``bias``, added after it in ``out_dtype``."""
    return out if bias is None else out + bias.to(out_dtype)


def emulated_block_gemm(a: BlockScaledTensor, b: BlockScaledTensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` from ``a``'s rowwise and ``b``'s columnwise quantization, dequantized to fp32, with fp32
    accumulation. Operands that went through the same Hadamard transform (NVFP4's wgrad) are multiplied
    as transformed, padding included, as the hardware does: the transform cancels in the product."""
    left, right = a.gemm_rows(), b.t().gemm_rows()
    seed = left.layout.hadamard_seed
    transformed = seed is not None and seed == right.layout.hadamard_seed and left.data.shape[1] == right.data.shape[1]
    product = left.gemm_operand(transformed) @ right.gemm_operand(transformed).t()
    if transformed:
        product = product[: left.layout.shape[0], : right.layout.shape[0]]
    return product.to(out_dtype)


def emulated_fp8_gemm(a: Float8Tensor, b: Float8Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """What an FP8 tensor core computes: ``(qa @ qb) * scale_inv_a * scale_inv_b`` with fp32 accumulation (the codes
    decoded by ``Float8Tensor.values``: on a CPU a table lookup in C, one pass)."""
    return _emulated_fp8_gemm(a, b, out_dtype, None)[0]


def _emulated_fp8_gemm(
    a: Float8Tensor, b: Float8Tensor, out_dtype: torch.dtype, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``emulated_fp8_gemm`` plus ``bias``, and its probe where the C kernel scales the product (in place, the same
    fp32 operations as torch's multiply and add: one pass instead of two, and no tensor allocated)."""
    product = torch.matmul(a.values(), b.values())
    if cpu_cast.scales_product(product, a.scale_inv, b.scale_inv, bias, out_dtype):
        probe = cpu_cast.scale_product(product, a.scale_inv, b.scale_inv, bias, out_dtype)
        return product.to(out_dtype), probe
    return _with_bias((product * (a.scale_inv * b.scale_inv)).to(out_dtype), bias, out_dtype), None


def scaled_mm_unsupported(a: Float8Tensor, b: Float8Tensor) -> str | None:
    """Why ``torch._scaled_mm`` cannot run this GEMM, or None if it can."""
    if a.device.type != "cuda":
        return "not a CUDA device"
    if torch.cuda.get_device_capability(a.device) < (8, 9):
        return "FP8 tensor cores need compute capability 8.9 or later"
    if a.format is E5M2 and b.format is E5M2:
        return "E5M2 x E5M2 is not supported by the hardware"
    (m, k), n = a.shape, b.shape[1]
    if k % 16 or n % 16:
        return f"inner and output dimensions must be multiples of 16 (got k={k}, n={n}, m={m})"
    return None


def _scaled_mm(a: Float8Tensor, b: Float8Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    # _scaled_mm wants the first operand row-major and the second column-major.
    return torch._scaled_mm(
        a.row_major(), b.column_major(), scale_a=a.scale_inv.reshape(()), scale_b=b.scale_inv.reshape(()), out_dtype=out_dtype
    )
