"""``diagnose`` on a run under a precision plan: each finding names the format its layer reads the tensor in (text
and JSON), the checks of a per-tensor FP8 scale skip block-format and high-precision layers and say so, and a run
whose routing records name no format is diagnosed as before, in the run-wide ``--fp8-format``."""

from __future__ import annotations

import json
import shutil
import statistics

import pytest
from planted_runs import mixed_formats_run

from nvdlfw_inspect.cli import main
from nvdlfw_inspect.diagnose import Thresholds, diagnose, diagnose_statistics
from nvdlfw_inspect.diagnose.formats import TENSOR_GEMMS, Formats
from nvdlfw_inspect.reading import ROUTING_RECORDS_DIR, RoutingRecord, Statistic, iter_statistics

SKIPPED_BLOCK = (
    "the checks of a per-tensor FP8 scale (a dynamic range against FP8E4M3's or FP8E5M2's, scale jumps), which do not "
    "apply to block formats (each block has its own scale; underflows% measures what they lose): model.mixed (MXFP8, "
    "NVFP4), model.nvfp4 (NVFP4)"
)
SKIPPED_HIGH = "to high precision (no recipe casts it): model.hp"
SKIPPED_HIGH_ONLY = (
    "the checks of a per-tensor FP8 scale (a dynamic range against FP8E4M3's or FP8E5M2's, scale jumps), which do not "
    f"apply {SKIPPED_HIGH}"
)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("mixed")
    mixed_formats_run(log_dir)
    return log_dir


def without_formats(run, to):
    """A copy of ``run`` whose routing records lack ``format``, as a run of an older version wrote them."""
    shutil.copytree(run, to)
    for path in (to / ROUTING_RECORDS_DIR).iterdir():
        records = [json.loads(line) for line in path.read_text().splitlines()]
        assert any([record.pop("format", None) for record in records])
        path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return to


def end_of_run(log_dir, layer: str, tensor: str, stat: str) -> float:
    """The median of the last quarter of the iterations after warm-up, as ``diagnose`` reads the end of a run."""
    values = [s.value for s in iter_statistics(log_dir) if (s.layer, s.tensor, s.stat) == (layer, tensor, stat)]
    return statistics.median(values[1:][-2:])  # 6 iterations, 1 of warm-up: the last 2 of 5


def test_each_finding_names_its_layers_format_and_block_formats_get_their_own_remedy(mixed):
    diagnosis = diagnose(mixed)
    found = {(f.layer, f.tensor, f.kind): f for f in diagnosis.findings}
    assert list(found) == [
        ("model.mixed", "activation", "underflow"),
        ("model.fp8", "activation", "underflow"),
        ("model.nvfp4", "activation", "underflow"),
    ]  # no dynamic range finding for the NVFP4 gradient of model.mixed nor the high-precision model.hp; NVFP4's ~75%
    # is 3x its calibrated threshold (25.1%), the others' ~26% 26x their 1%
    fp8, nvfp4, mixed_ = (found[(f"model.{name}", "activation", "underflow")] for name in ("fp8", "nvfp4", "mixed"))
    for finding in (fp8, nvfp4, mixed_):
        assert finding.summary.persistent == pytest.approx(end_of_run(mixed, finding.layer, "activation", "underflows%"))
    assert fp8.where == "model.fp8 (FP8 current scaling)"
    assert fp8.message.startswith(
        "non-zero values flush to zero in FP8 current scaling, which has one scale for the whole tensor, from its own "
        "amax: over 1%"
    )
    assert fp8.message.endswith("; FP8 current scaling's threshold 1% (underflow_pct; well-behaved data gives up to 0.058%)")
    assert nvfp4.where == "model.nvfp4 (NVFP4)"
    assert nvfp4.message.startswith("non-zero values flush to zero in NVFP4, which has a scale per block of 16 values")
    assert ": over 25.1% in 100% of the iterations" in nvfp4.message
    assert nvfp4.message.endswith("; NVFP4's threshold 25.1% (calibrated: well-behaved data gives up to 12.5%, x2)")
    assert mixed_.where == "model.mixed (MXFP8 in fprop, NVFP4 in wgrad)"
    assert mixed_.message.startswith(
        "non-zero values flush to zero in MXFP8 (fprop's cast), which has a scale per block of 32 values (E8M0 "
        "power-of-two scales): over 1%"
    )
    # the per-tensor FP8 layer: its range (26 bits) against E4M3's, as before; the block formats: high precision
    assert [(r.feature, r.gemms, dict(r.options)) for r in fp8.remedies] == [
        ("FakeQuant", ("fprop", "wgrad"), {"quant_format": "FP8E5M2"})
    ]
    assert fp8.context["element"] == "FP8E4M3" and nvfp4.context["element"] is None
    # the block formats: the next rung as a precision plan rule, on the GEMMs that read the tensor in the measured
    # format; the run's other GEMMs keep their recipes, options and all (model.nvfp4 ran without stochastic rounding)
    (remedy,) = nvfp4.remedies
    unrounded = {"name": "NVFP4BlockScaling", "disable_stochastic_rounding": True}
    assert (remedy.feature, remedy.gemms, remedy.tensor) == ("precision_plan", ("fprop", "wgrad"), "activation")
    assert dict(remedy.options)["recipes"] == {"fprop": {"name": "MXFP8BlockScaling"}, "wgrad": {"name": "MXFP8BlockScaling"}}
    assert dict(remedy.options)["base"] == dict.fromkeys(("fprop", "dgrad", "wgrad"), unrounded)
    assert remedy.reason.startswith(
        "It loses values to zero in NVFP4; a rule of the precision plan changes the GEMMs that read it in NVFP4, fprop "
        "and wgrad: MXFP8 (E4M3 elements, 4 more bits than E2M1, a scale per 32 values) (NVFP4 -> MXFP8)"
    )
    (remedy,) = mixed_.remedies  # measured in fprop's MXFP8 cast: fprop gets E5M2 elements, the NVFP4 wgrad stays
    assert (remedy.feature, remedy.gemms) == ("precision_plan", ("fprop",))
    assert dict(remedy.options)["recipes"] == {"fprop": {"name": "MXFP8BlockScaling", "fp8_format": "E5M2"}}
    assert "fprop: MXFP8 with E5M2 elements for its operands (fp8_format E5M2): 15 more bits" in remedy.reason
    assert "(stays in MXFP8)" in remedy.reason
    assert diagnosis.skipped == f"{SKIPPED_BLOCK}; nor {SKIPPED_HIGH}"


def test_the_command_line_names_the_formats_in_text_and_json(mixed, tmp_path, capsys):
    assert main(["diagnose", str(mixed), "-o", str(tmp_path / "fix.yaml")]) == 0
    printed = capsys.readouterr().out
    lines = printed.splitlines()
    assert lines[1] == f"skipped: {SKIPPED_BLOCK}; nor {SKIPPED_HIGH}"
    assert "not measured" not in printed  # overflows% is not asked of a run without delayed scaling
    assert "1. model.mixed (MXFP8 in fprop, NVFP4 in wgrad)  activation  underflow (underflows%, from iteration 1)" in lines
    assert "2. model.fp8 (FP8 current scaling)  activation  underflow (underflows%, from iteration 1)" in lines
    assert "3. model.nvfp4 (NVFP4)  activation  underflow (underflows%, from iteration 1)" in lines

    assert main(["diagnose", str(mixed), "--json", "-o", str(tmp_path / "fix.yaml")]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [(f["layer"], f["format"], f["format_name"], f["gemm_formats"]) for f in data["findings"]] == [
        ("model.mixed", "mxfp8", "MXFP8 in fprop, NVFP4 in wgrad", {"fprop": "mxfp8", "wgrad": "nvfp4"}),
        (
            "model.fp8",
            "fp8_current_scaling",
            "FP8 current scaling",
            {"fprop": "fp8_current_scaling", "wgrad": "fp8_current_scaling"},
        ),
        ("model.nvfp4", "nvfp4", "NVFP4", {"fprop": "nvfp4", "wgrad": "nvfp4"}),
    ]
    assert data["skipped"] == f"{SKIPPED_BLOCK}; nor {SKIPPED_HIGH}"


def test_a_run_whose_records_name_no_format_is_diagnosed_as_before(mixed, tmp_path):
    """Records without ``format`` (older versions): every tensor in the run-wide FP8 format (``--fp8-format``), as
    before; only the layer its records say ran without a recipe is skipped. Without records, exactly as before."""
    old = without_formats(mixed, tmp_path / "old")
    before = [
        ("model.nvfp4", "activation", "underflow", "FakeQuant"),  # 26 bits: beyond E4M3's, within E5M2's
        ("model.mixed", "activation", "underflow", "FakeQuant"),
        ("model.fp8", "activation", "underflow", "FakeQuant"),
        ("model.hp", "activation", "dynamic_range", "FakeQuant"),
        ("model.mixed", "gradient", "dynamic_range", "DisableFP8GEMM"),  # 40 bits: beyond E5M2's
    ]
    diagnosis = diagnose(old)
    assert [(f.layer, f.tensor, f.kind, f.remedies[0].feature) for f in diagnosis.findings] == before[:3] + before[4:]
    assert all(f.format is None and f.where == f.layer for f in diagnosis.findings)
    assert all(f.as_dict()["format"] is f.as_dict()["gemm_formats"] is None for f in diagnosis.findings)
    assert diagnosis.findings[0].message.startswith("non-zero values flush to zero in FP8: over 1%")
    assert diagnosis.findings[0].message.endswith("; FP8's threshold 1% (underflow_pct)")
    assert "its values span more bits than FP8E5M2 holds" in diagnosis.findings[3].message
    assert diagnosis.skipped == SKIPPED_HIGH_ONLY

    shutil.rmtree(old / ROUTING_RECORDS_DIR)  # no records at all (other frameworks): nothing is skipped
    diagnosis = diagnose(old)
    assert [(f.layer, f.tensor, f.kind, f.remedies[0].feature) for f in diagnosis.findings] == before
    assert diagnosis.skipped is None
    assert "its values span more bits than FP8E4M3 holds" in diagnosis.findings[3].message
    e5m2 = diagnose(old, fp8_format="E5M2")  # the flag still sets the element: 26 bits fit E5M2
    assert [(f.layer, f.tensor) for f in e5m2.findings if f.kind == "dynamic_range"] == [("model.mixed", "gradient")]


def record(layer: str, gemm: str, tensor: str, fmt: str | None, recipe: bool = True, iteration: int = 0, rank: int = 0):
    return RoutingRecord(rank, layer, gemm, tensor, "fp8" if recipe else "high_precision", None, recipe, iteration, format=fmt)


def test_formats_come_from_each_gemms_latest_record():
    records = [
        record("a", "fprop", "activation", "fp8_delayed_scaling"),
        record("a", "fprop", "weight", "fp8_delayed_scaling"),
        record("a", "wgrad", "activation", "fp8_delayed_scaling"),
        record("a", "dgrad", "gradient", "fp8_delayed_scaling"),
        record("a", "fprop", "activation", None, recipe=False, iteration=4),  # fprop in high precision from iteration 4
        record("a", "fprop", "activation", "nvfp4", rank=1, iteration=4),  # another rank's at the same iteration: not taken
        record("b", "fprop", "activation", "mxfp8"),
        record("b", "wgrad", "activation", None),  # under a recipe, but no format said: unknown
    ]
    formats = Formats(records, Thresholds(fp8_format="E4M3"))
    activation = formats.of("a", "activation")
    assert activation.gemms == (("fprop", None), ("wgrad", "fp8_delayed_scaling"))
    assert (activation.label, activation.per_tensor, str(activation)) == (
        "fp8_delayed_scaling",
        True,
        "high precision in fprop, FP8 delayed scaling in wgrad",
    )
    assert activation.measured == "FP8 delayed scaling (wgrad's cast)"  # what the statistics describe, fprop casting none
    assert str(formats.of("a", "output")) == "high precision"  # fprop's operands
    assert formats.element("a", "gradient") == "FP8E4M3"  # the flag's element: a format's name does not say it
    assert formats.range_limit("a", "gradient") == pytest.approx(17.807, abs=1e-3)
    assert formats.of("b", "activation") is None and formats.of("b", "weight") is None  # fall back to the flag
    assert formats.element("b", "activation") == "FP8E4M3" and formats.of("c", "activation") is None
    assert formats.without_tensor_scale("a", "output") is not None and formats.element("a", "output") is None


def test_scale_jumps_are_judged_in_per_tensor_fp8_layers_only():
    """An amax jumping x100 between iterations: a lagging scale in the FP8 layer; in the NVFP4 layers, whose blocks
    each have their own scale, not checked, and said, the list cut after eight layers."""
    layers = ["fp8"] + [f"b{i}" for i in range(10)]
    stats = [Statistic(0, layer, "activation", "cur_amax", i, [1.0, 100.0][i % 2]) for layer in layers for i in range(8)]
    records = [
        record(layer, gemm, tensor, "fp8_delayed_scaling" if layer == "fp8" else "nvfp4")
        for layer in layers
        for tensor in ("activation", "weight", "gradient")
        for gemm in TENSOR_GEMMS[tensor]
    ]
    diagnosis = diagnose_statistics(stats, routing=records)
    assert [(f.where, f.tensor, f.kind, f.remedies[0].feature) for f in diagnosis.findings] == [
        ("fp8 (FP8 delayed scaling)", "activation", "scale_change", "PerTensorScaling")
    ]
    assert diagnosis.skipped.endswith(
        "to block formats (each block has its own scale; underflows% measures what they lose): b0 (NVFP4), b1 (NVFP4), "
        "b2 (NVFP4), b3 (NVFP4), b4 (NVFP4), b5 (NVFP4), b6 (NVFP4), b7 (NVFP4) and 2 more layers"
    )


def nvfp4_records(layer: str) -> list[RoutingRecord]:
    return [
        RoutingRecord(0, layer, gemm, tensor, "fp8", None, True, 0, format="nvfp4")
        for tensor, gemms in TENSOR_GEMMS.items()
        if tensor in ("activation", "weight", "gradient")
        for gemm in gemms
    ]


def test_a_statistic_prefixed_with_the_layers_own_format_is_its_own_loss():
    """``LogNvfp4TensorStats`` (and ``compare``) log an NVFP4 layer's losses as ``nvfp4_underflows%``: read as the
    layer's underflows%, judged by NVFP4's threshold; a what-if prefix (another format's cast) is not; and a run
    without delayed scaling is not told that overflows% was not logged."""
    stats = [
        Statistic(0, layer, "activation", stat, i, value)
        for layer, stat, value in (("model.a", "nvfp4_underflows%", 40.0), ("model.b", "mxfp8_underflows%", 40.0))
        for i in range(6)
    ]
    diagnosis = diagnose_statistics(stats, routing=nvfp4_records("model.a") + nvfp4_records("model.b"))
    (finding,) = diagnosis.findings
    assert (finding.layer, finding.kind, finding.summary.threshold) == ("model.a", "underflow", 25.1)
    assert diagnosis.unmeasured is None
