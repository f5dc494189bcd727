"""The per-block findings of ``diagnose`` on real runs of ``lowprec`` layers logged with per-block statistics: an
MXFP8 activation with one outlier channel flushes the other values of its blocks (``block_underflow``, with where the
worst block is), its healthy twin has no finding; NVFP4 channels far below the others lose their block scales and
the finding names their column block; block amaxes just under a power of two saturate under the OCP rule
(``block_saturation``) but not under NVIDIA's, and healthy data under the OCP rule stays under its calibrated
threshold; NVFP4 rows far below the tensor's amax lose their E4M3 block scales (the scale histogram's span), a few of
them a ``block_error`` alone; a per-tensor FP8 layer's what-if block statistics are named, not judged."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import lowprec
import nvdlfw_inspect.api as debug_api
from lowprec.plan.recipes import named_recipe
from nvdlfw_inspect.cli import main
from nvdlfw_inspect.diagnose import Thresholds, diagnose
from nvdlfw_inspect.diagnose.findings import E4M3_SCALE_BINADES, KINDS
from nvdlfw_inspect.diagnose.formats import MECHANISMS, SATURATING_RULES
from nvdlfw_inspect.diagnose.thresholds import (
    CALIBRATED_SATURATED_BLOCKS_PCT,
    FORMAT_SATURATED_BLOCKS_PCT,
    FORMAT_UNDERFLOW_BLOCKS_PCT,
    FORMAT_WORST_BLOCK_ERR,
)
from nvdlfw_inspect.reading import iter_statistics, read_routing
from nvdlfw_inspect.report import report_data

BLOCK_STATS = ["underflow_blocks%", "saturated_blocks%", "worst_block_rel_err", "worst_block_row", "worst_block_col"]
FLUSHED_STATS = ["worst_block_flushed%", "worst_flushed_row", "worst_flushed_col"]
SCALE_STATS = ["scale_inv_std", "scale_exp_hist"]
STEPS, TOKENS, WIDTH = 5, 32, 64
BLOCK_KINDS = ("block_underflow", "block_saturation", "block_error")


def run(log_dir: Path, recipe: str, activation: Callable[[torch.Generator], torch.Tensor], feature: dict) -> None:
    """``model.a`` under ``recipe`` (``named_recipe``) for ``STEPS`` steps, fed ``activation`` and N(0, 1) gradients,
    its activation logged by ``feature`` (``{name: config}``)."""
    config = {"blocks": {"enabled": True, "layers": {"layer_name_regex_pattern": ".*"}, "transformer_engine": feature}}
    debug_api.initialize(config_file=config, feature_dirs=[lowprec.FEATURE_DIR], log_dir=str(log_dir))
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    layer = lowprec.Linear(WIDTH, WIDTH, name="model.a")
    try:
        for _ in range(STEPS):
            x = activation(gen)
            with lowprec.autocast(recipe=named_recipe(recipe)):
                y = layer(x)
            y.backward(torch.randn(y.shape, generator=gen))
            debug_api.step()
    finally:
        debug_api.end_debug()


def fp8_stats(stats: list[str]) -> dict:
    return {"LogFp8TensorStats": {"enabled": True, "tensors": ["activation"], "stats": stats}}


def gaussian(gen: torch.Generator, tokens: int = TOKENS) -> torch.Tensor:
    return torch.randn(tokens, WIDTH, generator=gen)


def outlier_channel(gen: torch.Generator) -> torch.Tensor:
    """Channel 37 (column block 1 of 32 values) a million times the others: E4M3 holds 2**17.8, so the scale of its
    blocks, set by it, flushes their other values."""
    x = gaussian(gen)
    x[:, 37] = 1e6
    return x


def amax_under_a_power_of_two(gen: torch.Generator) -> torch.Tensor:
    """Every block of 32 scaled so its amax is 1.9 x a power of two: the OCP rule's E8M0 scale (rounded down) maps it
    to 1.9 x 256 = 486, past E4M3's 448, while NVIDIA's (rounded up) maps it to 243."""
    x = gaussian(gen).reshape(TOKENS, WIDTH // 32, 32)
    amax = x.abs().amax(-1, keepdim=True)
    return (x * 1.9 * 2.0 ** amax.log2().floor() / amax).reshape(TOKENS, WIDTH)


def small_rows(rows: int, tokens: int, factor: float = 2.0**-24) -> Callable[[torch.Generator], torch.Tensor]:
    """The first ``rows`` rows ``factor`` times the others: NVFP4's per-tensor scale maps the largest block's scale to
    448, so at 2**-24 theirs fall below E4M3's smallest (2**-9) and flush with all their values."""

    def draw(gen: torch.Generator) -> torch.Tensor:
        x = gaussian(gen, tokens)
        x[:rows] *= factor
        return x

    return draw


def small_channels(gen: torch.Generator) -> torch.Tensor:
    """Channels 16 to 31 (column block 1 of 16 values) 2**-24 of the others: their NVFP4 block scales flush."""
    x = gaussian(gen)
    x[:, 16:32] *= 2.0**-24
    return x


def block_findings(diagnosis) -> list[tuple[str, str, str]]:
    return [(f.kind, f.tensor, f.stat) for f in diagnosis.findings if f.kind in BLOCK_KINDS]


def logged(log_dir: Path, stat: str) -> dict[int, float]:
    return {s.iteration: s.value for s in iter_statistics(log_dir) if (s.tensor, s.stat) == ("activation", stat)}


def test_an_outlier_channel_flushes_its_blocks_and_the_finding_names_its_column(tmp_path):
    run(tmp_path / "healthy", "mxfp8", gaussian, fp8_stats(BLOCK_STATS))
    assert block_findings(diagnose(tmp_path / "healthy")) == []

    run(tmp_path / "outlier", "mxfp8", outlier_channel, fp8_stats(BLOCK_STATS + FLUSHED_STATS))
    diagnosis = diagnose(tmp_path / "outlier")
    assert block_findings(diagnosis) == [("block_underflow", "activation", "underflow_blocks%")]
    (finding,) = [f for f in diagnosis.findings if f.kind == "block_underflow"]
    # every row's block holding channel 37 flushes, the other of its two blocks does not: half of the blocks
    assert logged(tmp_path / "outlier", "underflow_blocks%") == {i: 50.0 for i in range(STEPS)}
    assert finding.summary.persistent == 50.0 and finding.summary.threshold == FORMAT_UNDERFLOW_BLOCKS_PCT["mxfp8"]
    # the outlier dominates its blocks' norms, so their relative error is tiny: the worst block is in the other column
    # block (0) at every iteration, which the finding reports as it is
    assert set(logged(tmp_path / "outlier", "worst_block_col").values()) == {0.0}
    assert finding.context["worst_block_col"] == 0 and finding.context["worst_block_col_share"] == 1.0
    assert finding.context["worst_block_row"] == logged(tmp_path / "outlier", "worst_block_row")[STEPS - 1]
    # the end of the run: the median of the last quarter of the 4 iterations after warm-up, the last one
    assert finding.context["worst_block_rel_err"] == logged(tmp_path / "outlier", "worst_block_rel_err")[STEPS - 1]
    assert finding.where == "model.a (MXFP8)"
    assert finding.message.startswith(f"blocks flush their values to zero in MXFP8, which has {MECHANISMS['mxfp8']}")
    assert "MXFP8's threshold 1% (calibrated: well-behaved data gives up to 0%, x2)" in finding.message
    # the blocks that flush most are channel 37's: column block 1 at every iteration, keeping the outlier alone
    flushed = logged(tmp_path / "outlier", "worst_block_flushed%")
    assert set(logged(tmp_path / "outlier", "worst_flushed_col").values()) == {1.0}
    assert all(96.875 >= value > 50 for value in flushed.values())  # 31 of 32 at most: the outlier is kept
    assert finding.context["worst_flushed_col"] == 1 and finding.context["worst_flushed_col_share"] == 1.0
    assert finding.context["worst_block_flushed%"] == flushed[STEPS - 1]
    assert finding.context["worst_flushed_row"] == logged(tmp_path / "outlier", "worst_flushed_row")[STEPS - 1]
    assert finding.message.endswith(
        "the blocks that flush most are in column block 1 at most iterations (100% of 4): an outlier channel there sets "
        f"their scale (worst_block_flushed% {flushed[STEPS - 1]:.3g}%); the largest relative error is in column block 0 "
        "(worst_block_col; an outlier dominates its own block's norm, so that block's relative error stays small)"
    )
    (remedy,) = finding.remedies
    assert (remedy.feature, remedy.gemms) == ("precision_plan", ("fprop", "wgrad"))  # the next rung: E5M2 elements
    assert dict(remedy.options)["recipes"] == dict.fromkeys(
        ("fprop", "wgrad"), {"name": "MXFP8BlockScaling", "fp8_format": "E5M2"}
    )
    assert remedy.reason.startswith("It flushes the values of whole blocks to zero in MXFP8; a rule of the precision plan")

    assert main(["diagnose", str(tmp_path / "outlier"), "-o", str(tmp_path / "fix.yaml")]) == 0


def test_an_outlier_channel_that_moves_between_column_blocks_is_said_to_move(tmp_path):
    """The outlier at channel 37 (column block 1) at odd steps, 5 (column block 0) at even ones: after warm-up the
    blocks that flush most are half the time in each, so no one channel is named; without worst_block_flushed% the
    column is named but not called an outlier's."""
    steps = iter(range(STEPS))

    def moving(gen: torch.Generator) -> torch.Tensor:
        x = gaussian(gen)
        x[:, 37 if next(steps) % 2 else 5] = 1e6
        return x

    run(tmp_path, "mxfp8", moving, fp8_stats(BLOCK_STATS + FLUSHED_STATS))
    assert logged(tmp_path, "worst_flushed_col") == {0: 0.0, 1: 1.0, 2: 0.0, 3: 1.0, 4: 0.0}
    (finding,) = [f for f in diagnose(tmp_path).findings if f.kind == "block_underflow"]
    assert (finding.context["worst_flushed_col"], finding.context["worst_flushed_col_share"]) == (1, 0.5)
    assert (
        "the blocks that flush most move between column blocks (column block 1 at 50% of 4 iterations): no one outlier "
        "channel sets their scale"
    ) in finding.message

    # the column without the share: an outlier's blocks and blocks that lost their scale are not told apart
    run(tmp_path / "column", "mxfp8", outlier_channel, fp8_stats(["underflow_blocks%", "worst_flushed_col"]))
    (finding,) = [f for f in diagnose(tmp_path / "column").findings if f.kind == "block_underflow"]
    assert finding.message.endswith(
        "the blocks that flush most are in column block 1 at most iterations (100% of 4); log worst_block_flushed% to "
        "tell an outlier channel there (its blocks keep it) from blocks that lost their scale; log worst_block_col to "
        "see whether one channel range is the worst represented"
    )


def test_the_text_and_json_name_layer_tensor_format_and_column(tmp_path, capsys):
    run(tmp_path, "mxfp8", outlier_channel, fp8_stats(BLOCK_STATS))
    assert main(["diagnose", str(tmp_path), "-o", str(tmp_path / "fix.yaml")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "per block" not in lines[0]  # the calibrated thresholds: each finding names its own
    heading = lines.index("1. model.a (MXFP8)  activation  block_underflow (underflow_blocks%, from iteration 1)")
    assert "column block 0 at most iterations" in lines[heading + 1]
    assert (  # worst_flushed_col not logged: said, not guessed
        "log worst_flushed_col and worst_block_flushed% to see whether an outlier channel sets their blocks' scale"
    ) in lines[heading + 1]
    assert lines[heading + 2].startswith("   fix: precision_plan on fprop and wgrad: It flushes the values of whole blocks")

    assert main(["diagnose", str(tmp_path), "--block-underflow-pct", "60", "-o", str(tmp_path / "f.yaml")]) == 0
    assert capsys.readouterr().out.splitlines()[0].endswith(", per block underflow_blocks% > 60)")
    assert main(["diagnose", str(tmp_path), "--json", "--block-underflow-pct", "60", "-o", str(tmp_path / "f.yaml")]) == 0
    assert [f["kind"] for f in json.loads(capsys.readouterr().out)["findings"]] == []  # 50% is under the given 60%
    assert main(["diagnose", str(tmp_path), "--json", "--block-underflow-pct", "40", "-o", str(tmp_path / "f.yaml")]) == 0
    (data,) = json.loads(capsys.readouterr().out)["findings"]
    assert (data["kind"], data["layer"], data["tensor"], data["format"]) == ("block_underflow", "model.a", "activation", "mxfp8")
    assert data["context"]["worst_block_col"] == 0 and data["summary"]["threshold"] == 40
    assert "threshold 40% (given (block_underflow_pct))" in data["message"]


def test_the_ocp_rule_saturates_blocks_nvidias_does_not(tmp_path):
    stats = fp8_stats(BLOCK_STATS)
    run(tmp_path / "ocp", "mxfp8_ocp", amax_under_a_power_of_two, stats)
    run(tmp_path / "nvidia", "mxfp8", amax_under_a_power_of_two, stats)
    run(tmp_path / "ocp_healthy", "mxfp8_ocp", gaussian, stats)
    assert logged(tmp_path / "ocp", "saturated_blocks%") == {i: 100.0 for i in range(STEPS)}
    assert set(logged(tmp_path / "nvidia", "saturated_blocks%").values()) == {0.0}
    healthy = logged(tmp_path / "ocp_healthy", "saturated_blocks%")
    assert 0 < max(healthy.values()) < FORMAT_SATURATED_BLOCKS_PCT["mxfp8_ocp"]  # the rule saturates some blocks anyway

    ocp = diagnose(tmp_path / "ocp")
    assert block_findings(ocp) == [("block_saturation", "activation", "saturated_blocks%")]
    (finding,) = ocp.findings
    assert finding.where == "model.a (MXFP8 OCP)" and finding.summary.persistent == 100.0
    assert finding.message.startswith(
        "E8M0 scales rounded down by the OCP rule let a block's largest values saturate in MXFP8 OCP, which has "
        f"{MECHANISMS['mxfp8_ocp']} (saturated_blocks%: the blocks holding a saturated value): over 60.5% in 100%"
    )
    calibrated = CALIBRATED_SATURATED_BLOCKS_PCT["mxfp8_ocp"]
    assert f"well-behaved data saturates up to {calibrated:.3g}% of the blocks under this rule" in finding.message
    (remedy,) = finding.remedies  # the scales rounded up instead (arXiv 2506.08027)
    assert remedy.reason.startswith("Its blocks' largest values saturate in MXFP8 OCP; a rule of the precision plan")
    assert "(MXFP8 OCP -> MXFP8)" in remedy.reason
    assert {spec["scale_rule"] for spec in dict(remedy.options)["recipes"].values()} == {"nvidia"}
    assert block_findings(diagnose(tmp_path / "nvidia")) == []  # NVIDIA's rule: no saturation check, none saturates
    assert block_findings(diagnose(tmp_path / "ocp_healthy")) == []
    assert block_findings(diagnose(tmp_path / "ocp_healthy", block_saturation_pct=0.1)) == [
        ("block_saturation", "activation", "saturated_blocks%")
    ]
    assert set(SATURATING_RULES) == set(FORMAT_SATURATED_BLOCKS_PCT)


def test_nvfp4_rows_far_below_the_amax_lose_their_block_scales(tmp_path):
    """Eight of 32 rows 2**-24 down: a quarter of the blocks flush whole, the scale histogram spans past E4M3's normal
    range and puts them at zero; two rows of 256: under the underflow threshold, the worst block's error (1: all
    lost) is a finding of its own; rows 2**-17.5 down keep subnormal E4M3 scales or lose them."""
    stats = {
        "LogNvfp4TensorStats": {"enabled": True, "tensors": ["activation"], "stats": BLOCK_STATS + FLUSHED_STATS + SCALE_STATS}
    }
    run(tmp_path / "healthy", "nvfp4", gaussian, stats)
    assert block_findings(diagnose(tmp_path / "healthy")) == []

    run(tmp_path / "small", "nvfp4", small_rows(8, TOKENS), stats)
    (finding,) = [f for f in diagnose(tmp_path / "small").findings if f.kind in BLOCK_KINDS]
    assert (finding.kind, finding.stat) == ("block_underflow", "nvfp4_underflow_blocks%")
    assert finding.summary.persistent == 25.0
    hist = {
        s.stat.removeprefix("nvfp4_scale_exp_hist_"): s.value
        for s in iter_statistics(tmp_path / "small")
        if s.stat.startswith("nvfp4_scale_exp_hist_") and s.iteration == STEPS - 1 and s.value > 0
    }
    exponents = [0 if tag == "0" else int(tag[1:]) * (-1 if tag[0] == "m" else 1) for tag in hist if tag != "under"]
    assert finding.context["scale_span_binades"] == max(exponents) - min(exponents) + 1  # the rows left: a few binades
    assert finding.context["zero_scale_blocks%"] == pytest.approx(100 * hist["under"] / sum(hist.values())) == 25.0
    assert finding.context["scale_inv_std"] == logged(tmp_path / "small", "nvfp4_scale_inv_std")[STEPS - 1]
    assert "scale_inv_std_unit" not in finding.context  # NVFP4 logs the E4M3 scale itself, not an exponent
    assert (
        "25% of the blocks have a zero E4M3 scale (scale_exp_hist_under; all-zero blocks too): a block more than 2^17.8 "
        "(down to E4M3's smallest subnormal) below the largest loses its scale with all its values"
    ) in finding.message
    # every flushed block's error is 1, a tie that goes to the last of them in row-major order: row 7, column block 3
    assert (finding.context["worst_block_row"], finding.context["worst_block_col"]) == (7, 3)
    assert "the worst block is in column block 3 at most iterations (100% of 4)" in finding.message
    # the blocks that flush most lose all their values, a tie too: no outlier among them, their column only the last
    assert set(logged(tmp_path / "small", "nvfp4_worst_block_flushed%").values()) == {100.0}
    assert (finding.context["worst_flushed_row"], finding.context["worst_flushed_col"]) == (7, 3)
    assert (
        "the blocks that flush most lose all their values (worst_block_flushed% 100%): their scales were lost, not set "
        "by an outlier among them (such blocks tie, and column block 3 is only the last of them)"
    ) in finding.message
    assert "an outlier channel there sets their scale" not in finding.message

    run(tmp_path / "subnormal", "nvfp4", small_rows(8, TOKENS, 2.0**-17.5), stats)  # some scales flush, some not
    (subnormal,) = [f for f in diagnose(tmp_path / "subnormal").findings if f.kind in BLOCK_KINDS]
    assert subnormal.kind == "block_underflow" and subnormal.summary.persistent == 3.125  # 8 of 256 blocks
    assert subnormal.context["zero_scale_blocks%"] == 3.125
    span = subnormal.context["scale_span_binades"]
    assert span == 19 and f"its block scales span 19 binades (scale_exp_hist), past the {E4M3_SCALE_BINADES:.1f} of" in (
        subnormal.message
    )

    run(tmp_path / "few", "nvfp4", small_rows(2, 256), stats)
    (few,) = [f for f in diagnose(tmp_path / "few").findings if f.kind in BLOCK_KINDS]
    assert (few.kind, few.stat, few.summary.persistent) == ("block_error", "nvfp4_worst_block_rel_err", 1.0)
    assert logged(tmp_path / "few", "nvfp4_underflow_blocks%")[STEPS - 1] == pytest.approx(100 * 2 / 256)
    assert few.summary.threshold == FORMAT_WORST_BLOCK_ERR["nvfp4"]
    assert (few.remedies[0].feature, dict(few.remedies[0].options)["recipes"]["fprop"]) == (
        "precision_plan",
        {"name": "MXFP8BlockScaling"},
    )


def test_nvfp4_channels_that_lose_their_scales_are_named_by_column_block(tmp_path):
    stats = {"LogNvfp4TensorStats": {"enabled": True, "tensors": ["activation"], "stats": BLOCK_STATS}}
    run(tmp_path, "nvfp4", small_channels, stats)
    (finding,) = [f for f in diagnose(tmp_path).findings if f.kind in BLOCK_KINDS]
    assert (finding.kind, finding.summary.persistent) == ("block_underflow", 25.0)  # one of 4 column blocks
    assert set(logged(tmp_path, "nvfp4_worst_block_col").values()) == {1.0}
    assert set(logged(tmp_path, "nvfp4_worst_block_rel_err").values()) == {1.0}  # all lost
    assert finding.context["worst_block_rel_err"] == 1.0 and finding.context["worst_block_row"] == TOKENS - 1  # ties: last
    assert finding.message.endswith(
        "the worst block is in column block 1 at most iterations (100% of 4): the channels of that column block are the "
        "worst represented"
    )


def test_per_tensor_fp8_what_if_block_statistics_are_named_not_judged(tmp_path):
    run(tmp_path, "current", amax_under_a_power_of_two, fp8_stats(["underflows%", "mxfp8_ocp_saturated_blocks%"]))
    assert set(logged(tmp_path, "mxfp8_ocp_saturated_blocks%").values()) == {100.0}  # what OCP MXFP8 would do
    diagnosis = diagnose(tmp_path)
    assert [f.kind for f in diagnosis.findings] == []
    assert diagnosis.skipped.startswith(
        "the per-block checks (underflow_blocks%, saturated_blocks%, worst_block_rel_err), which judge a block format's "
        "own cast, not what-if casts of another format nor layers whose routing records name no block format: model.a "
        "(mxfp8_ocp)"
    )


def test_the_new_kinds_are_ordered_rendered_and_refused_when_bad(tmp_path):
    assert KINDS.index("underflow") < KINDS.index("block_underflow") < KINDS.index("block_error") < KINDS.index("scale_change")
    run(tmp_path, "mxfp8", outlier_channel, fp8_stats(BLOCK_STATS))
    data = report_data(iter_statistics(tmp_path), "run", routing=read_routing(tmp_path))
    assert [f["kind"] for f in data["findings"]] == ["block_underflow"]
    js = (Path(lowprec.__file__).parents[1] / "nvdlfw_inspect" / "report" / "report.js").read_text()
    assert all(f"{kind}: " in js for kind in BLOCK_KINDS)  # each kind has its title
    for name, value in (("block_underflow_pct", 100), ("block_saturation_pct", -1), ("worst_block_err", math.nan)):
        with pytest.raises(ValueError, match=f"threshold {name} must be .* or None .*, got {value!r}"):
            Thresholds(**{name: value})
