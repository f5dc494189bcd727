"""The normalisations that ``LayerNormLinear`` and ``LayerNormMLP`` put before their GEMMs."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lowprec.errors import LowprecValueError

NORMALIZATIONS = ("LayerNorm", "RMSNorm")


class Norm(torch.nn.Module):
    """LayerNorm (weight and bias) or RMSNorm (weight only) over the last dimension, in high precision."""

    def __init__(self, size: int, normalization: str, eps: float, device=None, dtype=None):
        super().__init__()
        if normalization not in NORMALIZATIONS:
            raise LowprecValueError(f"normalization must be one of {list(NORMALIZATIONS)}, got {normalization!r}")
        self.normalization, self.eps = normalization, eps
        self.weight = torch.nn.Parameter(torch.ones(size, device=device, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(size, device=device, dtype=dtype)) if normalization == "LayerNorm" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is not None:
            return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
