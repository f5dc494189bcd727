"""The random Hadamard transform: orthogonal, products preserved, the butterflies equal to the matrix."""

from __future__ import annotations

import pytest
import torch
from hadamardref import random_hadamard, sylvester_hadamard

from lowprec.errors import LowprecValueError
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


def test_te_signs_and_rounding_to_the_input_dtype():
    te = hadamard.random_signs(hadamard.TE_SIGNS, torch.device("cpu"))
    assert te.tolist() == [1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1]  # TE's get_wgrad_sign_vector
    x = torch.zeros(1, 16)
    x[0, :2] = torch.tensor([1.0, 2.0**-9])  # (1 +- 2**-9) / 4: bf16 keeps 8 bits, so both round to 1 / 4
    assert hadamard.transform(x, hadamard.TE_SIGNS, torch.bfloat16).unique().tolist() == [0.25]
    assert hadamard.transform(x, hadamard.TE_SIGNS).unique().tolist() == [(1 - 2.0**-9) / 4, (1 + 2.0**-9) / 4]
    with pytest.raises(LowprecValueError, match=r"unknown Hadamard sign vector 'te'; known: an int seed or 'transformer_engine'"):
        hadamard.random_signs("te", torch.device("cpu"))
