"""Config loading and layer selection, driven through ``debug_api.initialize`` where it matters."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from inspect_ns_factory import write_namespace
from logreader import read_messages, read_stats

import nvdlfw_inspect.api as debug_api
from nvdlfw_inspect.config_manager import ConfigManager, LayerSpec, extract_layer_number, find_config_errors
from nvdlfw_inspect.errors import ConfigError, ConfigLocation, NvdlfwInspectError

LTS = {"enabled": True, "tensors": ["activation"], "stats": ["mean"]}


def section(layers, **features):
    return {"enabled": True, "layers": layers, **features}


def lts(**overrides):
    return {**copy.deepcopy(LTS), **overrides}


@pytest.fixture(scope="module")
def custom_ns(tmp_path_factory):
    """A namespace with features FeatA and FeatB (free-form configs) in its own feature dir."""
    return write_namespace(tmp_path_factory.mktemp("custom_ns"))


def init(config, log_dir, feature_dirs=None):
    debug_api.initialize(config_file=config, feature_dirs=feature_dirs, log_dir=log_dir)


def init_error(config, log_dir, feature_dirs=None, error=ConfigError):
    """Initialize, expect ``error``, and check the failure left no half-initialized state behind."""
    with pytest.raises(error) as info:
        init(config, log_dir, feature_dirs)
    assert type(info.value) is error
    assert debug_api.DEBUG_MANAGER is None
    assert ConfigManager.configs == {}
    return str(info.value)


def layer(name):
    return ConfigManager.get_config_for_layer(name)


# --------------------------------------------------------------------------------------------
# input forms
# --------------------------------------------------------------------------------------------

YAML_TWO_SECTIONS = """
first:
  enabled: true
  layers:
    layer_numbers: [1, "3-4"]
  LogTensorStats:
    enabled: true
    tensors: [activation]
    stats: [mean, max]
second:
  enabled: True
  layers:
    layer_numbers: 2
  base:
    LogTensorStats:
      enabled: true
      tensors_struct:
        - tensor: gradient
          stats: [std]
          freq: 2
"""


@pytest.mark.parametrize("as_type", [str, Path])
def test_yaml_file_as_str_or_path(tmp_path, log_dir, as_type):
    path = tmp_path / "config.yaml"
    path.write_text(YAML_TWO_SECTIONS)
    init(as_type(path), log_dir)

    assert layer("decoder.1.mlp.fc1") == {"base": {"LogTensorStats": lts(stats=["mean", "max"])}}
    assert layer("decoder.4.self_attention")["base"]["LogTensorStats"]["stats"] == ["mean", "max"]
    assert layer("decoder.2.mlp.fc2") == {
        "base": {"LogTensorStats": {"enabled": True, "tensors_struct": [{"tensor": "gradient", "stats": ["std"], "freq": 2}]}}
    }
    assert layer("decoder.5.mlp.fc1") == {}
    assert ConfigManager.section_names == ["first", "second"]
    assert str(path) in ConfigManager.source
    messages = [m for _, m in read_messages(log_dir)]
    assert f"Reading config from {path}." in messages
    assert any("first" in m and "second" in m and m.startswith("Loaded configs for") for m in messages)


def test_dict_config_is_copied(log_dir):
    config = {"s": section({"layer_numbers": [1]}, LogTensorStats=lts())}
    init(config, log_dir)
    config["s"]["LogTensorStats"]["stats"].append("bogus")
    config["s"]["layers"]["layer_numbers"] = [7]
    assert layer("model.1.fc2")["base"]["LogTensorStats"]["stats"] == ["mean"]
    assert layer("model.7.fc2") == {}
    assert ("INFO", "Reading config from Python dictionary.") in read_messages(log_dir)


def test_top_level_base_feature_equals_explicit_base_namespace(log_dir):
    init({"s": section({"layer_numbers": "all"}, LogTensorStats=lts())}, log_dir)
    top_level = layer("model.3.fc1")
    debug_api.end_debug()
    init({"s": section({"layer_numbers": "all"}, base={"LogTensorStats": lts()})}, log_dir)
    assert layer("model.3.fc1") == top_level == {"base": {"LogTensorStats": LTS}}


def test_base_feature_and_custom_namespace_in_one_section_both_kept(log_dir, custom_ns):
    config = {
        "s": section(
            {"layer_types": ["fc1"]},
            LogTensorStats=lts(),
            **{custom_ns.name: {"FeatA": {"enabled": True, "value": 1}, "FeatB": {"enabled": False}}},
        )
    }
    init(config, log_dir, [custom_ns.directory])
    assert layer("decoder.0.mlp.fc1") == {
        "base": {"LogTensorStats": LTS},
        custom_ns.name: {"FeatA": {"enabled": True, "value": 1}, "FeatB": {"enabled": False}},
    }
    assert layer("decoder.0.mlp.fc2") == {}


def test_no_config_means_no_feature(log_dir):
    debug_api.initialize(log_dir=log_dir)
    assert ConfigManager.configs == {}
    assert layer("model.1.fc1") == {}


def test_config_of_wrong_type(log_dir):
    message = init_error(42, log_dir, error=TypeError)
    assert "int" in message and "dict" in message and "Path" in message


# --------------------------------------------------------------------------------------------
# several sections
# --------------------------------------------------------------------------------------------


def test_sections_with_disjoint_layers(log_dir):
    config = {
        "one": section({"layer_numbers": [1]}, LogTensorStats=lts(stats=["min"])),
        "two": section({"layer_numbers": [2]}, LogTensorStats=lts(stats=["max"])),
    }
    init(config, log_dir)
    assert layer("model.1.fc1")["base"]["LogTensorStats"]["stats"] == ["min"]
    assert layer("model.2.fc1")["base"]["LogTensorStats"]["stats"] == ["max"]
    assert layer("model.3.fc1") == {}


def test_sections_with_different_features_on_one_layer_are_merged(log_dir, custom_ns):
    config = {
        "numbers": section({"layer_numbers": [1, 2]}, LogTensorStats=lts()),
        "types": section({"layer_types": ["fc1"]}, **{custom_ns.name: {"FeatA": {"enabled": True, "value": "a"}}}),
        "names": section({"exact_layer_names": ["model.1.fc1"]}, **{custom_ns.name: {"FeatB": {"enabled": True}}}),
    }
    init(config, log_dir, [custom_ns.directory])
    assert layer("model.1.fc1") == {
        "base": {"LogTensorStats": LTS},
        custom_ns.name: {"FeatA": {"enabled": True, "value": "a"}, "FeatB": {"enabled": True}},
    }
    assert layer("model.2.fc2") == {"base": {"LogTensorStats": LTS}}
    assert layer("model.3.fc1") == {custom_ns.name: {"FeatA": {"enabled": True, "value": "a"}}}
    # routing sees the merged result: FeatA alone on layer 3, both features (one API) on layer 1
    probe = getattr(debug_api, custom_ns.name).probe
    assert probe("model.3.fc1") == ("FeatA", "model.3.fc1", "a")
    with pytest.raises(ValueError, match=r"\['FeatA', 'FeatB'\]"):
        probe("model.1.fc1")


@pytest.mark.parametrize(
    ("layers_one", "layers_two", "expected", "shared_layer"),
    [
        ({"layer_numbers": [1, 2]}, {"layer_numbers": [1, 2]}, "the same layers", "model.1.fc1"),
        ({"layer_name_regex_pattern": "fc"}, {"layer_name_regex_pattern": "fc"}, "the same layers", "model.fc1"),
        ({"exact_layer_names": ["a.1", "b.2"]}, {"exact_layer_names": ["b.2", "c.3"]}, "layer 'b.2'", "b.2"),
    ],
)
def test_same_feature_for_overlapping_sections_warns_at_initialize_and_fails_at_lookup(
    log_dir, layers_one, layers_two, expected, shared_layer
):
    """As in the reference, the config loads; the overlap certain by construction is said, and the layer both select
    fails when it routes."""
    config = {
        "sec_one": section(layers_one, LogTensorStats=lts()),
        "sec_two": section(layers_two, base={"LogTensorStats": lts(stats=["max"])}),
    }
    with pytest.warns(UserWarning, match=f"'sec_one' and 'sec_two' both configure \\['base.LogTensorStats'\\] for {expected}"):
        init(config, log_dir)
    with pytest.raises(ConfigError, match=f"both configure base.LogTensorStats for layer '{shared_layer}'"):
        layer(shared_layer)


def test_same_feature_in_disjoint_exact_names_is_fine(log_dir):
    config = {
        "one": section({"exact_layer_names": ["a.1"]}, LogTensorStats=lts(stats=["min"])),
        "two": section({"exact_layer_names": ["b.2"]}, LogTensorStats=lts(stats=["max"])),
    }
    init(config, log_dir)
    assert layer("a.1")["base"]["LogTensorStats"]["stats"] == ["min"]
    assert layer("b.2")["base"]["LogTensorStats"]["stats"] == ["max"]


def test_same_feature_overlapping_only_at_runtime_fails_at_lookup(log_dir):
    config = {
        "by_number": section({"layer_numbers": [1]}, LogTensorStats=lts(stats=["min"])),
        "by_type": section({"layer_types": ["fc2"]}, LogTensorStats=lts(stats=["max"])),
    }
    init(config, log_dir)
    assert layer("model.1.fc1")["base"]["LogTensorStats"]["stats"] == ["min"]
    assert layer("model.2.fc2")["base"]["LogTensorStats"]["stats"] == ["max"]
    for _ in range(2):  # the error is not cached away
        with pytest.raises(ConfigError) as info:
            layer("model.1.fc2")
        message = str(info.value)
        assert "'by_number'" in message and "'by_type'" in message
        assert "base.LogTensorStats" in message and "'model.1.fc2'" in message
    # the router surfaces the same error for that layer and keeps working for the others
    with pytest.raises(ConfigError, match="by_number"):
        debug_api.log_tensor_stats("model.1.fc2", tensor=torch.ones(2), tensor_name="activation")


def test_merged_sections_log_the_right_statistics(log_dir):
    config = {
        "one": section({"layer_numbers": [1]}, LogTensorStats=lts(stats=["min"])),
        "two": section({"layer_numbers": [2]}, LogTensorStats=lts(stats=["max"])),
    }
    init(config, log_dir)
    tensor = torch.tensor([1.0, 2.0, 6.0])
    for name in ("model.1.fc1", "model.2.fc1", "model.3.fc1"):
        debug_api.log_tensor_stats(name, tensor=tensor, tensor_name="activation", iteration=0)
    debug_api.step()
    assert read_stats(log_dir) == {
        ("model.1.fc1_activation_min", 0): 1.0,
        ("model.2.fc1_activation_max", 0): 6.0,
    }


# --------------------------------------------------------------------------------------------
# layer selectors
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "number"),
    [
        ("decoder.1.mlp.fc1", 1),
        ("Layer_3", 3),
        ("model.0.layers.12.fc2", 12),
        ("model.embedding", None),
        ("", None),
        ("fc1", None),
        ("model.fc12", None),
        ("block3.fc1", 3),
        ("layer_10_fc2", 10),
        ("a1.b2", None),  # two candidate numbers and no numeric part: ambiguous
        ("model.layers.7", 7),
        ("model.layers.²", None),  # not an ASCII number: no crash
    ],
)
def test_extract_layer_number(name, number):
    assert extract_layer_number(name) == number


def spec(layers) -> LayerSpec:
    return LayerSpec(layers, ConfigLocation("test").child("sec").child("layers"))


@pytest.mark.parametrize(
    ("layers", "selected", "not_selected"),
    [
        ({"layer_numbers": [1, 3]}, ["model.1.fc1", "model.3.attn", "Layer_3"], ["model.2.fc1", "model.13.fc1", "model.x"]),
        ({"layer_numbers": ["2-4"]}, ["m.2.x", "m.3.x", "m.4.x"], ["m.1.x", "m.5.x"]),
        ({"layer_numbers": " 2 - 3 "}, ["m.2.x", "m.3.x"], ["m.4.x"]),
        ({"layer_numbers": ["5", 7]}, ["m.5.x", "m.7.x"], ["m.6.x"]),
        ({"layer_numbers": 5}, ["m.5.x"], ["m.4.x", "m.50.x"]),
        ({"layer_numbers": 0}, ["m.0.x"], ["m.1.x"]),
        ({"layer_numbers": "all"}, ["m.5.x", "model.embedding", "fc1"], []),
        ({"layer_numbers": "ALL"}, ["m.5.x"], []),
        ({"layer_numbers": [1, "all"]}, ["m.5.x", "model.embedding"], []),
        ({"layer_types": ["fc1", "qkv"]}, ["m.1.fc1", "m.2.layernorm_qkv"], ["m.1.fc2", "m.1.proj"]),
        ({"layer_types": "fc1"}, ["m.1.fc1"], ["m.1.fc2", "m.1.c", "m.f"]),  # one type, not per character
        ({"layer_types": ["a.c"]}, ["x.a.c"], ["x.abc"]),  # types are literal, not regexes
        ({"layer_types": ["all"]}, ["anything"], []),
        ({"layer_types": "all"}, ["anything"], []),
        ({"layer_numbers": [1, 2], "layer_types": ["fc1"]}, ["m.1.fc1", "m.2.fc1"], ["m.1.fc2", "m.3.fc1"]),
        ({"layer_numbers": "all", "layer_types": ["fc2"]}, ["m.9.fc2", "fc2"], ["m.9.fc1"]),
        ({"layer_numbers": [1], "layer_types": "all"}, ["m.1.fc2"], ["m.2.fc2"]),
        ({"exact_layer_names": ["m.1.fc1", "m.2.fc2"]}, ["m.1.fc1", "m.2.fc2"], ["m.1.fc1.x", "m.1.fc", "m.3.fc1"]),
        ({"exact_layer_names": "m.1.fc1"}, ["m.1.fc1"], ["m.1.fc"]),  # a string is one name, not a substring
        ({"layer_name_regex_pattern": r"fc\d"}, ["m.1.fc1", "a.fc2.b"], ["m.1.proj"]),  # unanchored search
        ({"layer_name_regex_pattern": r"^m\.1\.fc1$"}, ["m.1.fc1"], ["x.m.1.fc1", "m.1.fc1.y"]),
        ({"layer_type_regex_pattern": "fc[12]", "layer_numbers": [1]}, ["m.1.fc2"], ["m.1.fc3", "m.2.fc1"]),
    ],
)
def test_layer_spec_selection(layers, selected, not_selected):
    layer_spec = spec(layers)
    for name in selected:
        assert layer_spec.matches(name), name
    for name in not_selected:
        assert not layer_spec.matches(name), name


@pytest.mark.parametrize(
    ("layers", "winner", "ignored"),
    [
        (
            {"exact_layer_names": ["m.1.fc1"], "layer_numbers": [2], "layer_types": ["fc2"]},
            "exact",
            ["layer_numbers", "layer_types"],
        ),
        ({"exact_layer_names": ["m.1.fc1"], "layer_name_regex_pattern": "fc2"}, "exact", ["layer_name_regex_pattern"]),
        (
            {"layer_name_regex_pattern": "fc1$", "layer_numbers": [2], "layer_types": ["fc2"]},
            "regex",
            ["layer_numbers", "layer_types"],
        ),
    ],
)
def test_selector_precedence_with_warning(log_dir, layers, winner, ignored):
    init({"sec": section(layers, LogTensorStats=lts())}, log_dir)
    assert layer("m.1.fc1") != {}
    assert layer("m.2.fc2") == {}  # what the ignored selectors alone would have picked
    if winner == "regex":
        assert layer("x.9.fc1") != {}
    else:
        assert layer("x.9.fc1") == {}
    (warning,) = ConfigManager.warnings
    assert "key 'sec.layers'" in warning and str(ignored) in warning
    assert ("WARNING", warning) in read_messages(log_dir)


def test_no_warning_without_ignored_selectors(log_dir):
    init({"sec": section({"layer_numbers": [1], "layer_types": ["fc1"]}, LogTensorStats=lts())}, log_dir)
    assert ConfigManager.warnings == []


def test_exact_layer_names_do_not_raise_for_other_layers(log_dir):
    config = {
        "exact": section({"exact_layer_names": ["model.1.fc1"]}, LogTensorStats=lts()),
        "numbers": section({"layer_numbers": [2]}, LogTensorStats=lts(stats=["max"])),
    }
    init(config, log_dir)
    assert layer("model.1.fc1")["base"]["LogTensorStats"]["stats"] == ["mean"]
    assert layer("model.2.fc1")["base"]["LogTensorStats"]["stats"] == ["max"]
    assert layer("model.embedding") == {}
    assert layer("something.else") == {}


def test_layer_numbers_do_not_crash_on_names_without_numbers(log_dir):
    init({"sec": section({"layer_numbers": [1, 2]}, LogTensorStats=lts())}, log_dir)
    assert layer("model.embedding") == {}
    assert layer("model.output_layer") == {}
    assert layer("model.0.layers.1.fc1") != {}


def test_declared_layer_types(log_dir):
    init({"sec": section({"layer_types": ["layernorm_linear"]}, LogTensorStats=lts())}, log_dir)
    assert layer("model.block") == {}  # cached now...
    ConfigManager.set_layer_types("model.block", "Module", "layernorm_linear")
    assert layer("model.block") == {"base": {"LogTensorStats": LTS}}  # ...and the cache entry was dropped
    ConfigManager.set_layer_types("model.other", "linear")
    assert layer("model.other") == {}
    assert layer("model.layernorm_linear_1") != {}  # the name still counts as before


def test_declared_layer_types_match_exactly_not_by_substring(log_dir):
    init({"sec": section({"layer_types": ["linear"]}, LogTensorStats=lts())}, log_dir)
    ConfigManager.set_layer_types("model.block", "layernorm_linear")
    assert layer("model.block") == {}
    ConfigManager.set_layer_types("model.block", "linear")
    assert layer("model.block") != {}


def test_declared_layer_types_with_numbers(log_dir):
    init({"sec": section({"layer_types": ["Attention"], "layer_numbers": [3]}, LogTensorStats=lts())}, log_dir)
    ConfigManager.set_layer_types("model.3.block", "Attention")
    ConfigManager.set_layer_types("model.4.block", "Attention")
    assert layer("model.3.block") != {}
    assert layer("model.4.block") == {}


def test_set_layer_types_rejects_non_strings():
    with pytest.raises(TypeError):
        ConfigManager.set_layer_types("model.block", 3)


def test_lookup_needs_a_string_layer_name(log_dir):
    init({"sec": section({"layer_numbers": [1]}, LogTensorStats=lts())}, log_dir)
    with pytest.raises(TypeError, match="layer_name must be a string"):
        layer(None)


def test_end_debug_clears_config_and_declared_types(log_dir):
    init({"sec": section({"layer_types": ["Attention"]}, LogTensorStats=lts())}, log_dir)
    ConfigManager.set_layer_types("model.block", "Attention")
    assert layer("model.block") != {}
    debug_api.end_debug()
    assert ConfigManager.configs == {} and ConfigManager.layer_types == {}
    assert ConfigManager.layer_name_to_config_cache == {}


# --------------------------------------------------------------------------------------------
# every config mistake is an error at initialize
# --------------------------------------------------------------------------------------------


def test_missing_config_file(tmp_path, log_dir):
    missing = tmp_path / "nope.yaml"
    message = init_error(str(missing), log_dir, error=FileNotFoundError)
    assert str(missing) in message


def test_directory_as_config_file(tmp_path, log_dir):
    message = init_error(tmp_path, log_dir, error=FileNotFoundError)
    assert str(tmp_path) in message


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", "the config is empty"),
        ("# only a comment\n", "the config is empty"),
        ("{}\n", "the config is empty"),
        ("sec: [unclosed\n", "not valid YAML"),
        ("sec:\n  enabled: true\n bad_indent: 1\n", "not valid YAML"),
        ("- a\n- b\n", "the config must be a mapping of section names to sections; got 'list'"),
        ("just a string\n", "got 'str'"),
    ],
)
def test_unusable_config_file(tmp_path, log_dir, text, expected):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    message = init_error(path, log_dir)
    assert f"config file {str(path)!r}" in message
    assert expected in message


@pytest.mark.parametrize(
    ("text", "duplicate", "line"),
    [
        ("a:\n  enabled: false\nb:\n  enabled: false\na:\n  enabled: true\n", "'a'", 1),
        (
            "s:\n  enabled: true\n  layers: {layer_numbers: [1]}\n"
            "  LogTensorStats: {enabled: true, tensors: [x], stats: [mean]}\n"
            "  LogTensorStats: {enabled: true, tensors: [y], stats: [max]}\n",
            "'LogTensorStats'",
            4,
        ),
        ("s:\n  enabled: true\n  layers: {layer_numbers: [1], layer_numbers: [2]}\n", "'layer_numbers'", 3),
    ],
)
def test_duplicate_yaml_keys_are_an_error(tmp_path, log_dir, text, duplicate, line):
    # plain YAML keeps only the last of two equal keys, silently dropping a section or a feature
    path = tmp_path / "config.yaml"
    path.write_text(text)
    message = init_error(path, log_dir)
    assert str(path) in message
    assert f"found duplicate key {duplicate} (first given on line {line})" in message


def test_yaml_merge_keys_may_be_overridden(tmp_path, log_dir):
    path = tmp_path / "config.yaml"
    path.write_text(
        "shared: &shared\n  enabled: false\n  layers: {layer_numbers: [1]}\n"
        "real:\n  <<: *shared\n  enabled: true\n  LogTensorStats: {enabled: true, tensors: [activation], stats: [mean]}\n"
    )
    init(path, log_dir)
    assert list(ConfigManager.configs) == ["real"]
    assert layer("model.1.fc1") == {"base": {"LogTensorStats": LTS}}


def test_config_file_not_utf8(tmp_path, log_dir):
    path = tmp_path / "config.yaml"
    path.write_bytes(b"sec:\n  enabled: \xff\xfe\n")
    message = init_error(path, log_dir)
    assert str(path) in message and "UTF-8" in message


@pytest.mark.parametrize(
    ("body", "key_path", "fragments"),
    [
        ("  layers:\n    layer_numbers: [1, 3-1]\n", "sec.layers.layer_numbers", ["got '3-1'", "greater than its end"]),
        (
            "  layers: {layer_types: fc1}\n  LogTensorStat: {enabled: true}\n",
            "sec.LogTensorStat",
            ["got 'LogTensorStat'", "did you mean 'LogTensorStats'?"],
        ),
        (
            "  layers: {layer_numbers: all}\n  LogTensorStats:\n    enabled: true\n    tensors: [activation]\n"
            "    type: [mean, std]\n",
            "sec.LogTensorStats.type",
            ["unknown key", "'stats'"],
        ),
    ],
)
def test_error_from_a_file_names_the_file_and_key(tmp_path, log_dir, body, key_path, fragments):
    path = tmp_path / "config.yaml"
    path.write_text("sec:\n  enabled: true\n" + body)
    message = init_error(str(path), log_dir)
    assert message.startswith(f"config file {str(path)!r}: key '{key_path}': "), message
    for fragment in fragments:
        assert fragment in message


OK_LAYERS = {"layer_numbers": [1]}

SECTION_ERRORS = [
    # (config, key path, expected fragments)
    ({"sec": [1, 2]}, "sec", ["a section must be a mapping", "got [1, 2]"]),
    ({"sec": None}, "sec", ["a section must be a mapping", "got None"]),
    ({"sec": {"layers": OK_LAYERS}}, "sec", ["missing required key 'enabled'"]),
    ({"sec": {"enabled": "true", "layers": OK_LAYERS}}, "sec.enabled", ["must be a boolean", "got 'true'", "True, False"]),
    ({"sec": {"enabled": 1, "layers": OK_LAYERS}}, "sec.enabled", ["must be a boolean", "got 1"]),
    ({"sec": {"enabled": True}}, "sec", ["missing required key 'layers'"]),
    ({"sec": section([1, 2])}, "sec.layers", ["must be a mapping of layer selectors", "got [1, 2]", "'layer_numbers'"]),
    (
        {"sec": section({"layer_number": [1]})},
        "sec.layers.layer_number",
        ["unknown layer selector", "did you mean 'layer_numbers'?"],
    ),
    ({"sec": section({"layer_type": ["fc1"]})}, "sec.layers.layer_type", ["did you mean 'layer_types'?"]),
    ({"sec": section({})}, "sec.layers", ["needs at least one layer selector", "'exact_layer_names'"]),
    ({"sec": section({"layer_type_regex_pattern": "fc"})}, "sec.layers", ["needs at least one layer selector"]),
    (
        {"sec": section({"layer_types": ["fc1"], "layer_type_regex_pattern": "fc", "layer_numbers": [1]})},
        "sec.layers",
        ["either 'layer_types' or 'layer_type_regex_pattern'"],
    ),
    ({"sec": section({"layer_numbers": [-1]})}, "sec.layers.layer_numbers", ["cannot be negative", "got -1", "non-negative"]),
    ({"sec": section({"layer_numbers": -3})}, "sec.layers.layer_numbers", ["cannot be negative", "got -3"]),
    ({"sec": section({"layer_numbers": ["3-1"]})}, "sec.layers.layer_numbers", ["greater than its end", "got '3-1'"]),
    ({"sec": section({"layer_numbers": ["abc"]})}, "sec.layers.layer_numbers", ["invalid layer number", "got 'abc'", "'A-B'"]),
    ({"sec": section({"layer_numbers": "1-2-3"})}, "sec.layers.layer_numbers", ["invalid layer number", "got '1-2-3'"]),
    ({"sec": section({"layer_numbers": ["-2"]})}, "sec.layers.layer_numbers", ["invalid layer number", "got '-2'"]),
    ({"sec": section({"layer_numbers": ["²"]})}, "sec.layers.layer_numbers", ["invalid layer number", "got '²'"]),
    ({"sec": section({"layer_numbers": [True]})}, "sec.layers.layer_numbers", ["invalid layer number", "got True"]),
    ({"sec": section({"layer_numbers": 1.5})}, "sec.layers.layer_numbers", ["invalid layer number", "got 1.5"]),
    ({"sec": section({"layer_numbers": [2.0]})}, "sec.layers.layer_numbers", ["invalid layer number", "got 2.0"]),
    ({"sec": section({"layer_numbers": None})}, "sec.layers.layer_numbers", ["invalid layer number", "got None"]),
    ({"sec": section({"layer_numbers": []})}, "sec.layers.layer_numbers", ["must not be empty"]),
    ({"sec": section({"layer_numbers": {"a": 1}})}, "sec.layers.layer_numbers", ["invalid layer number"]),
    ({"sec": section({"layer_types": []})}, "sec.layers.layer_types", ["non-empty layer type or list", "got []"]),
    ({"sec": section({"layer_types": ["fc1", 2]})}, "sec.layers.layer_types", ["got ['fc1', 2]"]),
    ({"sec": section({"layer_types": ""})}, "sec.layers.layer_types", ["got ''"]),
    ({"sec": section({"exact_layer_names": []})}, "sec.layers.exact_layer_names", ["non-empty layer name or list"]),
    ({"sec": section({"exact_layer_names": None})}, "sec.layers.exact_layer_names", ["got None"]),
    (
        {"sec": section({"layer_name_regex_pattern": "fc(1"})},
        "sec.layers.layer_name_regex_pattern",
        ["invalid regular expression", "'fc(1'"],
    ),
    (
        {"sec": section({"layer_name_regex_pattern": 5})},
        "sec.layers.layer_name_regex_pattern",
        ["must be a regular expression string"],
    ),
    (
        {"sec": section({"layer_type_regex_pattern": "[", "layer_numbers": [1]})},
        "sec.layers.layer_type_regex_pattern",
        ["invalid"],
    ),
]


@pytest.mark.parametrize(("config", "key_path", "fragments"), SECTION_ERRORS)
def test_section_and_selector_errors(log_dir, config, key_path, fragments):
    message = init_error(config, log_dir)
    assert message.startswith(f"config dict: key '{key_path}': "), message
    for fragment in fragments:
        assert fragment in message, (fragment, message)


FEATURE_ERRORS = [
    (
        {"LogTensorStat": lts()},
        "sec.LogTensorStat",
        ["not a namespace nor a feature", "did you mean 'LogTensorStats'?", "'base'"],
    ),
    ({"lyers": {"layer_numbers": [1]}}, "sec.lyers", ["did you mean 'layers'?"]),
    ({"bse": {"LogTensorStats": lts()}}, "sec.bse", ["did you mean 'base'?"]),
    (
        {"base": {"LogTensorStat": lts()}},
        "sec.base.LogTensorStat",
        ["unknown feature of namespace 'base'", "did you mean 'LogTensorStats'?"],
    ),
    ({"base": {}}, "sec.base", ["namespace 'base' must map feature names"]),
    ({"base": ["LogTensorStats"]}, "sec.base", ["namespace 'base' must map feature names", "got ['LogTensorStats']"]),
    ({"LogTensorStats": ["mean"]}, "sec.LogTensorStats", ["must be a mapping with at least 'enabled'", "got ['mean']"]),
    ({"LogTensorStats": True}, "sec.LogTensorStats", ["must be a mapping", "got True"]),
    ({"LogTensorStats": None}, "sec.LogTensorStats", ["must be a mapping", "got None"]),
    ({"LogTensorStats": {"tensors": ["a"], "stats": ["mean"]}}, "sec.LogTensorStats", ["missing required key 'enabled'"]),
    ({"LogTensorStats": lts(enabled="yes")}, "sec.LogTensorStats.enabled", ["must be a boolean", "got 'yes'"]),
    ({"LogTensorStats": lts(), "base": {"LogTensorStats": lts()}}, "sec.base.LogTensorStats", ["configured twice"]),
    ({"base": {"LogTensorStats": lts()}, "LogTensorStats": lts()}, "sec.LogTensorStats", ["configured twice"]),
    # LogTensorStats options
    (
        {"LogTensorStats": lts(stats=["mean", "meen"])},
        "sec.LogTensorStats.stats.1",
        ["unsupported statistic", "did you mean 'mean'?"],
    ),
    ({"LogTensorStats": lts(stats=["cur_amax"])}, "sec.LogTensorStats.stats.0", ["unsupported statistic", "'l2_norm'"]),
    ({"LogTensorStats": lts(stats="mean")}, "sec.LogTensorStats.stats", ["must be a non-empty list", "got 'mean'"]),
    ({"LogTensorStats": lts(stats=[])}, "sec.LogTensorStats.stats", ["must be a non-empty list"]),
    ({"LogTensorStats": {"enabled": True, "tensors": ["a"]}}, "sec.LogTensorStats", ["no 'stats' list", "'mean'"]),
    (
        {"LogTensorStats": {"enabled": True, "tensors": ["a"], "type": ["mean"]}},
        "sec.LogTensorStats.type",
        ["unknown key", "'stats'"],
    ),
    ({"LogTensorStats": lts(freq=0)}, "sec.LogTensorStats.freq", ["positive integer", "got 0"]),
    ({"LogTensorStats": lts(freq=-2)}, "sec.LogTensorStats.freq", ["got -2"]),
    ({"LogTensorStats": lts(freq=1.5)}, "sec.LogTensorStats.freq", ["got 1.5"]),
    ({"LogTensorStats": lts(freq="2")}, "sec.LogTensorStats.freq", ["got '2'"]),
    ({"LogTensorStats": lts(freq=True)}, "sec.LogTensorStats.freq", ["got True"]),
    ({"LogTensorStats": lts(start_step=-1)}, "sec.LogTensorStats.start_step", ["non-negative integer", "got -1"]),
    ({"LogTensorStats": lts(end_step=-2)}, "sec.LogTensorStats.end_step", ["-1 for no end", "got -2"]),
    ({"LogTensorStats": lts(start_end_list=[[1]])}, "sec.LogTensorStats.start_end_list.0", ["[start, end]", "got [1]"]),
    ({"LogTensorStats": lts(start_end_list=[1, 2])}, "sec.LogTensorStats.start_end_list.0", ["got 1"]),
    ({"LogTensorStats": lts(start_end_list=[[5, 2]])}, "sec.LogTensorStats.start_end_list.0", ["start < end", "got [5, 2]"]),
    ({"LogTensorStats": lts(start_end_list=[[5, 5]])}, "sec.LogTensorStats.start_end_list.0", ["got [5, 5]"]),
    (
        {"LogTensorStats": lts(start_end_list=[[0, 10], [5, 20]])},
        "sec.LogTensorStats.start_end_list.1",
        ["overlaps", "got [5, 20]"],
    ),
    (
        {"LogTensorStats": lts(start_end_list=[[10, 20], [0, 5]])},
        "sec.LogTensorStats.start_end_list.1",
        ["overlaps", "got [0, 5]"],
    ),
    ({"LogTensorStats": lts(start_end_list=[[0, -1], [5, 8]])}, "sec.LogTensorStats.start_end_list.1", ["overlaps"]),
    ({"LogTensorStats": lts(start_end_list="0-10")}, "sec.LogTensorStats.start_end_list", ["list of [start, end]", "got '0-10'"]),
    ({"LogTensorStats": lts(tensors=[])}, "sec.LogTensorStats.tensors", ["non-empty list of tensor names", "got []"]),
    ({"LogTensorStats": lts(tensors=["a", 1])}, "sec.LogTensorStats.tensors", ["got ['a', 1]"]),
    (
        {"LogTensorStats": {"enabled": True, "stats": ["mean"]}},
        "sec.LogTensorStats",
        ["needs 'tensors: [names]' or 'tensors_struct"],
    ),
    (
        {"LogTensorStats": {"enabled": True, "tensors_struct": [{"tensor": "a", "stats": ["mean"]}, {"stats": ["max"]}]}},
        "sec.LogTensorStats.tensors_struct.1",
        ["string 'tensor' key", "got {'stats': ['max']}"],
    ),
    (
        {"LogTensorStats": {"enabled": True, "tensors_struct": []}},
        "sec.LogTensorStats.tensors_struct",
        ["non-empty list of mappings"],
    ),
    (
        {"LogTensorStats": {"enabled": True, "tensors_struct": [{"tensor": "a", "stats": ["mean"], "freqq": 2}]}},
        "sec.LogTensorStats.tensors_struct.0.freqq",
        ["unknown key", "did you mean 'freq'?"],
    ),
    (
        {"LogTensorStats": {"enabled": True, "tensors_struct": [{"tensor": "a", "stats": ["mean"], "freq": 0}]}},
        "sec.LogTensorStats.tensors_struct.0.freq",
        ["got 0"],
    ),
    (
        {"LogTensorStats": {"enabled": True, "tensors_struct": [{"tensor": "a"}]}},
        "sec.LogTensorStats.tensors_struct.0",
        ["tensor 'a' has no 'stats' list"],
    ),
]


@pytest.mark.parametrize(("features", "key_path", "fragments"), FEATURE_ERRORS)
def test_feature_errors(log_dir, features, key_path, fragments):
    message = init_error({"sec": section(OK_LAYERS, **features)}, log_dir)
    assert message.startswith(f"config dict: key '{key_path}': "), message
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def test_a_feature_option_written_at_section_level_is_said_to_belong_under_a_feature(log_dir, custom_ns):
    """``freq`` and ``tensors`` beside the features: the error says where they go (the section's own feature as a
    key path) instead of calling them an unknown namespace."""
    with pytest.raises(ConfigError) as info:
        init({"sec": section(OK_LAYERS, freq=10, tensors=["activation"], LogTensorStats=lts())}, log_dir)
    message = str(info.value)
    assert message.startswith(
        "config dict: key 'sec.freq': 'freq' is an option of a feature, not of a section: write it in the config of "
        "the feature it is for, e.g. 'LogTensorStats.freq'"
    )
    assert "key 'sec.tensors': 'tensors' is an option of a feature" in info.value.__notes__[0]  # the other error
    assert "not a namespace" not in message and "did you mean" not in message
    config = {"sec": section(OK_LAYERS, start_step=3, **{custom_ns.name: {"FeatA": {"enabled": True}}})}
    message = init_error(config, log_dir, [custom_ns.directory])
    assert f"write it in the config of the feature it is for, e.g. '{custom_ns.name}.FeatA.start_step'" in message
    message = init_error({"sec": section(OK_LAYERS, stats=["max"])}, log_dir)
    assert "e.g. LogTensorStats: {enabled: True, stats: ...} (under 'transformer_engine:' for lowprec's layers)" in message


def test_a_feature_of_another_namespace_written_directly_in_a_section_names_that_namespace(log_dir, custom_ns):
    """Not "did you mean" a base feature of a similar name: the namespace that has it."""
    message = init_error({"sec": section(OK_LAYERS, FeatA={"enabled": True})}, log_dir, [custom_ns.directory])
    assert message == (
        f"config dict: key 'sec.FeatA': FeatA is a feature of namespace '{custom_ns.name}', not of the base namespace: "
        f"write it under '{custom_ns.name}:' in the section ({custom_ns.name}: {{FeatA: {{enabled: True, ...}}}}); "
        "got 'FeatA'"
    )


def test_unknown_feature_in_custom_namespace(log_dir, custom_ns):
    config = {"sec": section(OK_LAYERS, **{custom_ns.name: {"FeatC": {"enabled": True}}})}
    message = init_error(config, log_dir, [custom_ns.directory])
    assert message.startswith(f"config dict: key 'sec.{custom_ns.name}.FeatC': unknown feature of namespace '{custom_ns.name}'")
    assert "allowed: 'FeatA', 'FeatB'" in message


def test_custom_namespace_unknown_without_its_feature_dir(log_dir, custom_ns):
    config = {"sec": section(OK_LAYERS, **{custom_ns.name: {"FeatA": {"enabled": True}}})}
    message = init_error(config, log_dir)
    assert f"key 'sec.{custom_ns.name}'" in message and "not a namespace nor a feature" in message


def test_error_in_a_later_section_is_still_found(log_dir):
    config = {"good": section(OK_LAYERS, LogTensorStats=lts()), "bad": section({"layer_numbers": ["x"]})}
    assert "key 'bad.layers.layer_numbers'" in init_error(config, log_dir)


def test_errors_are_logged_and_not_assertions(log_dir):
    init_error({"sec": section({"layer_numbers": ["x"]})}, log_dir)
    # the failed run's log says why
    assert any(level == "ERROR" and "initialize failed: ConfigError" in m for level, m in read_messages(log_dir))


# --------------------------------------------------------------------------------------------
# disabled parts, all-disabled configs, recovery after a failure
# --------------------------------------------------------------------------------------------


def test_disabled_sections_are_not_validated_beyond_enabled(log_dir):
    config = {
        "off": {"enabled": False, "layers": "garbage", "LogTensorStat": 1, "whatever": {"x": 1}},
        "on": section({"layer_numbers": [1]}, LogTensorStats=lts()),
    }
    init(config, log_dir)
    assert list(ConfigManager.configs) == ["on"]
    assert ConfigManager.section_names == ["off", "on"]
    assert layer("model.1.fc1") == {"base": {"LogTensorStats": LTS}}


def test_disabled_section_still_needs_a_boolean_enabled(log_dir):
    message = init_error({"off": {"enabled": "no", "layers": "garbage"}}, log_dir)
    assert message.startswith("config dict: key 'off.enabled': must be a boolean")


def test_disabled_feature_is_not_validated_beyond_enabled(log_dir):
    config = {"sec": section(OK_LAYERS, LogTensorStats={"enabled": False, "stats": "bogus", "type": 1})}
    init(config, log_dir)
    assert layer("model.1.fc1") == {"base": {"LogTensorStats": {"enabled": False, "stats": "bogus", "type": 1}}}
    assert debug_api.log_tensor_stats("model.1.fc1", tensor=torch.ones(2), tensor_name="activation") == {}


def test_all_sections_disabled_initializes_with_a_warning(tmp_path, log_dir):
    path = tmp_path / "off.yaml"
    path.write_text("a:\n  enabled: false\nb:\n  enabled: false\n  layers: {}\n")
    init(path, log_dir)
    assert debug_api.DEBUG_MANAGER is not None
    assert ConfigManager.configs == {}
    (warning,) = ConfigManager.warnings
    assert str(path) in warning and "every section is disabled" in warning
    assert ("WARNING", warning) in read_messages(log_dir)
    assert layer("model.1.fc1") == {}


def test_initialize_works_after_a_failed_initialize(log_dir, tmp_path):
    init_error({"sec": section({"layer_numbers": ["x"]})}, log_dir)
    init_error(tmp_path / "missing.yaml", log_dir, error=FileNotFoundError)
    init({"sec": section({"layer_numbers": [1]}, LogTensorStats=lts())}, log_dir)
    assert debug_api.DEBUG_MANAGER is not None
    assert layer("model.1.fc1") == {"base": {"LogTensorStats": LTS}}


def test_config_errors_are_framework_errors(log_dir):
    with pytest.raises(NvdlfwInspectError):
        init({"sec": section({"layer_numbers": ["x"]})}, log_dir)
    with pytest.raises(ValueError):  # ConfigError is also a ValueError, as the reference raised
        init({"sec": section({"layer_numbers": ["x"]})}, log_dir)


def test_load_config_directly_reports_into_class_state():
    from nvdlfw_inspect.registry import NamespaceData

    # no namespace registered: every feature key is unknown, but selectors are still checked first
    with pytest.raises(ConfigError, match="key 's.layers.layer_numbers'"):
        ConfigManager.load_config({"s": section({"layer_numbers": ["x"]})}, {})
    ConfigManager.load_config({"s": section({"layer_numbers": [1]})}, {"other": NamespaceData("other")})
    try:
        assert list(ConfigManager.configs) == ["s"]
        assert ConfigManager.source == "config dict"
        assert layer("m.1.x") == {}
    finally:
        ConfigManager.reset()


def test_a_namespace_set_aside_at_loading_is_named_with_why():
    """The config module is given the set-aside namespaces (``Registry.unusable``) as it is given the registry."""
    config = {"s": {"enabled": True, "layers": {"layer_numbers": [1]}, "lost": {"Feat": {"enabled": True}}}}
    (error,) = find_config_errors(config, {}, {"lost": "its API is no BaseNamespaceAPI"})
    assert "key 's.lost'" in str(error) and "namespace set aside at loading: its API is no BaseNamespaceAPI" in str(error)
    (error,) = find_config_errors(config, {})
    assert "not a namespace nor a feature of the base namespace" in str(error)
    with pytest.raises(ConfigError, match="set aside at loading: why"):
        ConfigManager.load_config(config, {}, {"lost": "why"})


def test_logging_of_loaded_sections(log_dir):
    init({"alpha": section(OK_LAYERS, LogTensorStats=lts()), "beta": {"enabled": False}}, log_dir)
    loaded = [m for level, m in read_messages(log_dir) if m.startswith("Loaded configs for")]
    assert len(loaded) == 1 and "'alpha'" in loaded[0] and "'beta'" in loaded[0]


def test_a_section_key_that_is_no_string_is_judged_by_its_own_value(log_dir):
    """A YAML key such as ``1:`` is named as text, and the hint still reads the mapping written under it."""
    config = {"sec": {"enabled": True, "layers": {"layer_numbers": [1]}, 1: {"Feat": {"enabled": True}}}}
    message = init_error(config, log_dir)
    assert message.startswith("config dict: key 'sec.1': not a namespace nor a feature of the base namespace")
    assert "(if it is a namespace, pass the directory of its features" in message
