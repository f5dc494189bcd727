"""Remedies that keep a block format (``diagnose.in_format``): each format's ladder, the precision plan rules they
are written as (alone and merged into the user's plan), and planted runs in NVFP4, MXFP4 and MXFP8 whose re-run
under the written plan shows each remedy worked, while the healthy twins have no finding."""

from __future__ import annotations

import re

import pytest
import yaml
from browser import CHROMIUM, dom
from planted_formats import FORMATS_PLAN, formats_run, user_config

import lowprec
from nvdlfw_inspect.cli import main
from nvdlfw_inspect.diagnose import diagnose
from nvdlfw_inspect.diagnose.formats import TensorFormat
from nvdlfw_inspect.diagnose.in_format import _step, plan_remedy, plan_rules, rule_name, rule_tensors
from nvdlfw_inspect.diagnose.merge import merge
from nvdlfw_inspect.diagnose.model import Finding
from nvdlfw_inspect.reading import read_routing
from nvdlfw_inspect.report import write_report

needs_browser = pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (scripts/test.sh installs it)")

NVFP4 = {"name": "NVFP4BlockScaling"}
NO_SR = {**NVFP4, "disable_stochastic_rounding": True}
NO_RHT = {**NVFP4, "disable_rht": True}
MXFP8 = {"name": "MXFP8BlockScaling"}
MXFP4 = {"name": "MXBlockScaling", "element": "e2m1"}


@pytest.mark.parametrize(
    ("spec", "tensor", "kind", "columnwise", "expected"),
    [
        # NVFP4: stochastic rounding of a gradient, then the Hadamard transform of a wgrad cast, then MXFP8
        (NO_SR, "gradient", "underflow", False, {**NO_SR, "disable_stochastic_rounding": False}),
        (NO_SR, "activation", "underflow", False, MXFP8),
        (NO_RHT, "activation", "underflow", True, {**NO_RHT, "disable_rht": False}),
        (NO_RHT, "activation", "underflow", False, MXFP8),  # the fprop cast: no transform there
        (NVFP4, "gradient", "underflow", False, MXFP8),
        (NVFP4, "weight", "block_saturation", False, MXFP8),
        # MX: the OCP floor rounded up for saturation; a wider element for underflow, E5M2 the last
        (MXFP4, "activation", "block_saturation", False, {**MXFP4, "scale_rule": "nvidia"}),
        (MXFP4, "activation", "underflow", False, {**MXFP4, "element": "e3m2"}),
        (
            {"name": "MXBlockScaling", "element": "e2m3"},
            "weight",
            "underflow",
            False,
            {"name": "MXBlockScaling", "element": "e4m3"},
        ),
        (
            {"name": "MXBlockScaling", "element": "e4m3"},
            "weight",
            "underflow",
            False,
            {"name": "MXBlockScaling", "element": "e5m2"},
        ),
        ({"name": "MXBlockScaling", "element": "e5m2"}, "weight", "underflow", False, None),
        (
            {"name": "MXBlockScaling", "element": "e4m3", "gradient_element": "e4m3"},
            "gradient",
            "underflow",
            False,
            {"name": "MXBlockScaling", "element": "e4m3", "gradient_element": "e5m2"},
        ),
        ({"name": "MXBlockScaling", "element": "e4m3"}, "weight", "block_saturation", False, None),  # rounds up already
        (MXFP8, "activation", "underflow", False, {**MXFP8, "fp8_format": "E5M2"}),
        (MXFP8, "gradient", "underflow", False, {**MXFP8, "fp8_format": "HYBRID"}),
        ({**MXFP8, "fp8_format": "HYBRID"}, "gradient", "underflow", False, None),
        (MXFP8, "activation", "block_saturation", False, None),
        # FP8 block scaling: 1-D weight blocks, then MXFP8's smaller blocks
        ({"name": "Float8BlockScaling"}, "weight", "underflow", False, {"name": "Float8BlockScaling", "w_block_scaling_dim": 1}),
        ({"name": "Float8BlockScaling"}, "activation", "underflow", False, MXFP8),
        ({"name": "Float8CurrentScaling"}, "activation", "underflow", False, None),
    ],
)
def test_each_format_has_its_ladder(spec, tensor, kind, columnwise, expected):
    step = _step(spec, tensor, kind, columnwise)
    assert (None if step is None else step[0]) == expected


def finding(layer: str, tensor: str, labels: dict[str, str], recipes: dict, kind: str = "underflow") -> Finding:
    gemms = {"activation": ("fprop", "wgrad"), "gradient": ("dgrad", "wgrad"), "weight": ("fprop", "dgrad")}[tensor]
    fmt = TensorFormat(tuple((gemm, labels[gemm]) for gemm in gemms))
    return Finding(kind, layer, tensor, "underflows%", 1, "", context={"recipes": recipes}, format=fmt)


def test_a_layer_without_a_rung_or_without_recipes_gets_none():
    labels = {"fprop": "mxfp8", "dgrad": "mxfp8", "wgrad": "mxfp8"}
    hybrid = {**MXFP8, "fp8_format": "HYBRID"}
    assert plan_remedy(finding("l", "gradient", labels, dict.fromkeys(labels, hybrid)), "lost") is None
    assert plan_remedy(finding("l", "gradient", labels, {}), "lost") is None  # a run whose records name no recipe


def test_rules_of_one_layer_combine_options_and_the_wider_format_wins():
    labels = dict.fromkeys(("fprop", "dgrad", "wgrad"), "nvfp4")
    both_off = {**NVFP4, "disable_stochastic_rounding": True, "disable_rht": True}
    recipes = dict.fromkeys(labels, both_off)
    gradient = plan_remedy(finding("model.fc1", "gradient", labels, recipes), "It loses values to zero")
    activation = finding("model.fc1", "activation", labels, recipes)
    activation = plan_remedy(Finding(**{**activation.__dict__, "stat": "underflows%_columnwise"}), "It loses values to zero")
    weight = plan_remedy(finding("model.fc1", "weight", labels, recipes), "It loses values to zero")
    assert gradient.gemms == ("dgrad", "wgrad") and activation.gemms == ("fprop", "wgrad") and weight.gemms == ("fprop", "dgrad")
    assert "stochastic rounding" in gradient.reason and "(stays in NVFP4)" in gradient.reason
    (rule,), reasons = plan_rules([gradient, activation])
    assert rule == {
        "name": "diagnose: model.fc1: gradient, activation",
        "layers": {"exact_layer_names": ["model.fc1"]},
        "fprop": {**both_off, "disable_rht": False},
        "dgrad": {**both_off, "disable_stochastic_rounding": False},
        "wgrad": {**NVFP4, "disable_stochastic_rounding": False, "disable_rht": False},  # both options on wgrad
    }
    assert len(reasons) == 2 and all(reason.startswith("model.fc1: It loses values to zero in NVFP4") for reason in reasons)
    (rule,), _ = plan_rules([gradient, weight])  # the weight's rung is MXFP8 on fprop and dgrad: wider than the option
    assert (rule["fprop"], rule["dgrad"], rule["wgrad"]) == (MXFP8, MXFP8, {**both_off, "disable_stochastic_rounding": False})
    assert rule_tensors(rule["name"]) == ("model.fc1", ["gradient", "weight"])
    assert rule_tensors("my own rule") is None and rule_tensors(rule_name("a: b", ["weight"])) == ("a: b", ["weight"])


PLAN_REMEDIES = {
    "precision_plan": {"rules": [{"name": "diagnose: model.a: activation", "layers": {"exact_layer_names": ["model.a"]}}]}
}


def test_the_rules_go_first_in_the_users_plan_and_replace_the_earlier_diagnosis_rules():
    user = {
        "precision_plan": {
            "default": "mxfp8",
            "rules": [
                {"name": "diagnose: model.a: gradient", "layers": {"exact_layer_names": ["model.a"]}, "recipe": "nvfp4"},
                {"name": "diagnose: model.b: gradient", "layers": {"exact_layer_names": ["model.b"]}, "recipe": "nvfp4"},
                {"name": "head", "layers": {"layer_name_regex_pattern": "head"}, "recipe": "bf16"},
            ],
        }
    }
    merged, notes = merge(user, PLAN_REMEDIES, ["model.a", "model.b", "head"], {"precision_plan": ["why"]})
    names = [rule["name"] for rule in merged["precision_plan"]["rules"]]
    assert names == ["diagnose: model.a: activation", "diagnose: model.b: gradient", "head"]
    assert merged["precision_plan"]["default"] == "mxfp8"
    assert notes["precision_plan"][0] == "why"
    assert "Replaces your rule 'diagnose: model.a: gradient'" in notes["precision_plan"][1]
    alone, _ = merge({}, PLAN_REMEDIES, ["model.a"])
    assert alone == PLAN_REMEDIES
    megatron = {"precision_plan": {"configs": {}, "matchers": {}}}
    with pytest.raises(ValueError, match="not lowprec's plan format .* write them there yourself"):
        merge(megatron, PLAN_REMEDIES, ["model.a"])


@pytest.fixture(scope="module")
def repaired(tmp_path_factory):
    """The planted run, the config ``diagnose --config`` merged for it, and the re-run under that config and plan."""
    root = tmp_path_factory.mktemp("formats")
    formats_run(root / "run", user_config(), FORMATS_PLAN)
    user, merged = root / "user.yaml", root / "merged.yaml"
    user.write_text(yaml.safe_dump(user_config()))
    dirs = ["--feature-dirs", str(lowprec.FEATURE_DIR)]
    assert main(["diagnose", str(root / "run"), "--config", str(user), "-o", str(merged), *dirs]) == 0
    formats_run(root / "rerun", merged, merged)
    return root


EXPECTED = {
    ("model.nvfp4", "gradient"): ("underflow", "NVFP4", ("dgrad", "wgrad"), {**NO_SR, "disable_stochastic_rounding": False}),
    ("model.mxfp4", "activation"): ("underflow", "MXFP4", ("fprop", "wgrad"), {**MXFP4, "element": "e3m2"}),
    ("model.mxfp8", "activation"): ("underflow", "MXFP8", ("fprop", "wgrad"), {**MXFP8, "fp8_format": "E5M2"}),
    ("model.mxfp8_ocp", "activation"): (
        "block_saturation",
        "MXFP8 OCP",
        ("fprop", "wgrad"),
        {"name": "MXBlockScaling", "scale_rule": "nvidia"},  # rounded up (e4m3: the default element)
    ),
}


def test_planted_block_format_runs_are_repaired_in_their_format(repaired):
    """NVFP4, MXFP4, MXFP8 and OCP-rule MXFP8 layers with planted losses beside healthy twins: diagnose names each
    planted layer and tensor in its format, the remedy stays in a low-precision format, and the re-run under the
    written plan shows it worked (``tests/support/planted_formats.py``)."""
    diagnosis = diagnose(repaired / "run")
    found = {(f.layer, f.tensor): f for f in diagnosis.findings}
    assert {key: f.kind for key, f in found.items()} == {key: kind for key, (kind, *_) in EXPECTED.items()}  # twins: none
    assert found[("model.nvfp4", "gradient")].summary.persistent == pytest.approx(37.5)  # 6 of each block of 16
    assert found[("model.mxfp4", "activation")].summary.persistent == pytest.approx(50)
    assert found[("model.mxfp8_ocp", "activation")].summary.persistent == pytest.approx(100)
    for key, (_, fmt, gemms, spec) in EXPECTED.items():
        (remedy,) = found[key].remedies
        assert str(found[key].format) == fmt
        assert (remedy.feature, remedy.gemms) == ("precision_plan", gemms)
        assert all(dict(remedy.options)["recipes"][gemm] == spec for gemm in gemms)
    plan = yaml.safe_load((repaired / "merged.yaml").read_text())["precision_plan"]
    assert sorted(rule.get("name") for rule in plan["rules"][:4]) == sorted(
        f"diagnose: {layer}: {tensor}" for layer, tensor in EXPECTED
    )
    assert plan["rules"][4:] == FORMATS_PLAN["rules"]

    rules = {(r.layer, r.gemm): r.plan_rule for r in read_routing(repaired / "rerun") if r.tensor == "activation"}
    assert rules[("model.mxfp4", "fprop")] == "diagnose: model.mxfp4: activation"
    twin_rule = rules[("model.mxfp4_twin", "fprop")]  # the user's own rule, by its description
    assert twin_rule is not None and not twin_rule.startswith("diagnose: ")
    again = diagnose(repaired / "rerun")
    assert again.findings == []
    verdicts = {(entry.layer, entry.tensor): entry for entry in again.in_place}
    assert set(verdicts) == set(EXPECTED)
    for (layer, tensor), entry in verdicts.items():
        assert entry.verdict == "worked" and entry.feature == "precision_plan"
        assert entry.message.startswith(f"{layer} {tensor}: the precision plan rule diagnose wrote for it on ")
    # rounded stochastically, each of the 6 small values of a block of 16 is kept with odds 0.40 to 0.49: ~21% flush
    kept = float(re.search(r"underflows% at most ([\d.]+)", verdicts[("model.nvfp4", "gradient")].message).group(1))
    assert 16 < kept < 25.1
    assert "saturated_blocks% at most 0" in verdicts[("model.mxfp8_ocp", "activation")].message  # scales rounded up


@needs_browser
def test_the_pages_show_the_findings_the_plan_and_the_verdicts(repaired):
    """The report of the planted run names each finding's layer, format and the plan rule that repairs it; the
    re-run's lists each remedy as worked and maps the GEMMs it changed in their new formats."""
    html, errors = dom(write_report(repaired / "run", repaired / "run.html"))
    assert errors == []
    findings = re.search(r'<ol id="findings">(.*?)</ol>', html, re.S).group(1)
    titles = {"underflow": "underflow", "block_saturation": "blocks saturate"}
    for (layer, tensor), (kind, fmt, gemms, _) in EXPECTED.items():
        assert f'{layer}</a><span class="format"> ({fmt})</span> {tensor}: <b>{titles[kind]}</b>' in findings
        assert f"fix: precision_plan on {' and '.join(gemms)}: " in findings
    config = re.search(r'id="remedy-config".*?<pre>(.*?)</pre>', html, re.S).group(1)
    assert "precision_plan:" in config and "name: 'diagnose: model.nvfp4: gradient'" in config

    html, errors = dom(write_report(repaired / "rerun", repaired / "rerun.html"))
    assert errors == [] and '<ol id="findings"></ol>' in html.replace("\n", "")
    in_place = re.search(r'<div id="in-place"><h3>Remedies in place</h3><ul>(.*?)</ul>', html, re.S).group(1)
    assert in_place.count('class="in-place worked"') == len(EXPECTED)
    assert "model.nvfp4 gradient: the precision plan rule diagnose wrote for it on dgrad and wgrad" in in_place
