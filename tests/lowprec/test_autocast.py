"""fp8_autocast / autocast: recipe in force, nesting, defaults, argument checks."""

from __future__ import annotations

import pytest

import lowprec
from lowprec.autocast import active_recipe


def test_outside_autocast_fp8_is_off():
    assert active_recipe() is None


def test_default_recipe_is_delayed_hybrid_and_nesting_restores():
    with lowprec.fp8_autocast():
        outer = active_recipe()
        assert outer == lowprec.DelayedScaling() and outer.fp8_format is lowprec.Format.HYBRID
        with lowprec.autocast(recipe=lowprec.Float8CurrentScaling()):
            assert isinstance(active_recipe(), lowprec.Float8CurrentScaling)
        with lowprec.fp8_autocast(enabled=False):
            assert active_recipe() is None
        assert active_recipe() is outer
    assert active_recipe() is None


def test_state_is_restored_after_an_exception():
    with pytest.raises(RuntimeError), lowprec.fp8_autocast():
        raise RuntimeError
    assert active_recipe() is None


def test_bad_arguments():
    with pytest.raises(TypeError, match="must be one of lowprec.DelayedScaling, lowprec.Float8CurrentScaling, .*; got str"):
        with lowprec.fp8_autocast(fp8_recipe="hybrid"):
            pass
    with pytest.raises(TypeError, match="enabled=...\\) must be a bool"):
        with lowprec.autocast(enabled=1):
            pass
