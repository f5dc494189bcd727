"""Precision plans in lowprec's format: parsing, first-match resolution per GEMM, evaluation recipes, unused rules,
and every error naming its source, key path, value and what is allowed."""

from __future__ import annotations

import pytest

import nvdlfw_inspect.api as debug_api
from lowprec.errors import LowprecTypeError, LowprecValueError
from lowprec.plan import AS_TRAINING, FROM_AUTOCAST, GemmRecipes, PrecisionPlan, load_plan, named_recipe
from lowprec.recipe import (
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MXBlockScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
)
from nvdlfw_inspect.config_manager import ConfigManager
from nvdlfw_inspect.errors import ConfigError

PLAN = {
    "precision_plan": {
        "default": "current",
        "eval": "bf16",
        "rules": [
            {"name": "head", "layers": {"layer_name_regex_pattern": "lm_head$"}, "recipe": "high_precision"},
            {
                "layers": {"layer_name_regex_pattern": "attn"},
                "recipe": {"name": "MXFP8BlockScaling", "enable_2d_quantization": True},
            },
            {"layers": {"layer_numbers": [3]}, "fprop": "mxfp8", "dgrad": "nvfp4", "wgrad": "current", "eval": "mxfp8"},
            {"layers": {"layer_numbers": ["5-6"]}, "dgrad": {"name": "block", "fp8_format": "hybrid"}},
            {"layers": {"exact_layer_names": ["model.layers.0.mlp.experts.gate_up_proj.gemm_3"]}, "recipe": "nvfp4"},
            {"layers": {"layer_numbers": [0]}, "recipe": {"name": "mxfp4", "gradient_element": "e5m2"}},
        ],
    }
}


@pytest.fixture(scope="module")
def plan() -> PrecisionPlan:
    return load_plan(PLAN)


def test_first_matching_rule_wins(plan):
    head = plan.resolve("model.lm_head")
    assert head.training == GemmRecipes(None, None, None) and head.rule == 0 and head.rule_name == "head"
    attn = plan.resolve("model.layers.3.attn.qkv")  # rule 1 and rule 2 select it: the first wins
    assert attn.rule == 1
    assert attn.training.fprop == MXFP8BlockScaling(enable_2d_quantization=True) == attn.training.wgrad


def test_per_gemm_recipes_and_the_default_for_the_rest(plan):
    fc = plan.resolve("model.layers.3.mlp.fc1")
    assert fc.rule == 2
    assert fc.training == GemmRecipes(MXFP8BlockScaling(), NVFP4BlockScaling(), Float8CurrentScaling())
    assert fc.eval == MXFP8BlockScaling()  # the rule's own eval wins over the plan's
    six = plan.resolve("model.layers.6.mlp.fc2")  # layer range 5-6, only dgrad given: the others take the default
    assert six.training == GemmRecipes(
        Float8CurrentScaling(), Float8BlockScaling(fp8_format=Format.HYBRID), Float8CurrentScaling()
    )
    assert six.eval is None  # the plan's eval: bf16 = high precision


def test_expert_gemms_and_layer_numbers(plan):
    expert = plan.resolve("model.layers.0.mlp.experts.gate_up_proj.gemm_3")
    assert expert.rule == 4 and expert.training == GemmRecipes.every(NVFP4BlockScaling())
    other = plan.resolve("model.layers.0.mlp.experts.gate_up_proj.gemm_2")  # layer number 0 from the name
    assert other.rule == 5 and other.training.fprop == MXBlockScaling("e2m1", gradient_element="e5m2")


def test_no_rule_default_and_autocast(plan):
    free = plan.resolve("model.layers.9.mlp.fc1")
    assert free.rule is None and free.rule_name is None
    assert free.training == GemmRecipes.every(Float8CurrentScaling()) and free.eval is None
    bare = load_plan({"precision_plan": {"rules": []}}).resolve("x")
    assert bare.training == GemmRecipes.every(FROM_AUTOCAST) and bare.eval is FROM_AUTOCAST
    assert bare.gemm_recipes(True, MXFP8BlockScaling()) == GemmRecipes.every(MXFP8BlockScaling())
    assert bare.gemm_recipes(False, None) == GemmRecipes.every(None)


def test_gemm_recipes_training_and_eval(plan):
    fc = plan.resolve("model.layers.3.mlp.fc1")
    assert fc.gemm_recipes(True, None).dgrad == NVFP4BlockScaling()  # ours replace the autocast's, quantized or not
    assert fc.gemm_recipes(False, Float8CurrentScaling()) == GemmRecipes.every(MXFP8BlockScaling())


def test_plan_body_alone_types_and_a_plan_object(plan):
    body = load_plan({"rules": [{"layers": {"layer_types": ["qkv"]}, "recipe": "nvfp4"}]})
    assert body.resolve("a.b", layer_types=("qkv",)).rule == 0 and body.resolve("a.b").rule is None
    assert body.eval is AS_TRAINING and body.resolve("a.b", ("qkv",)).eval == NVFP4BlockScaling()
    assert load_plan(plan) is plan


def test_debug_config_file_with_a_plan_key(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(
        "section:\n  enabled: true\n  layers: {layer_types: [fc1]}\n"
        "  LogTensorStats: {enabled: true, stats: [max], tensors: [activation]}\n"
        "precision_plan:\n  rules:\n    - layers: {layer_name_regex_pattern: fc1}\n      recipe: {name: nvfp4, seed: 7}\n"
    )
    plan = load_plan(path)
    assert plan.resolve("m.fc1").training.fprop == NVFP4BlockScaling(seed=7)
    assert "precision plan file" in plan.source
    debug_api.initialize(str(path), log_dir=str(tmp_path / "logs"))  # one file for a run: the debug framework skips the plan
    try:
        (warning,) = ConfigManager.warnings
        assert "key 'precision_plan' is no debug section but lowprec's precision plan" in warning and str(path) in warning
        assert list(ConfigManager.configs) == ["section"]
    finally:
        debug_api.end_debug()


def test_unused_rules_with_closest_names(plan):
    names = ["model.lm_head", "model.layers.3.attn.qkv", "model.layers.9.mlp.fc1"]
    unused = {u.index: u for u in plan.unused_rules(names)}
    assert sorted(unused) == [2, 3, 4, 5]
    assert unused[2].shadowed_by == (1,) and unused[3].shadowed_by == ()  # layer 3 here is attn, taken by rule 1
    exact = load_plan({"rules": [{"layers": {"exact_layer_names": ["model.layers.9.mlp.fc"]}, "recipe": "mxfp8"}]})
    (one,) = exact.unused_rules(names)
    assert one.closest[0] == "model.layers.9.mlp.fc1" and "selects no layer; closest layer names" in str(one)
    shadow = load_plan(
        {
            "rules": [
                {"layers": {"layer_name_regex_pattern": "fc"}, "recipe": "mxfp8"},
                {"layers": {"layer_numbers": [9]}, "recipe": "nvfp4"},
            ]
        }
    )
    (two,) = shadow.unused_rules(["m.layers.9.fc1"])
    assert two.shadowed_by == (0,) and "taken by earlier rule #0" in str(two)


def test_named_recipe_shared_with_compare():
    from lowprec.compare import RECIPES

    assert RECIPES["nvfp4"].make(5) == named_recipe("nvfp4", seed=5)
    assert named_recipe("mxfp8_ocp") == MXBlockScaling("e4m3", scale_rule="ocp")
    with pytest.raises(LowprecValueError, match="unknown recipe 'mxfp9'; known: high_precision"):
        named_recipe("mxfp9")
    with pytest.raises(LowprecValueError, match="MXFP8BlockScaling has no option 'seed'; its options: margin"):
        named_recipe("mxfp8", seed=1)


def test_describe_names_a_recipe_by_its_class_and_changed_options():
    from lowprec.plan.recipes import describe

    assert describe(None) == "high_precision"
    assert describe(MXFP8BlockScaling()) == "MXFP8BlockScaling()"
    assert describe(Float8CurrentScaling(fp8_format=Format.E4M3)) == "Float8CurrentScaling(fp8_format=Format.E4M3)"
    assert describe(NVFP4BlockScaling(seed=3)) == "NVFP4BlockScaling(seed=3)"


def _error(body, source="precision plan dict"):
    with pytest.raises(ConfigError) as info:
        load_plan({"precision_plan": body})
    message = str(info.value)
    assert message.startswith(f"{source}: ") or message.startswith("2 errors") or "errors in the config" in message
    return message


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (
            {"rules": [{"layers": {"layer_numbers": 1}, "recipe": "mxfp9"}]},
            ["key 'precision_plan.rules.0.recipe': unknown recipe", "got 'mxfp9'", "did you mean 'mxfp8'?", "NVFP4BlockScaling"],
        ),
        (
            {
                "rules": [
                    {"layers": {"layer_numbers": 1}, "recipe": {"name": "MXFP8BlockScaling", "enable_2d_quantisation": True}}
                ]
            },
            [
                "key 'precision_plan.rules.0.recipe.enable_2d_quantisation': unknown option of MXFP8BlockScaling",
                "did you mean 'enable_2d_quantization'?",
            ],
        ),
        (
            {"rules": [{"layers": {"layer_numbers": 1}, "recipe": {"fp8_format": "E4M3"}}]},
            ["key 'precision_plan.rules.0.recipe': a recipe mapping needs a 'name'"],
        ),
        (
            {"rules": [{"layers": {"layer_numbers": 1}, "recipe": {"name": "current", "fp8_format": "E3M4"}}]},
            ["recipe.fp8_format': unknown format", "allowed: 'E4M3', 'E5M2', 'HYBRID', 'E2M1'"],
        ),
        (
            {"rules": [{"layers": {"layer_numbers": 1}, "recipe": {"name": "block", "x_block_scaling_dim": 2}}]},
            ["Float8BlockScaling refuses these options", "cannot take two 2-D block-scaled operands"],
        ),
        (
            {"rules": [{"layers": {"layer_numbers": 1}, "recipe": {"name": "bf16", "margin": 1}}]},
            ["'bf16' (no cast) takes no options"],
        ),
        (
            {"rules": [{"layers": {"layer_number": 1}, "recipe": "mxfp8"}]},
            ["key 'precision_plan.rules.0.layers.layer_number': unknown layer selector", "did you mean 'layer_numbers'?"],
        ),
        (
            {"rules": [{"layers": {"layer_name_regex_pattern": "(a"}, "recipe": "mxfp8"}]},
            ["layer_name_regex_pattern': invalid regular expression"],
        ),
        (
            {"rules": [{"layers": {"layer_numbers": 1}, "recipe": "mxfp8", "dgrad": "nvfp4"}]},
            ["key 'precision_plan.rules.0': give either 'recipe' (every GEMM) or per-GEMM keys (fprop, dgrad, wgrad), not both"],
        ),
        (
            {"rules": [{"layers": {"layer_numbers": 1}}]},
            ["key 'precision_plan.rules.0': a rule needs a recipe", "allowed: 'recipe', 'fprop'"],
        ),
        ({"rules": [{"recipe": "mxfp8"}]}, ["missing required key 'layers'"]),
        (
            {"rules": [{"layers": {"layer_numbers": 1}, "fprp": "mxfp8", "fprop": "mxfp8"}]},
            ["key 'precision_plan.rules.0.fprp': unknown rule key", "did you mean 'fprop'?"],
        ),
        ({"rule": []}, ["key 'precision_plan.rule': unknown precision plan key", "did you mean 'rules'?"]),
        ({"rules": {"a": 1}}, ["key 'precision_plan.rules': must be a list of rules"]),
        ({"rules": ["mxfp8"]}, ["key 'precision_plan.rules.0': a rule must be a mapping"]),
        ({"default": 3}, ["key 'precision_plan.default': must be a recipe name or a mapping"]),
        ({"eval": "nvfp5"}, ["key 'precision_plan.eval': unknown recipe", "did you mean 'nvfp4'?"]),
        ("mxfp8", ["key 'precision_plan': a precision plan must be a mapping"]),
    ],
)
def test_errors(body, expected):
    message = _error(body)
    for part in expected:
        assert part in message, message


def test_several_errors_in_one_pass():
    message = _error(
        {"default": "x", "rules": [{"layers": {"layer_numbers": 1}, "recipe": "y"}, {"layers": {"layer_numbers": 1}}]}
    )
    assert message.startswith("3 errors in the config")
    assert (
        "precision_plan.default" in message and "precision_plan.rules.0.recipe" in message and "precision_plan.rules.1" in message
    )


def test_file_errors_name_the_file(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text("precision_plan:\n  rules:\n    - layers: {layer_numbers: [1]}\n      recipe: mxfp9\n")
    with pytest.raises(
        ConfigError, match=r"precision plan file '.*plan.yaml': key 'precision_plan.rules.0.recipe': unknown recipe"
    ):
        load_plan(path)
    path.write_text("section:\n  enabled: true\n")
    with pytest.raises(ConfigError, match="holds no precision plan: expected a 'precision_plan' key"):
        load_plan(path)
    with pytest.raises(FileNotFoundError):
        load_plan(tmp_path / "absent.yaml")
    with pytest.raises(LowprecTypeError, match="got int"):
        load_plan(3)


def test_ignored_selector_is_warned():
    with pytest.warns(UserWarning, match="layer_numbers ignored"):
        load_plan({"rules": [{"layers": {"layer_name_regex_pattern": "fc", "layer_numbers": [1]}, "recipe": "mxfp8"}]})
