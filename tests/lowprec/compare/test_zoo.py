"""``compare --model lowprec.compare.zoo:llama`` and ``:moe``: small Hugging Face models from transformers configs
trained per recipe, and a precision plan resolved against a model of the user's own."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
import yaml

from lowprec.compare import compare_formats
from lowprec.compare.zoo import EXPERTS, llama, moe
from lowprec.demo import model_gemm_layers, run_demo
from lowprec.modules.convert import convert_with_report
from nvdlfw_inspect.reading import iter_statistics, read_routing

pytest.importorskip("transformers")

LAYERS = range(2)
ATTENTION = [f"model.lm.model.layers.{i}.self_attn.{p}_proj" for i in LAYERS for p in "qkvo"]
HEAD = "model.lm.lm_head"
LLAMA = ATTENTION + [f"model.lm.model.layers.{i}.mlp.{p}_proj" for i in LAYERS for p in ("gate", "up", "down")] + [HEAD]
ROUTERS = [f"model.lm.model.layers.{i}.mlp.gate" for i in LAYERS]
EXPERT_GEMMS = [
    f"model.lm.model.layers.{i}.mlp.experts.{proj}.gemm_{e}"
    for i in LAYERS
    for proj in ("gate_up_proj", "down_proj")
    for e in range(EXPERTS)
]
MOE = ATTENTION + ROUTERS + EXPERT_GEMMS + [HEAD]
STEPS = 4


def page_data(page: Path) -> dict:
    match = re.search(r'<script type="application/json" id="compare-data">(.*?)</script>', page.read_text(), re.S)
    return json.loads(match.group(1))


@pytest.mark.parametrize(
    ("factory", "modules", "gemms"),
    [(llama, 15, LLAMA), (moe, 13, MOE)],  # moe: 8 attention projections, 2 routers, 2 experts modules and the head
)
def test_convert_makes_every_linear_router_expert_and_the_head_a_lowprec_layer(factory, modules, gemms):
    torch.manual_seed(0)
    model, batch_fn = factory()
    report = convert_with_report(model)
    assert len(report.converted) == modules and report.skipped == []
    assert sorted(model_gemm_layers(report.model)) == sorted(gemms)
    batch = batch_fn(0)
    assert batch.shape == (8, 64) and batch.dtype == torch.long and int(batch.max()) < 256


@pytest.mark.parametrize(("name", "gemms"), [("llama", LLAMA), ("moe", MOE)])
def test_the_zoo_models_train_through_compare(tmp_path, name, gemms):
    """bf16 and MXFP8 from the same weights and batches: finite losses that fall, and each GEMM of the model (every
    expert's too) routed in MXFP8 in the MXFP8 run."""
    page = compare_formats(
        ["bf16", "mxfp8"], steps=STEPS, out=tmp_path, device="cpu", threads=1, model=f"lowprec.compare.zoo:{name}"
    )
    data = page_data(page)
    assert [run["name"] for run in data["runs"]] == ["bf16", "mxfp8"] and data["failed"] == []
    for run in data["runs"]:
        assert len(run["loss"]) == STEPS and all(math.isfinite(loss) for loss in run["loss"])
        assert run["loss"][-1] < run["loss"][0]
        assert abs(run["loss"][0] - math.log(256)) < 0.5  # random init: about uniform over the bytes
    assert abs(data["runs"][0]["loss"][0] - data["runs"][1]["loss"][0]) < 0.05  # same weights, same first batch
    routed: dict[tuple[str, str], set] = {}
    for record in read_routing(tmp_path / "mxfp8"):
        routed.setdefault((record.layer, record.gemm), set()).add((record.decision, record.format))
    assert routed == {(layer, gemm): {("fp8", "mxfp8")} for layer in gemms for gemm in ("fprop", "dgrad", "wgrad")}
    assert data["bottom_lines"][0]["name"] == "mxfp8" and "vs high precision (bf16)" in data["bottom_lines"][0]["text"]


PLAN = {
    "rules": [
        {"name": "head in high precision", "layers": {"layer_name_regex_pattern": "lm_head"}, "recipe": "bf16"},
        {
            "name": "the rest in NVFP4",
            "layers": {"layer_name_regex_pattern": ".*"},
            "recipe": {"name": "nvfp4", "disable_stochastic_rounding": True},
        },
    ]
}


def test_a_plan_is_resolved_against_the_users_model(tmp_path, capsys):
    """The head in high precision, every other GEMM of the Llama in NVFP4: the routing records say so per layer, the
    quantization statistics describe the NVFP4 layers only, and the page holds each layer's recipes and a bottom line."""
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump(PLAN))
    page = compare_formats(
        ["fp32"], steps=2, out=tmp_path / "out", device="cpu", threads=1, model="lowprec.compare.zoo:llama", plan=plan
    )
    data = page_data(page)
    fp32, planned = data["runs"]
    assert planned["name"] == "plan" and len(planned["loss"]) == 2 and all(math.isfinite(loss) for loss in planned["loss"])
    seen: dict[tuple[str, str], set] = {}
    for record in read_routing(tmp_path / "out" / "plan"):
        seen.setdefault((record.layer, record.gemm), set()).add((record.decision, record.format))
    assert seen == {
        (layer, gemm): {("high_precision", None)} if layer == HEAD else {("fp8", "nvfp4")}
        for layer in LLAMA
        for gemm in ("fprop", "dgrad", "wgrad")
    }
    assert {s.layer for s in iter_statistics(tmp_path / "out" / "plan") if s.stat == "underflows%"} == set(LLAMA) - {HEAD}
    assert sorted(planned["plan"]["layers"]) == sorted(LLAMA)
    assert set(planned["plan"]["layers"][HEAD].values()) == {"high_precision"}
    assert planned["plan"]["layers"][LLAMA[0]]["wgrad"] == "NVFP4BlockScaling(disable_stochastic_rounding=True)"
    assert [line["name"] for line in data["bottom_lines"]] == ["plan"]
    assert "vs high precision (fp32)" in data["bottom_lines"][0]["text"]
    assert "the model of 'lowprec.compare.zoo:llama'" in data["setup"]


def test_a_plan_that_quantizes_none_of_the_users_layers_is_refused_before_any_run(tmp_path):
    plan = {"rules": [{"layers": {"layer_name_regex_pattern": "gpt"}, "recipe": "nvfp4"}]}
    with pytest.raises(ValueError, match=r"quantizes no GEMM of the model of --model 'compare_model:make' under an autocast"):
        compare_formats(["fp32"], steps=1, out=tmp_path / "out", model="compare_model:make", plan=plan)
    assert not (tmp_path / "out").exists()


def test_run_demo_with_a_plan_and_a_factory_writes_statistics_of_the_users_layers(tmp_path):
    """Without a config, the plan's statistics config selects every layer (.*): fc1 (MXFP8) gets quantization
    statistics, fc2 (high precision) none."""
    from compare_model import make

    plan = {
        "rules": [
            {"layers": {"layer_name_regex_pattern": "fc2"}, "recipe": "bf16"},
            {"layers": {"layer_types": ["linear"]}, "recipe": "mxfp8"},
        ]
    }
    result = run_demo(steps=2, log_dir=tmp_path, device="cpu", threads=1, recipe=None, plan=plan, factory=make)
    config = yaml.safe_load((tmp_path / "plan_config.yaml").read_text())
    assert config["plan_tensor_statistics"]["layers"] == {"layer_name_regex_pattern": ".*"}
    assert {s.layer for s in iter_statistics(tmp_path) if s.stat == "underflows%"} == {"model.fc1"}
    assert {(r.layer, r.format) for r in read_routing(tmp_path)} == {("model.fc1", "mxfp8"), ("model.fc2", None)}
    assert len(result["losses"]) == 2
