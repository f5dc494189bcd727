"""The non-finite probes of GEMM results being inspected, by ``id`` of the tensor shown to the features.

An emulated FP8 GEMM's last pass tells whether its result holds a NaN or an infinity (``lowprec.gemm.gemm_and_probe``).
``inspect_tensor``'s keywords are fixed (Transformer Engine's features take exactly those), so the debug path lends the
probe here for the length of the call, and ``NonfiniteGuard`` looks it up instead of reading the result again. The
tensor is alive throughout, so its ``id`` names it alone.
"""

from __future__ import annotations

import torch

RESULT_PROBES: dict[int, torch.Tensor] = {}
