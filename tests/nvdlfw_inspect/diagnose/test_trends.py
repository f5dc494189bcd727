"""``diagnose``'s growth findings (kurtosis, outlier channel, scale drift): tiny runs that diverge are flagged from
the statistics logged before their loss diverges, with the lead time in steps; healthy runs give none; the rule
(baseline, consecutive steps, persistence) on planted series; the command line and report name the new kinds."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pytest
import torch
from planted_trends import CHANNEL, attention_run, diverged_at, growing_channel_run

from nvdlfw_inspect import report
from nvdlfw_inspect.diagnose import Thresholds, diagnose, diagnose_statistics
from nvdlfw_inspect.diagnose.command import add_arguments, text
from nvdlfw_inspect.diagnose.findings import GROWTH_KINDS
from nvdlfw_inspect.diagnose.trends import growth
from nvdlfw_inspect.reading import Statistic, iter_statistics
from nvdlfw_inspect.report import report_data

#: steps between the first iteration of a growth finding and the loss's divergence (``diverged_at``: x100 its start),
#: at least (measured: 11 for the growing channel; 22 to 25 for the attention logits, k_proj's weight scale drifting
#: from iteration 28 and the loss x100 at step 50 to 53 as the CPU's kernels round; 15 to 19 with the learning rate
#: 10% higher or lower)
CHANNEL_LEAD, ATTENTION_LEAD = 8, 12
#: steps between the first step whose diagnosis (of the statistics logged before it) names the attention's growth and
#: the loss's divergence, at least (measured: 19 to 22, the warning at step 31; 12 to 16 with the learning rate 10%
#: higher or lower)
ATTENTION_WARNING = 10
QK_LAYERS = ("model.attn.q_proj", "model.attn.k_proj")


def before(log_dir, step: int):
    """The diagnosis of the statistics logged before ``step``: what ``diagnose`` said while the loss was fine."""
    return diagnose_statistics(s for s in iter_statistics(log_dir) if s.iteration < step)


def growths(diagnosis) -> dict[tuple[str, str, str], object]:
    return {(f.kind, f.layer, f.tensor): f for f in diagnosis.findings if f.kind in GROWTH_KINDS}


@pytest.fixture(scope="module")
def channel(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("channel")
    return log_dir, growing_channel_run(log_dir)


def test_a_growing_outlier_channel_is_flagged_before_the_loss_diverges(channel):
    log_dir, losses = channel
    diverged = diverged_at(losses)
    assert diverged == 17 and not math.isfinite(losses[20])
    found = growths(before(log_dir, diverged))
    outlier = found[("outlier_channel_growth", "model.fc1", "activation")]
    kurtosis = found[("kurtosis_growth", "model.fc1", "activation")]
    assert diverged - outlier.first_iteration >= CHANNEL_LEAD and diverged - kurtosis.first_iteration >= CHANNEL_LEAD
    assert outlier.context["max_channel"] == CHANNEL and outlier.context["max_channel_stable"]
    assert f"channel {CHANNEL} (max_channel) is the largest at every logged iteration since" in outlier.message
    assert "arXiv 2409.12517" in outlier.message and "arXiv 2505.20524" in kurtosis.message
    assert [(r.feature, r.gemms) for r in outlier.remedies] == [("DisableFP8GEMM", ("fprop",))]
    assert "diagnose_model_fc1" in before(log_dir, diverged).config_yaml
    assert outlier.summary.threshold == Thresholds().outlier_growth and outlier.context["onset"] == outlier.first_iteration


def test_the_whole_run_lists_growth_after_the_damage(channel):
    log_dir, _ = channel
    kinds = [f.kind for f in diagnose(log_dir).findings]
    assert kinds[0] == "nonfinite" and set(kinds[-3:]) <= set(GROWTH_KINDS)
    assert kinds == sorted(kinds, key=lambda kind: kind in GROWTH_KINDS)


def test_the_report_lists_the_growth_findings_and_names_their_kinds(channel):
    log_dir, _ = channel
    data = report_data(iter_statistics(log_dir), "channel")
    kinds = {f["kind"] for f in data["findings"]}
    assert set(GROWTH_KINDS) <= kinds
    script = (Path(report.__file__).parent / "report.js").read_text()
    assert all(f"{kind}: " in script for kind in GROWTH_KINDS)  # KIND_NAMES: each kind in words


def test_attention_logits_that_grow_under_a_high_learning_rate_are_flagged_before_the_loss_diverges(tmp_path):
    losses = attention_run(tmp_path)
    # the query and key weights grow over tens of steps while the loss creeps up, then it runs away: x100 its start at
    # step 50 to 53 (the step moves with the CPU's matmul kernels, so a range), still finite
    diverged = diverged_at(losses)
    assert diverged is not None and 44 <= diverged <= 60 and math.isfinite(losses[diverged])
    found = growths(before(tmp_path, diverged))
    qk = {key: f for key, f in found.items() if key[1] in QK_LAYERS}
    # the whole matrices grow, not one channel: their per-tensor scales drift (kurtosis and the outlier-channel ratio,
    # the growing channel's kinds, pass their factors a few steps before the loss diverges, if at all)
    assert {("scale_drift", layer, "weight") for layer in QK_LAYERS} <= set(qk)
    assert diverged - min(f.first_iteration for f in qk.values()) >= ATTENTION_LEAD
    # and the warning itself: the first step at which diagnose, given what was logged before it, names the growth
    warned = next(step for step in range(diverged + 1) if any(key[1] in QK_LAYERS for key in growths(before(tmp_path, step))))
    assert diverged - warned >= ATTENTION_WARNING
    drift = qk[("scale_drift", "model.attn.q_proj", "weight")]
    assert drift.stat == "scale_inv_max" and "arXiv 2309.14322" in drift.message
    # no routing records name its recipe, so a delayed scale that would lag it may be the run's
    assert drift.format is None and [(r.feature, r.tensor) for r in drift.remedies] == [("PerTensorScaling", "weight")]


@pytest.mark.parametrize(
    "run",
    [
        lambda d: growing_channel_run(d, growth=1.0),
        lambda d: attention_run(d, lr=0.5),  # q and k's scales x3 (drift: x8) while the loss falls
        lambda d: attention_run(d, lr=0.01, optimizer=torch.optim.Adam),  # x2.6
    ],
)
def test_healthy_runs_give_no_growth_finding(tmp_path, run):
    losses = run(tmp_path)
    assert diverged_at(losses) is None
    assert growths(diagnose(tmp_path)) == {}


def series(values: list[float]) -> dict[int, float]:
    return dict(enumerate(values))


def test_the_rule_needs_consecutive_steps_and_persistence():
    t = Thresholds()
    grown = growth(series([9, 3, 3, 3, 3, 7, 7, 7, 7, math.nan]), 1, 2.0, t)
    assert (grown.baseline, grown.onset, grown.over, grown.since) == (3, 5, 4, 4)  # warm-up and NaN left out
    assert growth(series([3, 3, 3, 3, 7, 7, 3, 7, 7, 7]), 0, 2.0, t).onset == 7  # two steps over are no start
    assert growth(series([3, 3, 3, 7, 7, 7, 3, 3, 3, 3, 3, 3, 3]), 0, 2.0, t) is None  # a passing spike
    assert growth(series([3, 3, 3, 7, 7]), 0, 2.0, t) is None  # too few to tell
    assert growth(series([3, 3, 3, 7, 7]), 0, 2.0, Thresholds(trend_steps=2)).onset == 3
    assert growth(series([0, 0, 0, 7, 7, 7]), 0, 2.0, t) is None  # no baseline to grow from


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"kurtosis_growth": 1}, "threshold kurtosis_growth is a factor greater than 1, got 1"),
        ({"trend_steps": 0}, "threshold trend_steps is a number of logged iterations (an integer >= 1), got 0"),
    ],
)
def test_bad_growth_thresholds_are_clear_errors(overrides, message):
    with pytest.raises(ValueError) as error:
        Thresholds(**overrides)
    assert message in str(error.value)


def test_the_command_line_prints_a_growth_and_takes_its_thresholds():
    statistics = [Statistic(0, "model.fc1", "activation", "kurtosis", i, 3.0 if i < 4 else 3.0 * 1.5**i) for i in range(12)]
    diagnosis = diagnose_statistics(statistics)
    printed = text(diagnosis, "logs", None)
    assert "model.fc1  activation  kurtosis_growth (kurtosis, from iteration 4)" in printed
    assert "fix: DisableFP8GEMM on fprop:" in printed
    assert "kurtosis > x3, outlier channel > x2, scale > x8" in printed.splitlines()[0]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["logs", "--kurtosis-growth", "1000", "--trend-steps", "2"])
    assert (args.kurtosis_growth, args.trend_steps) == (1000.0, 2)
    assert diagnose_statistics(statistics, Thresholds(kurtosis_growth=1000)).findings == []
