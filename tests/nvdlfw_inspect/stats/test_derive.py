"""Deriving statistics from merged partials, and which partial fields each statistic needs."""

from __future__ import annotations

import math

import pytest
import torch

from nvdlfw_inspect.stats import STAT_PARTIALS, compute_partials, derive_stats, supported_stats
from nvdlfw_inspect.stats.derive import fields_for


def test_supported_stats_and_their_fields():
    assert supported_stats() == ["min", "max", "mean", "std", "l1_norm", "l2_norm", "cur_amax", "dynamic_range"]
    assert fields_for(["min", "std"]) == set()
    assert fields_for(["dynamic_range", "mean"]) == {"abs_min_nonzero"}
    assert set(STAT_PARTIALS) == set(supported_stats())


def test_derive_only_what_is_asked():
    p = compute_partials(torch.tensor([-4.0, 1.0, 2.0]))
    assert derive_stats(p, ["max", "cur_amax"]) == {"max": 2.0, "cur_amax": 4.0}


def test_dynamic_range_is_log2_ratio():
    p = compute_partials(torch.tensor([0.0, -0.25, 8.0]), {"abs_min_nonzero"})
    assert derive_stats(p, ["dynamic_range"])["dynamic_range"] == pytest.approx(5.0)


def test_l2_norm_from_mean_and_m2():
    x = torch.tensor([3.0, 4.0])
    assert derive_stats(compute_partials(x), ["l2_norm"])["l2_norm"] == pytest.approx(5.0)


def test_negative_rounding_in_m2_does_not_give_nan():
    p = compute_partials(torch.tensor([1.0, 1.0]))
    p[2] = -1e-30  # m2 a hair below zero after merging
    assert derive_stats(p, ["std"])["std"] == 0.0
    assert not math.isnan(derive_stats(p, ["l2_norm"])["l2_norm"])
