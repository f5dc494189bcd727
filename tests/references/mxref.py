"""torchao's ``to_mx``, the reference of the OCP MX family: scale bytes, element codes and dequantized values of a
2-D tensor, padded with zeros to whole blocks of 32 as lowprec's casts pad. NVIDIA's E8M0 rule is torchao's RCEIL,
the OCP specification's its FLOOR (tests/lowprec/formats/test_mx_family.py shows which equals which, and where
torchao's eager code departs from its own rule)."""

from __future__ import annotations

import warnings

import torch

from lowprec.formats.elements import E2M1, E2M3, E3M2, E4M3, E5M2, ElementFormat

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.kernels import unpack_uint4
    from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx

MX_BLOCK = 32
ELEMENTS = {"e4m3": E4M3, "e5m2": E5M2, "e3m2": E3M2, "e2m3": E2M3, "e2m1": E2M1}
TORCHAO_DTYPE = {
    E4M3: torch.float8_e4m3fn,
    E5M2: torch.float8_e5m2,
    E3M2: "fp6_e3m2",
    E2M3: "fp6_e2m3",
    E2M1: torch.float4_e2m1fn_x2,
}
MODE = {"nvidia": ScaleCalculationMode.RCEIL, "ocp": ScaleCalculationMode.FLOOR}


def _to_mx(x: torch.Tensor, element: ElementFormat, mode: ScaleCalculationMode):
    padded = torch.nn.functional.pad(x, (0, -x.shape[1] % MX_BLOCK)).contiguous()
    return padded, *to_mx(padded, TORCHAO_DTYPE[element], MX_BLOCK, mode)


def torchao_cast(x: torch.Tensor, element: ElementFormat, mode: ScaleCalculationMode) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale bytes [rows, blocks], codes [rows, cols])`` of ``x``; codes one per uint8 (FP4 unpacked)."""
    padded, scales, data = _to_mx(x, element, mode)
    codes = data.view(torch.uint8)
    if element is E2M1:  # two codes a byte
        codes = unpack_uint4(codes.reshape(-1)).reshape(padded.shape)
    return scales.view(torch.uint8).reshape(x.shape[0], -1), codes[:, : x.shape[1]]


def torchao_dequantized(x: torch.Tensor, element: ElementFormat, rule: str) -> torch.Tensor:
    """The fp32 values torchao's cast of ``x`` under ``rule`` represents (its own ``to_dtype``), in ``x``'s shape."""
    padded, scales, data = _to_mx(x, element, MODE[rule])
    return to_dtype(data, scales, TORCHAO_DTYPE[element], MX_BLOCK, torch.float32).reshape(padded.shape)[:, : x.shape[1]]
