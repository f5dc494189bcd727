"""The random Hadamard transform (RHT) NVFP4 applies to both operands of the wgrad GEMM.

``T = diag(signs) @ H16 / 4`` with ``H16`` the 16 x 16 Sylvester Hadamard matrix and ``signs`` a ±1
vector named by its key: ``TE_SIGNS``, Transformer Engine's fixed vector (``get_wgrad_sign_vector`` in
``pytorch/tensor/nvfp4_tensor.py``), or an int seed that draws one. ``T`` is orthogonal (``T @ T.T = I``), so transforming every
16-element chunk of both operands along the GEMM's inner dimension leaves the product unchanged in
exact arithmetic, ``(a T)(b T)^T = a b^T``, while spreading outliers over their chunk, which suits a
4-bit format.

Transformer Engine transforms bf16 tensors with a bf16 tensor-core product (fp32 accumulation, bf16
result, ``hadamard_transform.cu``), so the values it takes the amax of and casts are rounded to bf16:
``transform`` rounds its result to the input's dtype likewise (fp32 input stays fp32).

``x T`` is computed as the fast Walsh-Hadamard transform of ``x * signs`` (four rounds of pairwise
sums and differences, in a fixed order) times 1/4: elementwise fp32 operations, which round alike on
every device, where a matrix product's summation order (and so its last bits) depends on the device.
"""

from __future__ import annotations

import functools
import math

import torch

from lowprec.errors import LowprecValueError
from lowprec.formats.noise import derived_seed

SIZE = 16
TE_SIGNS = "transformer_engine"
"""The key of Transformer Engine's fixed sign vector (``TE_SIGN_VECTOR``)."""
TE_SIGN_VECTOR = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)
HadamardSigns = int | str
"""A sign vector's key: ``TE_SIGNS``, or an int seed that draws the signs."""


@functools.cache
def random_signs(key: HadamardSigns, device: torch.device) -> torch.Tensor:
    """The ±1 fp32 sign vector of ``key`` on ``device``: Transformer Engine's for ``TE_SIGNS``, else drawn from the
    seed ``key`` on the CPU, so every device has the same."""
    if isinstance(key, str):
        if key != TE_SIGNS:
            raise LowprecValueError(f"unknown Hadamard sign vector {key!r}; known: an int seed or {TE_SIGNS!r}")
        return torch.tensor(TE_SIGN_VECTOR, dtype=torch.float32, device=device)
    generator = torch.Generator().manual_seed(derived_seed(key, "hadamard-signs"))
    return (torch.randint(0, 2, (SIZE,), generator=generator).float() * 2 - 1).to(device)


def walsh_hadamard(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``x @ H16`` for every 16-element chunk along ``dim``: butterflies of strides 1, 2, 4, 8, written back and forth
    between two buffers. Along the first dimension each butterfly adds whole contiguous rows, 10x faster on a CPU than
    along the last one."""
    shape = x.shape
    chunks, inner = _chunks(shape, dim)  # a butterfly's operands are runs of ``stride * inner`` elements
    buffers = [torch.empty(shape, dtype=x.dtype, device=x.device) for _ in range(2)]
    stride = 1
    while stride < SIZE:
        pairs = x.reshape(chunks, SIZE // (2 * stride), 2, stride * inner)
        x = buffers[stride.bit_length() % 2].view(pairs.shape)  # not the one read from
        torch.add(pairs[:, :, 0], pairs[:, :, 1], out=x[:, :, 0])
        torch.sub(pairs[:, :, 0], pairs[:, :, 1], out=x[:, :, 1])
        stride *= 2
    return x.reshape(shape)


def _chunks(shape: torch.Size, dim: int) -> tuple[int, int]:
    """How many 16-element chunks lie along ``dim`` of ``shape`` in all, and how many elements follow each element
    of ``dim`` (explicit sizes: a reshape cannot infer them for an empty tensor)."""
    dim %= len(shape)
    return math.prod(shape[:dim]) * (shape[dim] // SIZE), math.prod(shape[dim + 1 :])


def transform(x: torch.Tensor, key: HadamardSigns, dtype: torch.dtype = torch.float32, dim: int = -1) -> torch.Tensor:
    """``x`` (fp32, its size along ``dim`` a multiple of 16) with every 16-element chunk along ``dim`` (the last: a
    row's) multiplied by ``T``, rounded to ``dtype`` (the dtype of the tensor transformed: bf16 and fp16 round, see the
    module docstring) and returned as fp32. Along the first dimension of a 2-D ``x`` it is the transform of ``x.t()``'s
    rows, transposed: the same operations on the same values, so the same bits."""
    signs = random_signs(key, x.device)
    chunks, inner = _chunks(x.shape, dim)
    signed = (x.reshape(chunks, SIZE, inner) * signs[:, None]).reshape(x.shape)
    out = walsh_hadamard(signed, dim).mul_(1 / SIZE**0.5)
    return out.to(dtype).float() if dtype in (torch.bfloat16, torch.float16) else out


def inverse(x: torch.Tensor, key: HadamardSigns) -> torch.Tensor:
    """Undo :func:`transform` (up to its rounding): ``T`` is orthogonal, so multiply by ``T.T = H16 diag(signs) / 4``."""
    signs = random_signs(key, x.device)
    return walsh_hadamard(x).reshape(-1, SIZE).mul_(signs).reshape(x.shape).mul_(1 / SIZE**0.5)
