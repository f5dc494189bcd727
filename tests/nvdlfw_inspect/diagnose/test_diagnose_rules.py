"""The rules of ``diagnose`` on synthetic statistics: warm-up transients and passing spikes are no
findings, what persists is; where NaN began; remedies chosen by range; the YAML it writes."""

from __future__ import annotations

import math

import pytest
import yaml

from lowprec.debug import names
from lowprec.formats.elements import E4M3, E5M2
from nvdlfw_inspect.diagnose import Thresholds, diagnose, diagnose_statistics
from nvdlfw_inspect.diagnose.command import text
from nvdlfw_inspect.diagnose.config import layer_features, to_yaml
from nvdlfw_inspect.diagnose.formats import TENSOR_GEMMS
from nvdlfw_inspect.diagnose.model import Remedy
from nvdlfw_inspect.diagnose.series import summarize
from nvdlfw_inspect.diagnose.thresholds import FORMAT_RANGE_BITS
from nvdlfw_inspect.reading import Statistic


def series(layer: str, tensor: str, stat: str, values: list[float], rank: int = 0, every: int = 1) -> list[Statistic]:
    return [Statistic(rank, layer, tensor, stat, i * every, float(v)) for i, v in enumerate(values)]


def kinds(statistics: list[Statistic], **overrides) -> list[tuple[str, str, str, int]]:
    diagnosis = diagnose_statistics(statistics, Thresholds(**overrides))
    return [(f.layer, f.tensor, f.kind, f.first_iteration) for f in diagnosis.findings]


def test_format_ranges_and_gemm_names_match_lowprec():
    for fmt in (E4M3, E5M2):
        smallest_subnormal = fmt.min_normal_exp - fmt.mantissa_bits
        assert FORMAT_RANGE_BITS[fmt.name] == pytest.approx(math.log2(fmt.max) - smallest_subnormal)
    assert TENSOR_GEMMS == {tensor: tuple(g for g in gemms if g) for tensor, gemms in names.TENSOR_GEMMS.items()}


def test_warm_up_maximum_is_a_transient_not_a_finding():
    """The issue's run: 92.66% at iteration 0 (scale still 1), at most 0.24% later."""
    stats = series("gpt.head", "gradient", "underflows%", [92.66] + [0.24, 0.1, 0.0] * 5, every=5)
    assert kinds(stats) == []
    summary = summarize({s.iteration: s.value for s in stats}, 1.0, warmup_end=1, tail=0.25)
    assert (summary.worst, summary.worst_iteration) == (0.24, 5)  # the worst after warm-up
    assert (summary.warmup_worst, summary.warmup_worst_iteration, summary.warmup_only) == (92.66, 0, False)
    assert summary.is_warmup_transient(0.5) and not summary.is_transient(0.5)
    assert summary.above == 0.0 and summary.persistent < 0.25


def test_warm_up_stays_out_of_the_headline():
    """Issue 36: "worst 92.2% at 0 (warm-up)" headlined the demo's finding. A spike at iteration 0 alone is no finding,
    and the real problem's worst is its worst after warm-up, the warm-up's larger one an aside at the end."""
    stats = series("spike", "gradient", "underflows%", [95.0] + [0.1] * 15)  # over only at iteration 0
    stats += series("real", "activation", "underflows%", [0.0] * 4 + [6.0, 7.5] + [6.0] * 10)  # from 4 on
    stats += series("both", "gradient", "underflows%", [99.0] + [2.0] * 15)  # both, the warm-up's far larger
    diagnosis = diagnose_statistics(stats)
    assert [(f.layer, f.first_iteration) for f in diagnosis.findings] == [("real", 4), ("both", 1)]
    real, both = diagnosis.findings
    assert (real.summary.worst, real.summary.worst_iteration, real.summary.warmup_worst) == (7.5, 5, 0.0)
    assert real.message.endswith(
        "over 1% in 80% of the iterations after warm-up (first 4), worst 7.5% at 5, 6% at the end (median of the last "
        "iterations); FP8's threshold 1% (underflow_pct)"
    )
    assert both.message.endswith(
        "worst 2% at 1, 2% at the end (median of the last iterations); 99% at 0 in warm-up, set aside; FP8's threshold 1% "
        "(underflow_pct)"
    )
    summary = diagnosis.as_dict()["findings"][1]["summary"]
    assert (summary["worst"], summary["worst_iteration"], summary["warmup_worst"], summary["warmup_worst_iteration"]) == (
        2.0,
        1,
        99.0,
        0,
    )
    assert summary["warmup_only"] is False and "worst_in_warmup" not in summary
    assert "99%" not in text(diagnosis, "run", None).split("2. ")[0]  # the first finding's lines: no warm-up value


def test_a_run_no_longer_than_its_warm_up_shows_its_values_and_says_so():
    stats = series("l", "gradient", "underflows%", [50.0, 60.0, 40.0])
    diagnosis = diagnose_statistics(stats, Thresholds(warmup=5))
    (finding,) = diagnosis.findings
    assert (finding.summary.worst, finding.summary.worst_iteration, finding.summary.warmup_only) == (60.0, 1, True)
    assert finding.summary.warmup_worst is None  # nothing set aside: the warm-up is all there is
    assert "over 1% in 100% of the iterations, all warm-up (first 0), worst 60% at 1" in finding.message
    assert finding.message.endswith(
        "; the run is no longer than its warm-up, so these are warm-up values; FP8's threshold 1% (underflow_pct)"
    )
    assert diagnosis.caution.startswith("every statistic is from iterations 0 to 2, all in the warm-up (the first 5 iterations)")
    assert diagnose_statistics(stats).caution is None  # 2 iterations after a warm-up of 1
    assert diagnose_statistics(stats[:1]).caution.startswith("every statistic is from iteration 0 alone")


def test_what_persists_is_a_finding_and_a_passing_spike_is_not():
    late = [0.0] * 12 + [5.0] * 4  # over the threshold only at the end: the last quarter's median
    spike = [0.0] * 5 + [50.0] * 3 + [0.0] * 8  # 3 of 15 iterations after warm-up
    steady = [0.0] + [3.0, 0.5] * 8  # over in half of them
    stats = series("late", "activation", "underflows%", late) + series("spike", "activation", "underflows%", spike)
    stats += series("steady", "weight", "underflows%", steady)
    assert kinds(stats) == [("late", "activation", "underflow", 12), ("steady", "weight", "underflow", 1)]
    assert kinds(stats, persistence=0.2) == [  # by how far over its threshold it ends
        ("late", "activation", "underflow", 12),
        ("steady", "weight", "underflow", 1),
        ("spike", "activation", "underflow", 5),
    ]
    assert kinds(stats, underflow_pct=10) == []


def test_the_end_of_a_run_that_ends_in_nan_is_nan_not_its_last_finite_values():
    """The issue's run: NaN from iteration 20 on; its end of run was the median of the finite values before it."""
    broken = {i: 9.0 if i < 20 else math.nan for i in range(40)}
    summary = summarize(broken, 10.0, warmup_end=1, tail=0.25)
    assert math.isnan(summary.persistent) and summary.as_dict()["persistent"] == "nan"  # strict JSON
    assert (summary.worst, summary.above) == (9.0, 0.0)  # what was finite, as before
    once = {i: math.nan if i == 37 else float(i) for i in range(40)}  # one NaN among the last ten: a largest value
    assert summarize(once, 10.0, warmup_end=1, tail=0.25).persistent == 34.5  # 30 to 39, 37 moved to the top
    stats = series("gpt.lm_head", "gradient", "underflows%", [0.0] + [5.0] * 19 + [math.nan] * 20)
    underflow = [f for f in diagnose_statistics(stats).findings if f.kind == "underflow"]
    assert [f.summary.above for f in underflow] == [1.0] and "NaN at the end" in underflow[0].message


def test_checks_without_statistics_are_named_not_passed():
    """A run of LogTensorStats alone: no finding must not read as no underflow or overflow."""
    plain = series("fc", "activation", "max", [1.0] * 8) + series("fc", "activation", "cur_amax", [1.0] * 8)
    assert diagnose_statistics(plain).unmeasured == (
        "underflows% and overflows% were not logged: add LogFp8TensorStats to measure them (overflows% exists under "
        "delayed scaling only); underflow not checked, overflow judged from the jumps of cur_amax alone"
    )
    ranged = plain + series("fc", "activation", "dynamic_range", [3.0] * 8) + series("fc", "activation", "overflows%", [0.0] * 8)
    assert diagnose_statistics(ranged).as_dict()["unmeasured"] == (
        "underflows% was not logged: add LogFp8TensorStats to measure it; underflow judged from dynamic_range alone"
    )
    assert text(diagnose_statistics(ranged), "run", None).splitlines()[1] == (
        "not measured: underflows% was not logged: add LogFp8TensorStats to measure it; underflow judged from dynamic_range alone"
    )
    measured = diagnose_statistics(ranged + series("fc", "activation", "underflows%", [0.0] * 8))
    assert measured.unmeasured is None and "not measured" not in text(measured, "run", None)


def test_nan_origin_is_the_first_in_execution_order_not_in_name_order():
    """Records of an iteration come in the order the tensors were inspected: z runs before a."""
    stats = []
    for it in range(4):
        bad = it >= 2
        stats += [
            Statistic(0, "z.first", "activation", "max", it, 1.0),
            Statistic(0, "z.first", "weight", "max", it, 1.0),
            Statistic(0, "a.second", "activation", "max", it, math.inf if bad else 1.0),
            Statistic(0, "a.second", "gradient", "max", it, math.nan if it >= 1 else 1.0),  # backward, but earlier
            Statistic(0, "z.first", "gradient", "max", it, math.nan if bad else 1.0),
        ]
    diagnosis = diagnose_statistics(stats)
    (finding,) = diagnosis.findings
    assert (finding.layer, finding.tensor, finding.first_iteration, finding.context["last_clean"]) == (
        "a.second",
        "gradient",
        1,
        0,
    )
    assert "2 other tensors followed" in finding.message
    assert [r.feature for r in finding.remedies] == ["LogTensorStats"]


def test_nan_out_of_a_gemm_turns_that_gemm_to_high_precision():
    stats = series("l", "activation", "max", [1, 1, 1]) + series("l", "output", "max", [1, 1, math.nan])
    (finding,) = diagnose_statistics(stats).findings
    assert [(r.feature, r.gemms) for r in finding.remedies] == [("LogTensorStats", ()), ("DisableFP8GEMM", ("fprop",))]


def test_scale_changes_are_found_where_overflows_are_not_logged():
    jumping = [1.0, 1.0, 8.0, 1.0, 16.0, 2.0, 32.0, 4.0]
    stats = series("j", "activation", "cur_amax", jumping) + series(
        "calm", "activation", "cur_amax", [1, 1.5, 2, 2.5, 3, 3, 3, 3]
    )
    diagnosis = diagnose_statistics(stats)
    assert [(f.layer, f.kind, f.stat) for f in diagnosis.findings] == [("j", "scale_change", "cur_amax")]
    assert diagnosis.findings[0].summary.worst == 16.0
    assert diagnosis.config["diagnose_j"]["transformer_engine"]["PerTensorScaling"] == {
        "enabled": True,
        "gemms": ["fprop", "wgrad"],
        "tensors": ["activation"],
    }
    stats += series("j", "activation", "scale_inv_max", [1.0] * 8)  # the layer's own scale, preferred, is steady
    assert kinds(stats) == []
    assert kinds(series("j", "activation", "cur_amax", jumping) + series("j", "activation", "overflows%", [0.0] * 8)) == []


def test_dynamic_range_is_judged_where_underflows_are_not_logged():
    stats = series("l", "activation", "dynamic_range", [25.0] * 8) + series("l", "gradient", "dynamic_range", [40.0] * 8)
    stats += series("l", "weight", "dynamic_range", [12.0] * 8) + series("l", "output", "dynamic_range", [60.0] * 8)
    diagnosis = diagnose_statistics(stats)
    remedies = {f.tensor: (f.kind, [(r.feature, r.gemms, dict(r.options)) for r in f.remedies]) for f in diagnosis.findings}
    assert remedies == {
        "activation": ("dynamic_range", [("FakeQuant", ("fprop", "wgrad"), {"quant_format": "FP8E5M2"})]),
        "gradient": ("dynamic_range", [("DisableFP8GEMM", ("dgrad", "wgrad"), {})]),
    }
    features = diagnosis.config["diagnose_l"]["transformer_engine"]
    assert features["DisableFP8GEMM"] == {"enabled": True, "gemms": ["dgrad", "wgrad"]}  # wgrad: the stronger remedy
    assert features["FakeQuant"] == {"enabled": True, "quant_format": "FP8E5M2", "gemms": ["fprop"], "tensors": ["activation"]}
    assert kinds(stats, fp8_format="E5M2") == [("l", "gradient", "dynamic_range", 1)]  # 1: the first after warm-up
    assert kinds(stats, range_margin_bits=10) == []
    assert (
        kinds(stats + series("l", "activation", "underflows%", [0.5] * 8) + series("l", "gradient", "underflows%", [0.0] * 8))
        == []
    )


def test_underflow_remedy_follows_current_scaling_what_if_then_range():
    base = series("l", "gradient", "underflows%", [0.0] + [20.0] * 7)
    lags = diagnose_statistics(base + series("l", "gradient", "fp8_current_scaling_underflows%", [0.1] * 8)).findings[0]
    assert lags.remedies[0].feature == "PerTensorScaling" and "current scaling would lose only 0.1%" in lags.remedies[0].reason
    unknown = diagnose_statistics(base).findings[0]
    assert unknown.remedies[0].feature == "DisableFP8GEMM" and "without its dynamic_range logged" in unknown.remedies[0].reason


def test_ranks_are_merged_at_their_worst():
    stats = series("l", "weight", "overflows%", [0.0] * 8, rank=0) + series(
        "l", "weight", "overflows%", [0.0] + [1.0] * 7, rank=1
    )
    assert kinds(stats) == [("l", "weight", "overflow", 1)]


def test_precedence_of_remedies_on_one_gemm():
    remedies = [
        Remedy("PerTensorScaling", "l", ("fprop", "wgrad"), "activation", "a"),
        Remedy("DisableFP8GEMM", "l", ("dgrad", "wgrad"), None, "b"),
        Remedy("PerTensorScaling", "l", ("fprop", "dgrad"), "weight", "c"),
    ]
    features, reasons = layer_features(remedies)
    assert features == {
        "DisableFP8GEMM": {"enabled": True, "gemms": ["dgrad", "wgrad"]},
        "PerTensorScaling": {"enabled": True, "gemms": ["fprop"], "tensors": ["activation", "weight"]},
    }
    assert reasons == ["a", "b", "c"]
    features, reasons = layer_features([Remedy("PerTensorScaling", "l", ("dgrad",), "weight", "lost"), remedies[1]])
    assert list(features) == ["DisableFP8GEMM"] and reasons == ["b"]


def test_yaml_of_hostile_layer_names_parses_back_to_the_config():
    names = ["a\nb: {x: 1}", "# not a comment", "ü €", "x" * 300, "a.b", "a_b"]
    stats = [s for name in names for s in series(name, "gradient", "dynamic_range", [40.0] * 4)]
    diagnosis = diagnose_statistics(stats, source="C:\\logs\n# evil")
    assert yaml.safe_load(diagnosis.config_yaml) == diagnosis.config
    assert sorted(s["layers"]["exact_layer_names"][0] for s in diagnosis.config.values()) == sorted(names)
    assert {"diagnose_a_b", "diagnose_a_b_2"} <= set(diagnosis.config)
    assert all(line.startswith("#") or not line.startswith(" ") for line in diagnosis.config_yaml.splitlines()[:8])
    assert to_yaml({}, {}, "x").startswith("# Remedies written by nvdlfw-inspect diagnose. Run: x\n")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"tail": 0}, "threshold tail is a fraction of the iterations in (0, 1], got 0"),
        ({"overflow_pct": -1}, "percentages in [0, 100)"),
        ({"underflow_pct": math.nan}, "threshold underflow_pct must be a finite number, got nan"),
        ({"warmup": 1.5}, "threshold warmup is a number of iterations"),
        ({"range_margin_bits": -2}, "threshold range_margin_bits must be >= 0, got -2"),
        ({"peer_ratio": 1}, "threshold peer_ratio is a factor greater than 1, got 1"),
        ({"fp8_format": "E3M4"}, "fp8_format must be one of ['HYBRID', 'E4M3', 'E5M2'], got 'E3M4'"),
        ({"persistance": 0.5}, "unknown threshold persistance; known: underflow_pct, overflow_pct, persistence"),
    ],
)
def test_bad_thresholds_are_clear_errors(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=None) as error:
        diagnose(tmp_path, **overrides)
    assert message in str(error.value)


def test_thresholds_or_overrides_not_both(tmp_path):
    with pytest.raises(ValueError, match="give thresholds or keyword overrides of the defaults, not both"):
        diagnose(tmp_path, Thresholds(), tail=0.5)


def peers(values: dict[str, float], tensor: str = "weight", stat: str = "cur_amax", steps: int = 8) -> list[Statistic]:
    return [
        s for layer, value in values.items() for s in series(layer, tensor, stat, [value * (1 + 0.01 * i) for i in range(steps)])
    ]


def test_a_tensor_unlike_its_peers_is_an_outlier():
    """The issue's case: one layer's weight scaled x1e4 (amax 851 where its peers' are about 0.08)."""
    layers = {f"model.layers.{i}.mlp.down_proj": 0.08 + 0.01 * i for i in range(4)}
    layers["model.layers.2.mlp.down_proj"] = 851.0
    diagnosis = diagnose_statistics(peers(layers) + peers({"model.layers.0.self_attn.q_proj": 0.5}))
    [finding] = diagnosis.findings
    assert (finding.layer, finding.tensor, finding.kind, finding.stat) == (
        "model.layers.2.mlp.down_proj",
        "weight",
        "peer_outlier",
        "cur_amax",
    )
    assert "3 peers (model.layers.*.mlp.down_proj)" in finding.message and finding.summary.worst > 5e3
    assert finding.remedies == () and not diagnosis.config  # no precision setting repairs it: said, not configured
    assert kinds(peers(layers), peer_ratio=1e5) == []


def test_too_few_peers_and_experts_alike():
    pair = {"model.layers.0.fc": 0.1, "model.layers.1.fc": 100.0}  # one peer: which of the two is odd?
    assert kinds(peers(pair)) == []
    experts = {f"model.moe.experts.gate_up_proj.gemm_{i}": 1.0 for i in range(4)} | {
        "model.moe.experts.gate_up_proj.gemm_3": 1e-3
    }
    assert kinds(peers(experts, tensor="activation", stat="max")) == [
        ("model.moe.experts.gate_up_proj.gemm_3", "activation", "peer_outlier", 1)
    ]


def test_a_passing_difference_from_the_peers_is_not_an_outlier():
    layers = {f"blocks.{i}.fc": 1.0 for i in range(4)}
    stats = peers(layers)
    stats = [
        Statistic(s.rank, s.layer, s.tensor, s.stat, s.iteration, 500.0) if (s.layer, s.iteration) == ("blocks.1.fc", 3) else s
        for s in stats
    ]
    assert kinds(stats) == []  # one iteration of eight: a spike, not what persists


def test_the_peer_check_takes_one_median_per_group_and_iteration(monkeypatch):
    """A mixture-of-experts model has thousands of alike layers: a median per layer and iteration over all its
    peers made the check quadratic (1,000 layers: 45 s). One median per group and iteration keeps it linear, and
    the outlier is still the one found."""
    import nvdlfw_inspect.diagnose.findings as findings

    medians = []
    real_median = findings.statistics.median
    monkeypatch.setattr(findings.statistics, "median", lambda values: medians.append(len(values)) or real_median(values))
    layers = {f"model.moe.experts.down_proj.gemm_{i}": 1.0 + 1e-3 * i for i in range(300)}
    layers["model.moe.experts.down_proj.gemm_17"] = 900.0
    assert kinds(peers(layers)) == [("model.moe.experts.down_proj.gemm_17", "weight", "peer_outlier", 1)]
    assert len(medians) == 8 and set(medians) == {300}  # one per logged iteration, over the whole group
