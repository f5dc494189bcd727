"""The random Hadamard transform as a matrix: what ``lowprec.formats.hadamard.transform`` (fast
Walsh-Hadamard butterflies) must equal, built the slow way."""

from __future__ import annotations

import torch

from lowprec.formats.hadamard import SIZE, random_signs


def sylvester_hadamard(size: int = SIZE) -> torch.Tensor:
    """The ``size`` x ``size`` Hadamard matrix of ±1 built by doubling ``[[H, H], [H, -H]]``."""
    h = torch.ones(1, 1)
    while h.shape[0] < size:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)])
    return h


def random_hadamard(seed: int, device: torch.device) -> torch.Tensor:
    """The matrix ``T = diag(signs) @ H16 / 4`` of ``seed`` (fp32), what ``hadamard.transform`` multiplies by."""
    return random_signs(seed, device)[:, None] * sylvester_hadamard().to(device) / SIZE**0.5
