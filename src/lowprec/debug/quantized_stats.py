"""What the quantization statistics read from one cast, whatever the format: FP8 bytes or E2M1 codes,
the scale_inv of every block (or the one of the tensor), and the dequantized values.

Each element format says which of its codes are zero (``count_nonzero``) and whether it encodes NaN: E2M1
has none, so a NaN input becomes code 0 (its block scale is NaN) and is not counted as an underflow.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lowprec.formats.elements import ElementFormat
from lowprec.quant.block import as_2d
from lowprec.quant.protocol import BlockScaledData, Float8Tensor


@dataclass
class Quantized:
    """``data``: the stored codes of ``element`` (padded for block formats); ``scale_inv``: every scale_inv,
    flat; ``dequantized``: the values in the tensor's 2-D shape (fp32); ``fp8``: the per-tensor cast, for
    overflows; ``block_scales``: each block's whole dequantization scale (fp32), None per tensor; ``part``: the
    block cast's orientation it came from (None per tensor), ``columnwise`` whether that quantizes the transpose."""

    data: torch.Tensor
    scale_inv: torch.Tensor
    dequantized: torch.Tensor
    element: ElementFormat
    fp8: Float8Tensor | None = None
    block_scales: torch.Tensor | None = None
    part: BlockScaledData | None = None
    columnwise: bool = False


def per_tensor(q: Float8Tensor) -> Quantized:
    return Quantized(q.data, q.scale_inv.reshape(-1), q.dequantize(torch.float32), q.format, q)


def logged_scale_inv(scales: torch.Tensor) -> torch.Tensor:
    """Block scales as the statistics log them, as Transformer Engine does: the raw E8M0 byte for MXFP8, the
    value otherwise (E4M3 for NVFP4, fp32 for FP8 block scaling)."""
    if scales.dtype == torch.float8_e8m0fnu:
        return scales.view(torch.uint8).reshape(-1).float()
    return scales.reshape(-1).float()


def from_block(part: BlockScaledData, columnwise: bool) -> Quantized:
    """One orientation of a block-scaled cast; ``columnwise``: ``part`` quantizes the transpose."""
    dequantized = part.dequantize()
    block_scales = part.scales.float().reshape(-1)
    if part.tensor_scale_inv is not None:
        block_scales = block_scales * part.tensor_scale_inv
    return Quantized(
        part.data,
        logged_scale_inv(part.scales),
        dequantized.t() if columnwise else dequantized,
        part.layout.element,
        block_scales=block_scales,
        part=part,
        columnwise=columnwise,
    )


def nonzero_codes(q: Quantized) -> torch.Tensor:
    """How many stored elements are not a zero code (padding is zeros, so it counts nothing)."""
    return q.element.count_nonzero(q.data)


def quantization_fields(tensor: torch.Tensor, q: Quantized, overflows: bool) -> dict[str, Any]:
    """Partial fields of one quantization of ``tensor``, all computed on its device."""
    x = tensor.detach().float()
    nonzero_inputs = torch.count_nonzero(x)
    if not q.element.has_nan:  # a NaN input gets a zero code: not an underflow
        nonzero_inputs = nonzero_inputs - x.isnan().sum()
    nonzero_scales = q.scale_inv.masked_fill(q.scale_inv == 0, float("inf"))
    fields: dict[str, Any] = {
        "count": x.numel(),
        "underflows": nonzero_inputs - nonzero_codes(q),
        "sq_err": (as_2d(x) - q.dequantized.reshape(as_2d(x).shape)).square().sum(),
        "scale_inv_min": torch.where(nonzero_scales.isinf().all(), 0.0, nonzero_scales.amin()),
        "scale_inv_max": q.scale_inv.amax(),
    }
    if overflows:
        limit = q.fp8.format.max * q.fp8.scale_inv
        fields["overflows"] = (x.abs() > limit).sum()
    return fields
