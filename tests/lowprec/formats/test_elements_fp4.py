"""FP4 E2M1: its grid, round-to-nearest-even ties, saturation, zeros and NaN, stochastic rounding."""

from __future__ import annotations

import pytest
import torch

from lowprec.formats.elements import E2M1
from lowprec.formats.noise import RoundingStream


def values(x: list[float], noise: torch.Tensor | None = None) -> list[float]:
    return E2M1.decode(E2M1.cast(torch.tensor(x), noise)).tolist()


def test_every_code_decodes_to_its_value_and_back():
    codes = torch.arange(16, dtype=torch.uint8)
    grid = E2M1.decode(codes)
    assert grid.tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    assert grid.signbit().tolist() == [False] * 8 + [True] * 8
    assert torch.equal(E2M1.cast(grid), codes)  # -0.0 keeps its sign: code 8


def test_ties_round_to_the_even_code():
    # midpoints between neighbours: the neighbour whose mantissa bit is 0 wins
    assert values([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]) == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert values([-0.25, -0.75, -2.5, -5.0]) == [-0.0, -1.0, -2.0, -4.0]
    assert values([0.2501, 0.7499, 2.51, 4.99]) == [0.5, 0.5, 3.0, 4.0]


def test_saturation_zeros_and_nan():
    assert values([6.0, 7.0, 1e30, float("inf"), -float("inf")]) == [6.0, 6.0, 6.0, 6.0, -6.0]
    assert values([0.0, 0.24, -0.1]) == [0.0, 0.0, -0.0]  # below 0.25 flushes to (signed) zero
    assert E2M1.cast(torch.tensor([float("nan"), -float("nan")])).tolist() == [0, 0]  # no NaN code: +0 (NVFP4 marks the block)


def test_stochastic_rounding_picks_a_neighbour_with_the_right_odds():
    x = torch.tensor([0.3, 1.2, 2.6, 4.5, 5.9, -0.7, 6.0, 3.0, 0.0])
    assert values(x.tolist(), torch.zeros(9)) == [0.0, 1.0, 2.0, 4.0, 4.0, -0.5, 6.0, 3.0, 0.0]  # noise 0 rounds down
    assert values(x.tolist(), torch.full((9,), 0.999)) == [0.5, 1.5, 3.0, 6.0, 6.0, -1.0, 6.0, 3.0, 0.0]  # near 1: up
    repeated = x.repeat(10, 1)
    draws = torch.cat(  # 400 seeds, 10 draws of each value per seed
        [
            E2M1.decode(E2M1.cast(repeated, RoundingStream(seed, "fc1.gradient").noise(0, "rowwise", repeated.shape, x.device)))
            for seed in range(400)
        ]
    )
    lower, upper = torch.tensor([0.0, 1.0, 2.0, 4.0, 4.0, -0.5, 6.0, 3.0, 0.0]), torch.tensor([0.5, 1.5, 3, 6, 6, -1, 6, 3, 0])
    assert ((draws == lower) | (draws == upper)).all()
    # unbiased: the mean of the 4000 draws is the value, within 4 standard errors of a two-point draw
    spread = (upper - lower).abs() / 2 / len(draws) ** 0.5
    assert ((draws.mean(0) - x).abs() <= 4 * spread + 1e-7).all()


def test_stochastic_rounding_is_reproducible_from_the_seed():
    x = torch.linspace(-6, 6, 1000)

    def cast(seed: int, offset: int) -> torch.Tensor:
        return E2M1.cast(x, RoundingStream(seed, "fc1.gradient").noise(offset, "rowwise", x.shape, x.device))

    assert torch.equal(cast(1, 0), cast(1, 0))
    assert not torch.equal(cast(1, 0), cast(2, 0))
    assert not torch.equal(cast(1, 0), cast(1, 1))


@pytest.mark.parametrize("magnitude", [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
def test_grid_values_are_exact_under_any_noise(magnitude):
    x = torch.full((64,), magnitude)
    assert values(x.tolist(), torch.rand(64, generator=torch.Generator().manual_seed(0))) == [magnitude] * 64
