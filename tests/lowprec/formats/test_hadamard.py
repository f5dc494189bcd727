"""The random Hadamard transform: orthogonal, products preserved, the butterflies equal to the matrix."""

from __future__ import annotations

import torch
from hadamardref import random_hadamard, sylvester_hadamard

from lowprec.formats import hadamard


def test_hadamard_transform_is_orthogonal_and_preserves_products():
    matrix = random_hadamard(5, torch.device("cpu"))
    assert torch.allclose(matrix @ matrix.t(), torch.eye(16), atol=1e-6)
    assert set(matrix.abs().flatten().tolist()) == {0.25} and not torch.equal(matrix, random_hadamard(6, torch.device("cpu")))
    g = torch.Generator().manual_seed(2)
    dy, x = torch.randn(48, 24, generator=g), torch.randn(48, 40, generator=g)  # wgrad: dy^T x, inner dimension 48
    dy_t, x_t = hadamard.transform(dy.t().contiguous(), 5), hadamard.transform(x.t().contiguous(), 5)
    assert torch.allclose(x_t, (x.t().reshape(-1, 16) @ matrix).reshape(40, 48), atol=1e-6)  # the butterflies multiply by T
    assert torch.allclose(dy_t @ x_t.t(), dy.t() @ x, rtol=1e-5, atol=1e-5)
    assert torch.allclose(hadamard.inverse(x_t, 5), x.t(), atol=1e-6)


def test_walsh_hadamard_butterflies_equal_the_sylvester_matrix_exactly_on_integers():
    x = torch.randint(-1000, 1000, (7, 32), generator=torch.Generator().manual_seed(8)).float()  # sums of integers: exact
    assert torch.equal(hadamard.walsh_hadamard(x), (x.reshape(-1, 16) @ sylvester_hadamard()).reshape(7, 32))
