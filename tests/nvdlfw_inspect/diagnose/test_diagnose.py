"""``diagnose`` on FP8 runs with planted problems: it finds each (layer, tensor, first iteration), the
config it writes is accepted by ``debug_api.initialize`` and applies the remedy, and the command line
prints the same."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
import yaml
from fp8ref import E5M2, current_fake_quant
from full_disk import NO_SPACE, fill_disk
from planted_runs import nan_run, planted_run, scaled_weight_run, stats_config

import lowprec
import nvdlfw_inspect.api as debug_api
from lowprec.debug.plan import Precision, build_plan
from nvdlfw_inspect.cli import main
from nvdlfw_inspect.diagnose import diagnose


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("planted")
    planted_run(log_dir)
    return log_dir


def found(diagnosis) -> dict:
    return {(f.layer, f.tensor): f for f in diagnosis.findings}


def test_planted_problems_are_found_with_their_remedies(planted):
    diagnosis = diagnose(planted)
    findings = found(diagnosis)
    assert {key: (f.kind, f.first_iteration) for key, f in findings.items()} == {
        ("model.grow", "activation"): ("overflow", 1),  # iteration 0 casts with scale 1: nothing overflows yet
        ("model.deep", "gradient"): ("underflow", 1),
        ("model.shrink", "gradient"): ("underflow", 7),  # once the history's old amax holds the scale 2**28 too small
        ("model.wide", "activation"): ("underflow", 1),
    }
    remedies = {key: [(r.feature, r.gemms, r.tensor, dict(r.options)) for r in f.remedies] for key, f in findings.items()}
    assert remedies == {
        ("model.grow", "activation"): [("PerTensorScaling", ("fprop", "wgrad"), "activation", {})],
        ("model.deep", "gradient"): [("DisableFP8GEMM", ("dgrad", "wgrad"), None, {})],
        ("model.shrink", "gradient"): [("PerTensorScaling", ("dgrad", "wgrad"), "gradient", {})],
        ("model.wide", "activation"): [("FakeQuant", ("fprop", "wgrad"), "activation", {"quant_format": "FP8E5M2"})],
    }
    assert diagnosis.findings[0].layer == "model.grow"  # overflow first
    deep = findings[("model.deep", "gradient")]
    assert deep.summary.warmup_worst_iteration == 0 and deep.summary.worst_iteration > 0  # scale 1 at iteration 0: set aside
    assert deep.summary.warmup_worst > deep.summary.worst and "in warm-up, set aside" in deep.message
    assert deep.summary.above == 1.0 and 10 < deep.summary.persistent < 25
    assert "39." in deep.remedies[0].reason and "beyond every FP8 format's range" in deep.remedies[0].reason
    assert diagnosis.iterations == (0, 15)


def test_the_written_config_is_valid_and_applies_each_remedy(planted, tmp_path):
    path = tmp_path / "fix.yaml"
    path.write_text(diagnose(planted).config_yaml)
    debug_api.initialize(config_file=str(path), feature_dirs=[lowprec.FEATURE_DIR], log_dir=str(tmp_path / "logs"))
    plans = {name: build_plan(f"model.{name}", 0, fp8=True) for name in ("grow", "deep", "shrink", "wide", "clean")}
    assert plans["deep"].precision("gradient", "dgrad") is Precision.HIGH_PRECISION
    assert plans["deep"].precision("activation", "wgrad") is Precision.HIGH_PRECISION
    assert plans["deep"].precision("activation", "fprop") is Precision.QUANTIZE
    assert plans["grow"].precision("activation", "fprop") is plans["grow"].precision("activation", "wgrad") is Precision.MODIFY
    assert plans["shrink"].precision("gradient", "dgrad") is Precision.MODIFY
    assert plans["wide"].precision("activation", "fprop") is Precision.MODIFY
    assert plans["wide"].precision("weight", "fprop") is Precision.HIGH_PRECISION  # FakeQuant's GEMM runs in high precision
    inputs = ("activation", "weight", "gradient")
    assert all(p is Precision.QUANTIZE for name in inputs for p in plans["clean"].tensors[name].gemms.values())

    # the DisableFP8GEMM'd GEMMs of model.deep now compute in high precision: dx and dw as plain PyTorch's
    torch.manual_seed(0)
    x, dy = torch.randn(16, 32), torch.exp2(-40 * torch.rand(16, 32)) * torch.randn(16, 32).sign()
    grads = {}
    for name in ("deep", "clean"):
        layer = lowprec.Linear(32, 32, name=f"model.{name}")
        layer.weight.data.copy_(torch.linspace(-0.3, 0.3, 32 * 32).reshape(32, 32))
        inp = x.clone().requires_grad_()
        with lowprec.fp8_autocast(fp8_recipe=lowprec.DelayedScaling()):
            out = layer(inp)
        out.backward(dy)
        grads[name] = inp.grad, layer.weight.grad
        reference = x.clone().requires_grad_()
        F.linear(reference, layer.weight.detach(), layer.bias.detach()).backward(dy)
        grads[name + "_exact"] = reference.grad, dy.t() @ x
    assert torch.allclose(grads["deep"][0], grads["deep_exact"][0], rtol=1e-6, atol=0)
    assert torch.allclose(grads["deep"][1], grads["deep_exact"][1], rtol=1e-6, atol=0)
    assert not torch.allclose(grads["clean"][0], grads["clean_exact"][0], rtol=1e-2, atol=0)  # FP8 dgrad loses the small values

    # FakeQuant: model.wide's fprop multiplies the activation rounded to E5M2 by the exact weight
    wide = lowprec.Linear(32, 32, name="model.wide")
    x = torch.exp2(-26 * torch.rand(16, 32)) * torch.randn(16, 32).sign()
    with lowprec.fp8_autocast(fp8_recipe=lowprec.DelayedScaling()):
        y = wide(x)
    expected = current_fake_quant(x, E5M2) @ wide.weight.detach().t() + wide.bias.detach()
    assert torch.allclose(y.detach(), expected, rtol=1e-5, atol=1e-7)


def test_rerun_with_the_remedies_clears_what_they_fix(planted, tmp_path):
    """Re-run with the remedies: the statistics describe what the GEMMs read after them (PerTensorScaling's cast,
    FakeQuant's rounded operand, the tensor itself in high precision), so every finding is gone, and diagnose
    names each remedy in place and says that it worked."""
    before = diagnose(planted)
    remedies = yaml.safe_load(before.config_yaml)
    assert not set(remedies) & set(stats_config())
    planted_run(tmp_path, extra=remedies)
    after = diagnose(tmp_path)
    assert found(after) == {}
    fixed = {(f.layer, f.tensor): f.remedies[0].feature for f in before.findings}
    in_place = {(entry.layer, entry.tensor): entry for entry in after.in_place}
    for (layer, tensor), feature in fixed.items():
        assert in_place[(layer, tensor)].feature == feature and in_place[(layer, tensor)].verdict == "worked", (layer, tensor)
        assert in_place[(layer, tensor)].since == 0


def test_nan_is_traced_to_its_first_iteration_and_tensor(tmp_path):
    nan_run(tmp_path / "run", nan_step=9)
    diagnosis = diagnose(tmp_path / "run")
    first = diagnosis.findings[0]
    assert (first.kind, first.layer, first.tensor, first.first_iteration) == ("nonfinite", "model.fc2", "activation", 9)
    assert first.context["last_clean"] == 8 and "last logged clean at 8" in first.message
    assert [f.kind for f in diagnosis.findings].count("nonfinite") == 1
    watch = diagnosis.config["diagnose_watch_nonfinite"]["transformer_engine"]["LogTensorStats"]
    assert (watch["start_step"], watch["end_step"], watch["freq"]) == (8, 9, 1)
    path = tmp_path / "fix.yaml"
    path.write_text(diagnosis.config_yaml)
    debug_api.initialize(config_file=str(path), feature_dirs=[lowprec.FEATURE_DIR], log_dir=str(tmp_path / "logs"))
    plan = build_plan("model.fc2", 8, fp8=True)
    assert plan.tensors["output"].inspect and plan.tensors["wgrad"].inspect
    assert not build_plan("model.fc2", 10, fp8=True).tensors["output"].inspect  # the window ends at the first NaN


def test_command_line_prints_findings_and_writes_the_config(planted, tmp_path, capsys):
    out_path = tmp_path / "fix.yaml"
    assert main(["diagnose", str(planted), "-o", str(out_path)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"4 findings in {planted} (iterations 0 to 15; underflow > 1%, overflow > 0.1%")
    assert (
        "scale change > x4, peer ratio > x100, HYBRID, underflow by format mxfp6_e3m2 > 1.2%, mxfp6_e2m3 > 8.9%, "
        "mxfp4 > 33.9%, mxfp4_nvidia > 44.2%, nvfp4 > 25.1%)"
    ) in printed.splitlines()[0]
    assert "1. model.grow (FP8 delayed scaling)  activation  overflow (overflows%, from iteration 1)" in printed
    assert "fix: DisableFP8GEMM on dgrad and wgrad:" in printed and f"config: {out_path}" in printed
    assert out_path.read_text() == diagnose(planted).config_yaml

    assert main(["diagnose", str(planted), "--json", "-o", str(out_path), "--underflow-pct", "50", "--overflow-pct", "99"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["thresholds"]["underflow_pct"] == 50.0 and data["config_file"] == str(out_path)
    assert [(f["layer"], f["kind"]) for f in data["findings"]] == [("model.shrink", "underflow")]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--persistence", "0"], "threshold persistence is a fraction of the iterations in (0, 1], got 0.0"),
        (["--underflow-pct", "100"], "underflow_pct and overflow_pct are percentages in [0, 100)"),
        (["--scale-change", "1"], "threshold scale_change is a factor greater than 1, got 1.0"),
        (["--warmup", "-1"], "threshold warmup is a number of iterations (an integer >= 0), got -1"),
    ],
)
def test_command_line_refuses_bad_thresholds(planted, capsys, argv, message):
    assert main(["diagnose", str(planted), *argv]) == 1
    assert message in capsys.readouterr().err


def test_command_line_without_statistics_or_a_place_for_the_config(planted, tmp_path, capsys):
    assert main(["diagnose", str(tmp_path / "nowhere")]) == 1
    assert "nvdlfw-inspect diagnose: no statistics in" in capsys.readouterr().err
    assert main(["diagnose", str(planted), "-o", str(tmp_path / "missing" / "fix.yaml")]) == 1
    assert "cannot write the config to" in capsys.readouterr().err


def test_a_full_disk_keeps_the_previous_config(planted, tmp_path, monkeypatch, capsys):
    path = tmp_path / "fix.yaml"
    path.write_text("previous: config\n")
    fill_disk(monkeypatch)
    assert main(["diagnose", str(planted), "-o", str(path)]) == 1
    assert capsys.readouterr().err == f"nvdlfw-inspect diagnose: cannot write the config to '{path}': {NO_SPACE}\n"
    assert path.read_text() == "previous: config\n" and [p.name for p in tmp_path.iterdir()] == ["fix.yaml"]


def test_a_weight_scaled_unlike_its_peers_is_found_in_a_real_run(tmp_path):
    """Four blocks alike, one weight scaled x1e4 (a bad load): FP8 training goes on (per-tensor scaling
    absorbs it); diagnose names that layer's weight, and only it."""
    scaled_weight_run(tmp_path)
    found = [(f.layer, f.tensor, f.kind) for f in diagnose(tmp_path).findings if f.kind == "peer_outlier"]
    assert found == [("model.layers.2.0", "weight", "peer_outlier")]
