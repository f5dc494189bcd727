"""Hostile or mistaken input fails fast with a short error that names it: YAML alias bombs, huge values,
windows that log nothing, a directory given as the config file, and feature files named like modules."""

from __future__ import annotations

import re
import smtplib
import sys
import time

import pytest
import yaml
from inspect_ns_factory import write_namespace

import nvdlfw_inspect.api as debug_api
from nvdlfw_inspect.errors import MAX_MESSAGE_CHARS, ConfigError, FeatureLoadError
from nvdlfw_inspect.registry import Registry

LAUGHS = "\n".join(
    f"{name}: &{name} [{','.join([f'*{previous}'] * 9)}]" for previous, name in zip("abcdefgh", "bcdefghi", strict=True)
)
BOMB = f"""a: &a [lol,lol,lol,lol,lol,lol,lol,lol,lol]
{LAUGHS}
sec:
  enabled: true
  layers: {{layer_numbers: all}}
  LogTensorStats: {{enabled: true, stats: [max], tensors: *i}}
"""


def init(config, log_dir, feature_dirs=None):
    debug_api.initialize(config_file=config, feature_dirs=feature_dirs, log_dir=log_dir)


def section(**lts):
    features = {"LogTensorStats": {"enabled": True, "tensors": ["activation"], "stats": ["max"], **lts}}
    return {"sec": {"enabled": True, "layers": {"layer_numbers": "all"}, **features}}


# --------------------------------------------------------------------------------------------
# 8. alias bombs and the length of every message
# --------------------------------------------------------------------------------------------


def test_alias_bomb_is_refused_quickly_with_a_short_message_naming_the_file(tmp_path, log_dir):
    config = tmp_path / "bomb.yaml"
    config.write_text(BOMB)
    assert len(BOMB) < 500  # a billion "lol"s once expanded
    began = time.perf_counter()
    with pytest.raises(ConfigError) as info:
        init(config, log_dir)
    assert time.perf_counter() - began < 2
    message = str(info.value)
    assert str(config) in message and "aliases" in message and "at most 100000" in message
    assert len(message) < 400
    assert debug_api.DEBUG_MANAGER is None


def test_alias_to_its_own_anchor_is_refused(tmp_path, log_dir):
    config = tmp_path / "loop.yaml"
    config.write_text("loop: &loop [*loop]\n")
    with pytest.raises(ConfigError, match="refers to its own anchor") as info:
        init(config, log_dir)
    assert str(config) in str(info.value)


def test_anchors_reusing_a_block_still_work(tmp_path, log_dir):
    config = tmp_path / "anchors.yaml"
    config.write_text(
        "one:\n  enabled: true\n  layers: {exact_layer_names: [a]}\n"
        "  LogTensorStats: &stats {enabled: true, tensors: [activation], stats: [max, min]}\n"
        "two:\n  enabled: true\n  layers: {exact_layer_names: [b]}\n  LogTensorStats: *stats\n"
    )
    init(config, log_dir)
    assert debug_api.DEBUG_MANAGER is not None


def test_deeply_nested_yaml_is_a_config_error(tmp_path, log_dir):
    config = tmp_path / "deep.yaml"
    config.write_text("sec: " + "[" * 50_000 + "]" * 50_000 + "\n")
    with pytest.raises(ConfigError, match="nested too deeply") as info:
        init(config, log_dir)
    assert str(config) in str(info.value)


def test_huge_value_in_a_dict_config_gives_a_short_message(log_dir):
    value = ["lol"] * 9
    for _ in range(8):
        value = [value] * 9  # 9**9 strings, shared
    began = time.perf_counter()
    with pytest.raises(ConfigError) as info:
        init({"sec": value}, log_dir)
    assert time.perf_counter() - began < 2
    message = str(info.value)
    assert message.startswith("config dict: key 'sec': a section must be a mapping") and len(message) < 600


@pytest.mark.parametrize("error", [ConfigError, FeatureLoadError])
def test_every_message_is_capped_keeping_its_start_and_end(error):
    message = str(error("config file 'x.yaml': " + "y" * 10_000_000 + " allowed: True, False"))
    assert len(message) < MAX_MESSAGE_CHARS + 100
    assert message.startswith("config file 'x.yaml': ") and message.endswith(" allowed: True, False")
    assert "characters cut" in message


LTS = {"enabled": True, "tensors": ["activation"], "stats": ["max"]}


# --------------------------------------------------------------------------------------------
# 8b. layer regexes whose matching time explodes (catastrophic backtracking)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "pattern"),
    [
        ("layer_name_regex_pattern", r"^(\w+\.?)+fc1$"),  # froze the first call of a layer it does not match
        ("layer_name_regex_pattern", r"(x+)+y"),
        ("layer_name_regex_pattern", r"(?:x*)*y"),
        ("layer_name_regex_pattern", r"(ab|ab)*c"),
        ("layer_name_regex_pattern", r"(a|aa)+c"),
        ("layer_name_regex_pattern", r"(x?x)+y"),
        ("layer_name_regex_pattern", r"(\w+){8}!"),  # bounded, but a name of 31 letters takes it 2.6 s
        ("layer_type_regex_pattern", r"(?i)(\w+_?)+linear$"),
        ("layer_name_regex_pattern", r"(\w+_)+linear"),  # \w swallows the delimiter
        ("layer_name_regex_pattern", r"(a.*b)+c"),
    ],
)
def test_a_backtracking_layer_regex_is_refused_at_initialize_naming_key_and_pattern(tmp_path, log_dir, key, pattern):
    """A name the regex does not match took it longer than any training step (killed after 20 s), with no message."""
    config = tmp_path / "slow.yaml"
    layers = {key: pattern} if key == "layer_name_regex_pattern" else {key: pattern, "layer_numbers": "all"}
    config.write_text(yaml.safe_dump({"sec": {"enabled": True, "layers": layers, "LogTensorStats": LTS}}))
    began = time.perf_counter()
    with pytest.raises(ConfigError) as info:
        init(config, log_dir)
    assert time.perf_counter() - began < 2
    message = str(info.value)
    assert f"config file '{config}': key 'sec.layers.{key}':" in message and f"got {pattern!r}" in message
    assert "catastrophic backtracking" in message and r"'^[\w.]+fc1$'" in message and "possessive" in message
    assert debug_api.DEBUG_MANAGER is None


UPSTREAM_PATTERNS = [  # every layer regex of Transformer Engine's and nvidia-dlfw-inspect's configs, docs and tests
    ".*",
    ".*(fc1)",
    ".*(fc2)",
    ".*(qkv)",
    ".*1",
    ".*(attention).*",
    ".*(mlp).*",
    ".*(self_attention).*",
    ".*(fc1|fc2)",
    ".*(fc1|qkv)",
    ".*(fc1|fc2|relu)",
    ".*(fc1|self_attention).*",
    r".*1\..*attn..*(proj|qkv)",
    "self_attn.*",
]


@pytest.mark.parametrize(
    "pattern",
    [
        *UPSTREAM_PATTERNS,
        r"^[\w.]+fc1$",  # the rewrite the error suggests
        r"^model\.layers\.\d+\.mlp",
        r"(q_proj|down_proj)$",
        r"(?:proj|qkv|fc\d)+",  # alternatives that start apart: one way to match
        r"(\.\d{2})*x",  # a repeat of a fixed-length part
        r"(layers\.\d+)?\.fc1",  # an optional part is no repeat
        r"^(\w+\.?)++fc1$",  # possessive: never backtracks
        r"^(?>\w+\.?)+fc1$",  # atomic: each iteration's match is final
        r"^(model\.layers\.\d+\.)+mlp",  # a delimited repeat inside a repeat: one way to split
        r"(\.\d+)*\.fc1",
        r"([a-z]+_)+linear",
        r"(?i)(?:self_)?attn(\.\w+)?",
    ],
)
def test_layer_regexes_that_match_in_bounded_time_are_accepted(log_dir, pattern):
    init({"sec": {"enabled": True, "layers": {"layer_name_regex_pattern": pattern}, "LogTensorStats": LTS}}, log_dir)
    assert debug_api.DEBUG_MANAGER is not None
    regex, began = re.compile(pattern), time.perf_counter()
    for name in ("model.layers.1." * 40 + "x", "a_" * 40 + "!", "1" * 60, ".1" * 40, "x" * 40, "ab" * 40):
        regex.search(name)
    assert time.perf_counter() - began < 0.5  # names built to make a backtracking regex try every split


def test_a_regex_nested_too_deeply_for_python_is_a_config_error(log_dir):
    pattern = "(" * 5000 + "x" + ")" * 5000
    with pytest.raises(ConfigError, match=r"key 'sec.layers.layer_name_regex_pattern': .*nested too deeply"):
        init({"sec": {"enabled": True, "layers": {"layer_name_regex_pattern": pattern}, "LogTensorStats": LTS}}, log_dir)


# --------------------------------------------------------------------------------------------
# 9. windows that would log nothing; a directory as the config file
# --------------------------------------------------------------------------------------------


ITEM_WINDOW = {"tensors_struct": [{"tensor": "activation", "stats": ["max"], "start_step": 9, "end_step": 2}]}


@pytest.mark.parametrize(
    ("window", "key", "expected"),
    [
        ({"start_step": 10, "end_step": 5}, "end_step", "is before start_step 10, so nothing would be logged; got 5"),
        (ITEM_WINDOW, "tensors_struct.0.end_step", "is before start_step 9, so nothing would be logged; got 2"),
        ({"start_end_list": [[0, 4], [10, 5]]}, "start_end_list.1", "0 <= start < end"),
        ({"freq": 0}, "freq", "must be a positive integer"),
        ({"freq": -2}, "freq", "must be a positive integer"),
    ],
)
def test_window_that_logs_nothing_is_rejected_naming_the_key(log_dir, window, key, expected):
    config = section(**window)
    if "tensors_struct" in window:
        del config["sec"]["LogTensorStats"]["tensors"]
    with pytest.raises(ConfigError) as info:
        init(config, log_dir)
    assert f"key 'sec.LogTensorStats.{key}'" in str(info.value) and expected in str(info.value)


@pytest.mark.parametrize("window", [{"start_step": 5, "end_step": 5}, {"start_step": 5, "end_step": -1}, {"end_step": 0}])
def test_windows_that_log_something_are_accepted(log_dir, window):
    init(section(**window), log_dir)
    assert debug_api.DEBUG_MANAGER is not None


def test_directory_as_config_file_says_it_is_a_directory(tmp_path, log_dir):
    with pytest.raises(FileNotFoundError) as info:
        init(tmp_path, log_dir)
    assert str(tmp_path) in str(info.value) and "is a directory" in str(info.value)
    assert "not found" not in str(info.value)


# --------------------------------------------------------------------------------------------
# 11. feature files never shadow other modules
# --------------------------------------------------------------------------------------------


def test_feature_file_named_like_a_stdlib_module_does_not_shadow_it(tmp_path, log_dir, monkeypatch):
    ns = write_namespace(tmp_path / "features")
    (ns.directory / "smtplib.py").write_text("FROM_FEATURE_DIR = True\n")
    ns.feature_file.write_text("import smtplib as sibling_mail\n" + ns.feature_file.read_text())
    monkeypatch.delitem(sys.modules, "smtplib")  # not imported yet, as in a fresh process
    init("", log_dir, ns.directory)

    assert set(Registry.data[ns.name].features) == {"FeatA", "FeatB"}
    feature_module = sys.modules[type(Registry.data[ns.name].features["FeatA"]).__module__]
    assert feature_module.__name__.startswith("nvdlfw_inspect._features.")
    assert feature_module.sibling_mail.FROM_FEATURE_DIR is True  # a sibling import still finds the sibling
    assert "smtplib" not in sys.modules
    import smtplib as mail  # the point: imported after the feature files ran

    assert mail.__file__ == smtplib.__file__ and hasattr(mail, "SMTP") and not hasattr(mail, "FROM_FEATURE_DIR")
