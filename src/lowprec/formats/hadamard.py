"""The random Hadamard transform (RHT) NVFP4 applies to both operands of the wgrad GEMM.

``T = diag(signs) @ H16 / 4`` with ``H16`` the 16 x 16 Sylvester Hadamard matrix and ``signs`` a
random ±1 vector drawn from a seed. ``T`` is orthogonal (``T @ T.T = I``), so transforming every
16-element chunk of both operands along the GEMM's inner dimension leaves the product unchanged in
exact arithmetic, ``(a T)(b T)^T = a b^T``, while spreading outliers over their chunk, which suits a
4-bit format. Transformer Engine fixes one sign vector; here the recipe's ``seed`` draws it.

``x T`` is computed as the fast Walsh-Hadamard transform of ``x * signs`` (four rounds of pairwise
sums and differences, in a fixed order) times 1/4: elementwise fp32 operations, which round alike on
every device, where a matrix product's summation order (and so its last bits) depends on the device.
"""

from __future__ import annotations

import functools

import torch

from lowprec.formats.noise import derived_seed

SIZE = 16


@functools.cache
def random_signs(seed: int, device: torch.device) -> torch.Tensor:
    """The ±1 fp32 sign vector of ``seed`` on ``device``, drawn on the CPU so every device has the same."""
    generator = torch.Generator().manual_seed(derived_seed(seed, "hadamard-signs"))
    return (torch.randint(0, 2, (SIZE,), generator=generator).float() * 2 - 1).to(device)


def walsh_hadamard(x: torch.Tensor) -> torch.Tensor:
    """``x @ H16`` for every 16-element chunk of the last dimension: butterflies of strides 1, 2, 4, 8."""
    shape = x.shape
    stride = 1
    while stride < SIZE:
        pairs = x.reshape(-1, SIZE // (2 * stride), 2, stride)
        first, second = pairs[:, :, 0], pairs[:, :, 1]
        x = torch.stack([first + second, first - second], dim=2)
        stride *= 2
    return x.reshape(shape)


def transform(x: torch.Tensor, seed: int) -> torch.Tensor:
    """``x`` (fp32, last dimension a multiple of 16) with every 16-element chunk of a row multiplied by ``T``."""
    signs = random_signs(seed, x.device)
    return walsh_hadamard((x.reshape(-1, SIZE) * signs).reshape(x.shape)) * (1 / SIZE**0.5)


def inverse(x: torch.Tensor, seed: int) -> torch.Tensor:
    """Undo :func:`transform`: ``T`` is orthogonal, so multiply by ``T.T = H16 diag(signs) / 4``."""
    signs = random_signs(seed, x.device)
    return (walsh_hadamard(x).reshape(-1, SIZE) * signs).reshape(x.shape) * (1 / SIZE**0.5)
