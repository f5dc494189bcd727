"""Megatron-LM's precision file read as Megatron reads it: its documented example gives each layer the recipe its
matchers say, its override flags and evaluation recipes hold, and its mistakes are errors with key paths."""

from __future__ import annotations

from pathlib import Path

import pytest

from lowprec.plan import GemmRecipes, load_plan
from lowprec.recipe import Float8BlockScaling, Float8CurrentScaling, Format, MXFP8BlockScaling, NVFP4BlockScaling
from nvdlfw_inspect.errors import ConfigError

EXAMPLE = Path(__file__).with_name("megatron_example.yaml")


def test_the_documented_example():
    plan = load_plan(EXAMPLE)
    assert plan.dialect == "megatron" and len(plan.rules) == 4
    qkv = plan.resolve("decoder.layers.0.self_attention.linear_qkv")
    assert qkv.rule == 0 and "attn_qkv_bf16" in qkv.rule_name and qkv.training == GemmRecipes.every(None)
    assert plan.resolve("decoder.layers.1.self_attention.linear_proj").rule == 1
    out = plan.resolve("decoder.layers.2.mixer.out_proj")
    assert out.rule == 2 and out.training == GemmRecipes.every(MXFP8BlockScaling())
    assert out.eval == MXFP8BlockScaling()  # no evaluation_recipe: the training one
    assert plan.resolve("decoder.layers.2.mixer.in_proj").rule == 3
    mlp = plan.resolve("decoder.layers.2.mlp.linear_fc1")
    assert mlp.rule is None
    assert mlp.gemm_recipes(True, Float8CurrentScaling()) == GemmRecipes.every(Float8CurrentScaling())
    assert plan.resolve("decoder.layers.0.self_attention.linear_qkv_x").rule is None  # glob anchored at both ends


def test_override_flags_follow_megatron():
    plan = load_plan(EXAMPLE)
    qkv = plan.resolve("decoder.layers.0.self_attention.linear_qkv")
    # override_quantized_autocast (default true): bf16 replaces a quantizing autocast's recipe
    assert qkv.gemm_recipes(True, MXFP8BlockScaling()) == GemmRecipes.every(None)
    out = plan.resolve("m.mixer.out_proj")
    # override_nonquantized_autocast (default false): with no quantizing autocast the layer stays high precision
    assert out.gemm_recipes(True, None) == GemmRecipes.every(None)
    forced = load_plan(
        {
            "configs": {
                "c": {
                    "transformer_engine_config_type": "TEQuantizationParams",
                    "training_recipe": {
                        "fp8_quantization_recipe": "tensorwise",
                        "fp8_format": "hybrid",
                        "override_nonquantized_autocast": True,
                    },
                }
            },
            "matchers": {"m": {"config": "c", "type": "glob", "pattern": "*", "enabled": True}},
        }
    )
    assert forced.resolve("x").gemm_recipes(True, None) == GemmRecipes.every(Float8CurrentScaling(fp8_format=Format.HYBRID))


def test_evaluation_recipes():
    configs = {
        "mx_eval_bf16": {
            "transformer_engine_config_type": "TEQuantizationParams",
            "training_recipe": {"fp8_quantization_recipe": "mxfp8"},
            "evaluation_recipe": {},
        },
        "nv_eval_bf16": {
            "transformer_engine_config_type": "TEQuantizationParams",
            "training_recipe": {"fp4_quantization_recipe": "nvfp4"},
            "evaluation_recipe": {},
        },
        "block": {
            "transformer_engine_config_type": "TEQuantizationParams",
            "training_recipe": {"fp8_quantization_recipe": "blockwise"},
        },
    }
    matchers = {
        "off": {"config": "block", "type": "glob", "pattern": "*fc1"},  # no enabled: true, skipped as in Megatron
        "a": {"config": "mx_eval_bf16", "type": "glob", "pattern": "*fc1", "enabled": True},
        "b": {"config": "nv_eval_bf16", "type": "glob", "pattern": "*fc2", "enabled": True},
        "c": {"config": "block", "type": "glob", "pattern": "*", "enabled": True},
    }
    plan = load_plan({"configs": configs, "matchers": matchers})
    fc1, fc2, other = (plan.resolve(f"layers.1.mlp.{n}") for n in ("fc1", "fc2", "proj"))
    assert fc1.training.fprop == MXFP8BlockScaling() and fc1.eval is None
    assert fc1.gemm_recipes(False, MXFP8BlockScaling()) == GemmRecipes.every(None)
    assert fc2.training.wgrad == NVFP4BlockScaling() and fc2.eval is None
    assert other.training.dgrad == Float8BlockScaling() and other.eval == Float8BlockScaling()
    names = ["layers.1.mlp.fc1", "layers.1.mlp.fc2"]
    assert [u.index for u in plan.unused_rules(names)] == [2]


def _config(recipe=None, **extra):
    return {"transformer_engine_config_type": "TEQuantizationParams", "training_recipe": recipe or {}, **extra}


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (
            {"configs": {"c": _config({"fp8_quantization_recipe": "delayed"})}},
            [
                "key 'configs.c.training_recipe.fp8_quantization_recipe': delayed scaling is not in scope",
                "allowed: 'tensorwise', 'blockwise', 'mxfp8'",
            ],
        ),
        (
            {"configs": {"c": _config({"fp8_quantization_recipe": "custom", "custom_recipe_factory": "x.y"})}},
            ["custom recipe factory (Python code) is not supported"],
        ),
        (
            {"configs": {"c": _config({"fp8_quantization_recipe": "mxfp9"})}},
            ["unknown fp8_quantization_recipe", "did you mean 'mxfp8'?"],
        ),
        (
            {"configs": {"c": _config({"fp4_quantization_recipe": "mxfp4"})}},
            ["key 'configs.c.training_recipe.fp4_quantization_recipe': unknown fp4_quantization_recipe", "allowed: 'nvfp4'"],
        ),
        (
            {"configs": {"c": _config({"fp8_quantization_recipe": "mxfp8", "fp4_quantization_recipe": "nvfp4"})}},
            ["mutually exclusive"],
        ),
        (
            {"configs": {"c": _config({"fp8_quantization_recipe": "mxfp8", "fp8_format": "e5m2"})}},
            ["key 'configs.c.training_recipe.fp8_format': unsupported fp8_format", "allowed: 'e4m3', 'hybrid'"],
        ),
        (
            {"configs": {"c": _config({"fp8_recipe": "mxfp8"})}},
            ["key 'configs.c.training_recipe.fp8_recipe': unknown key of a TEQuantizationRecipe"],
        ),
        (
            {"configs": {"c": _config({"override_quantized_autocast": "yes"})}},
            ["override_quantized_autocast': must be a boolean"],
        ),
        ({"configs": {"c": {"training_recipe": {}}}}, ["key 'configs.c': missing required key 'transformer_engine_config_type'"]),
        (
            {"configs": {"c": _config(transformer_engine_config_type="Other")}},
            ["key 'configs.c.transformer_engine_config_type': unsupported config type", "'TEQuantizationParams'"],
        ),
        (
            {"configs": {"c": {"transformer_engine_config_type": "TEQuantizationParams"}}},
            ["missing required key 'training_recipe'"],
        ),
        (
            {"configs": {"c": _config(eval_recipe={})}},
            ["key 'configs.c.eval_recipe': unknown key", "did you mean 'evaluation_recipe'?"],
        ),
        (
            {"configs": {"c": _config()}, "matchers": {"m": {"config": "d", "type": "glob", "pattern": "*", "enabled": True}}},
            ["key 'matchers.m.config': names no config", "got 'd'", "allowed: 'c'"],
        ),
        (
            {"configs": {"c": _config()}, "matchers": {"m": {"config": "c", "type": "regex", "pattern": "*", "enabled": True}}},
            ["key 'matchers.m.type': unsupported matcher type", "allowed: 'glob'"],
        ),
        (
            {"configs": {"c": _config()}, "matchers": {"m": {"config": "c", "type": "glob", "enabled": True}}},
            ["key 'matchers.m': missing required key 'pattern'"],
        ),
        (
            {"configs": {"c": _config()}, "matchers": {"m": {"config": "c", "type": "glob", "pattern": "*", "enabled": "true"}}},
            ["key 'matchers.m.enabled': must be a boolean"],
        ),
        ({"configs": ["c"]}, ["key 'configs': must be a mapping"]),
    ],
)
def test_errors(raw, expected):
    with pytest.raises(ConfigError) as info:
        load_plan(raw)
    message = str(info.value)
    assert message.startswith("precision plan dict: ")
    for part in expected:
        assert part in message, message


def test_what_lowprec_cannot_do_is_warned():
    with pytest.warns(UserWarning, match="key 'configs.c.training_recipe.fp8_param': lowprec has no counterpart; ignored"):
        load_plan({"configs": {"c": _config({"fp8_quantization_recipe": "mxfp8", "fp8_param": True})}})
    with pytest.warns(UserWarning, match="key 'matchers.m': comment not read"):
        load_plan({"configs": {"c": _config()}, "matchers": {"m": {"config": "c", "type": "glob", "pattern": "*", "comment": 1}}})
    with pytest.warns(UserWarning, match="key 'extra' is not read"):
        load_plan({"configs": {}, "extra": 1})


def test_the_documented_example_trains_a_model_as_its_matchers_say(tmp_path):
    """Layers named as Megatron names its modules, trained under the file as it is: each GEMM's routing record names
    the format the matcher gave the layer (the attention projections in BF16, the Mamba projections MXFP8, the
    rest the autocast's recipe); with no quantizing autocast the MXFP8 matchers do not apply (Megatron's default)."""
    import torch

    import lowprec
    import nvdlfw_inspect.api as debug_api
    from nvdlfw_inspect.reading import read_routing

    names = ["decoder.layers.0.self_attention.linear_qkv", "decoder.layers.0.mixer.out_proj", "decoder.layers.0.mlp.linear_fc1"]
    features = {"LogTensorStats": {"enabled": True, "tensors": ["output"], "stats": ["max"]}}
    config = {"sec": {"enabled": True, "layers": {"layer_name_regex_pattern": ".*"}, "transformer_engine": features}}
    debug_api.initialize(config_file=config, feature_dirs=[lowprec.FEATURE_DIR], log_dir=tmp_path)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(lowprec.Linear(64, 64, name=name) for name in names))
    with lowprec.autocast(recipe=Float8CurrentScaling(), plan=EXAMPLE):
        model(torch.randn(32, 64)).sum().backward()
    debug_api.step()
    with lowprec.autocast(enabled=False, plan=EXAMPLE):
        model(torch.randn(32, 64)).sum().backward()
    debug_api.end_debug()
    formats: dict[tuple[str, int], set] = {}
    for record in read_routing(tmp_path):
        formats.setdefault((record.layer, record.iteration), set()).add(record.format)
    assert formats[(names[0], 0)] == {None}
    assert formats[(names[1], 0)] == {"mxfp8"}
    assert formats[(names[2], 0)] == {"fp8_current_scaling"}
    assert formats[(names[1], 1)] == {None} and formats[(names[2], 1)] == {None}  # no quantizing autocast
