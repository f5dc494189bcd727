"""The mini-float casts (E2M1, E3M2, E2M3) against round-to-nearest-even by its definition: the grid value
nearest in float64, a tie going to the even code, saturating at the largest magnitude, on every float32
near the grid's midpoints and values and on a dense sweep of float32 bit patterns."""

from __future__ import annotations

import pytest
import torch

from lowprec.formats.elements import E2M1, E2M3, E3M2, MiniFloatFormat


def nearest_even(fmt: MiniFloatFormat, x: torch.Tensor) -> torch.Tensor:
    """The definition, by brute force: distances to every non-negative grid value in float64."""
    grid = torch.tensor(fmt.magnitudes, dtype=torch.float64)
    magnitude = x.double().abs().nan_to_num(nan=0.0).clamp(max=fmt.max)
    distance = (magnitude[:, None] - grid[None, :]).abs()
    nearest = distance.min(dim=1, keepdim=True).values
    ties = distance == nearest  # one or two codes
    codes = torch.arange(len(grid))
    even_first = torch.where(ties, codes % 2 * len(grid) + codes, 10**6)  # an even code before an odd one
    code = even_first.argmin(dim=1)
    negative = x.signbit() & ~x.isnan()
    return (code + negative * fmt.sign_bit).to(torch.uint8)


def cases(fmt: MiniFloatFormat) -> torch.Tensor:
    grid = torch.tensor(fmt.magnitudes)
    midpoints = (grid[1:] + grid[:-1]) / 2
    near = [torch.nextafter(t, torch.full_like(t, direction)) for t in (grid, midpoints) for direction in (0.0, 100.0)]
    sweep = torch.arange(0, 2**31, 4099, dtype=torch.int64).to(torch.int32).view(torch.float32)
    sweep = sweep[sweep.abs() < 4 * fmt.max]
    special = torch.tensor([0.0, 1e-45, fmt.max * 1.01, 1e30, float("inf"), float("nan")])
    values = torch.cat([grid, midpoints, *near, sweep, special])
    return torch.cat([values, -values])


@pytest.mark.parametrize("fmt", [E2M1, E3M2, E2M3], ids=lambda fmt: fmt.name)
def test_cast_rounds_to_nearest_even_and_saturates(fmt):
    x = cases(fmt)
    assert torch.equal(fmt.cast(x), nearest_even(fmt, x))


def test_cast_takes_any_float_dtype_and_shape():
    x = torch.tensor([[0.3, -2.6], [7.0, -0.0]], dtype=torch.bfloat16)
    assert E2M1.cast(x).tolist() == [[1, 8 + 5], [7, 8]]  # 0.5, -3, 6 (saturated), -0
