"""The random Hadamard transform (RHT) NVFP4 applies to both operands of the wgrad GEMM.

``T = diag(signs) @ H16 / 4`` with ``H16`` the 16 x 16 Sylvester Hadamard matrix and ``signs`` a
random ±1 vector drawn from a seed. ``T`` is orthogonal (``T @ T.T = I``), so transforming every
16-element chunk of both operands along the GEMM's inner dimension leaves the product unchanged in
exact arithmetic, ``(a T)(b T)^T = a b^T``, while spreading outliers over their chunk, which suits a
4-bit format. Transformer Engine fixes one sign vector; here the recipe's ``seed`` draws it.
"""

from __future__ import annotations

import functools

import torch

from lowprec.seeding import derived_seed

SIZE = 16


def sylvester_hadamard(size: int = SIZE) -> torch.Tensor:
    """The ``size`` x ``size`` Hadamard matrix of ±1 built by doubling ``[[H, H], [H, -H]]``."""
    h = torch.ones(1, 1)
    while h.shape[0] < size:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)])
    return h


@functools.cache
def random_hadamard(seed: int, device: torch.device) -> torch.Tensor:
    """``diag(signs) @ H16 / 4`` in fp32 on ``device``; the signs are drawn on the CPU from ``seed``, so
    they are the same on every device. Made once per seed and device."""
    generator = torch.Generator().manual_seed(derived_seed(seed, "hadamard-signs"))
    signs = torch.randint(0, 2, (SIZE,), generator=generator).float() * 2 - 1
    return (signs[:, None] * sylvester_hadamard() / SIZE**0.5).to(device)


def transform(x: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """``x`` (last dimension a multiple of 16) with every 16-element chunk of a row multiplied by ``matrix``."""
    return (x.reshape(-1, SIZE) @ matrix).reshape(x.shape)


def inverse(x: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """Undo :func:`transform` (``matrix`` is orthogonal: its inverse is its transpose)."""
    return transform(x, matrix.t())
