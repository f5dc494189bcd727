"""Recipes: formats per direction and argument checks."""

from __future__ import annotations

import pytest

from lowprec.formats import E4M3, E5M2
from lowprec.recipe import DelayedScaling, Float8CurrentScaling, Format


def test_formats_per_direction():
    assert (Format.HYBRID.forward, Format.HYBRID.backward) == (E4M3, E5M2)
    assert (Format.E4M3.forward, Format.E4M3.backward) == (E4M3, E4M3)
    assert (Format.E5M2.forward, Format.E5M2.backward) == (E5M2, E5M2)


def test_defaults():
    recipe = DelayedScaling()
    assert (recipe.margin, recipe.fp8_format, recipe.amax_history_len, recipe.amax_compute_algo) == (
        0,
        Format.HYBRID,
        1024,
        "max",
    )
    assert Float8CurrentScaling().fp8_format is Format.HYBRID


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"margin": -1}, r"margin must be a non-negative integer, got -1"),
        ({"amax_history_len": 0}, r"amax_history_len must be a positive integer, got 0"),
        ({"amax_compute_algo": "mean"}, r"amax_compute_algo must be one of \['max', 'most_recent'\], got 'mean'"),
        ({"fp8_format": "HYBRID"}, r"fp8_format must be a lowprec.Format \(E4M3, E5M2, HYBRID\), got 'HYBRID'"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DelayedScaling(**kwargs)
