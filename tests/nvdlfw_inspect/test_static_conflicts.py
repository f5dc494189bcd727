"""Two sections configuring one feature for layers their selectors show to overlap are rejected before the run
(issue item 7): with the exact names or a witness name built from the selectors, and the routing of that name
fails the same way; ``validate --layers-from`` checks the names a run logged."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from nvdlfw_inspect import config_manager
from nvdlfw_inspect.cli import main
from nvdlfw_inspect.config_manager import ConfigManager, find_config_errors
from nvdlfw_inspect.errors import ConfigError
from nvdlfw_inspect.registry import Registry

LTS = {"enabled": True, "tensors": ["activation"], "stats": ["max"]}


def config(first: dict, second: dict, second_enabled: bool = True) -> dict:
    return {
        "first": {"enabled": True, "layers": first, "LogTensorStats": dict(LTS)},
        "second": {"enabled": second_enabled, "layers": second, "LogTensorStats": dict(LTS)},
    }


def errors_of(cfg: dict, layers: list[str] = ()) -> list[str]:
    return [str(error) for error in find_config_errors(cfg, Registry.data, Registry.unusable, layers)]


@pytest.fixture
def loaded(tmp_path):
    """The base namespace registered (``initialize`` with no config), as ``validate`` has it."""
    import nvdlfw_inspect.api as debug_api

    debug_api.initialize(config_file="", log_dir=str(tmp_path / "scratch"))
    yield
    debug_api.end_debug()


OVERLAPS = [
    ({"exact_layer_names": ["model.fc1"]}, {"layer_name_regex_pattern": r"fc\d$"}, "['model.fc1']"),
    ({"exact_layer_names": ["model.3.fc2"]}, {"layer_numbers": [3], "layer_types": ["fc2"]}, "['model.3.fc2']"),
    ({"layer_name_regex_pattern": ".*"}, {"layer_types": ["fc1"]}, "layers such as 'fc1'"),
    ({"layer_name_regex_pattern": r"^model\.layers\.\d+\.mlp"}, {"layer_types": ["mlp"]}, "layers such as 'model.layers.0.mlp'"),
    ({"layer_name_regex_pattern": r"layers\.1\."}, {"layer_name_regex_pattern": r"fc1$"}, "layers such as 'layers.1.fc1'"),
    ({"layer_name_regex_pattern": r"^(?:qkv|proj)"}, {"layer_name_regex_pattern": "proj"}, "layers such as 'proj'"),
    ({"layer_name_regex_pattern": r"[^x]+\.out"}, {"layer_numbers": [2], "layer_types": ["out"]}, None),
]


@pytest.mark.parametrize(("first", "second", "which"), OVERLAPS)
def test_overlapping_selectors_are_rejected_with_the_layers_they_share(loaded, first, second, which):
    (error,) = errors_of(config(first, second))
    start = "config dict: key '<top level>': sections 'first' and 'second' both configure ['base.LogTensorStats']"
    assert error.startswith(start)
    if which is not None:
        assert f" for {which}; a layer may get each feature from one section only" in error


@pytest.mark.parametrize(("first", "second", "which"), OVERLAPS)
def test_routing_the_named_layer_fails_the_same_way(loaded, tmp_path, monkeypatch, first, second, which):
    """What the static check names is a real conflict: routing that very name raises the runtime error."""
    (error,) = errors_of(config(first, second))
    names = re.search(r"for (?:layers such as '(.*)'|\['(.*)'\]);", error).groups()
    name = next(n for n in names if n)
    monkeypatch.setattr(config_manager, "_check_static_conflicts", lambda *args: None)
    ConfigManager.load_config(config(first, second), Registry.data)
    expected = f"sections 'first' and 'second' both configure base.LogTensorStats for layer '{re.escape(name)}'"
    with pytest.raises(ConfigError, match=expected):
        ConfigManager.get_config_for_layer(name)


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ({"layer_name_regex_pattern": r"^a\."}, {"layer_name_regex_pattern": r"^b\."}),
        ({"layer_name_regex_pattern": r"fc1$"}, {"layer_name_regex_pattern": r"fc2$"}),
        ({"exact_layer_names": ["model.fc1"]}, {"layer_name_regex_pattern": "fc2"}),
        ({"layer_numbers": [1]}, {"layer_types": ["fc2"]}),  # names decide: checked at routing (and --layers-from)
    ],
)
def test_selectors_that_show_no_overlap_are_accepted(loaded, first, second):
    assert errors_of(config(first, second)) == []


def test_a_disabled_section_configures_nothing(loaded):
    assert errors_of(config({"layer_name_regex_pattern": ".*"}, {"exact_layer_names": ["x"]}, second_enabled=False)) == []


def test_different_features_on_overlapping_selectors_are_fine(loaded):
    cfg = config({"layer_name_regex_pattern": ".*"}, {"exact_layer_names": ["x"]})
    del cfg["second"]["LogTensorStats"]
    cfg["second"]["base"] = {"LogTensorStats": dict(LTS)}  # the same feature, another spelling: still one feature
    assert len(errors_of(cfg)) == 1
    cfg["first"]["LogTensorStats"]["enabled"] = False  # configured, though disabled: still claims the layer
    assert len(errors_of(cfg)) == 1


def run_dir(tmp_path, statistics: list[str], routing: list[str] | None = None):
    """A log directory with statistics records of ``statistics`` (and routing records of ``routing``)."""
    log_dir = tmp_path / "run"
    records = log_dir / "nvdlfw_inspect_statistics_jsonl"
    records.mkdir(parents=True)
    line = {"tensor": "activation", "stat": "max", "iteration": 0, "value": 1.0}
    text = "".join(json.dumps({**line, "layer": n}) + "\n" for n in statistics)
    (records / "nvdlfw_inspect_globalrank-0.jsonl").write_text(text)
    if routing is not None:
        (log_dir / "nvdlfw_inspect_routing_jsonl").mkdir()
        record = {"gemm": "fprop", "tensor": "activation", "decision": "fp8", "feature": None, "recipe": True, "iteration": 0}
        lines = [json.dumps({"layer": n, **record, "rank": 0}) for n in routing] + ["not json", '{"layer": 7}']
        (log_dir / "nvdlfw_inspect_routing_jsonl" / "routing_globalrank-0.jsonl").write_text("\n".join(lines) + "\n")
    return log_dir


def test_validate_layers_from_finds_a_conflict_only_the_run_shows(tmp_path, capsys):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config({"layer_numbers": [1]}, {"layer_types": ["fc2"]})))
    assert main(["validate", str(path)]) == 0
    log_dir = run_dir(tmp_path, ["model.1.fc1", "model.2.fc2"])
    assert main(["validate", str(path), "--layers-from", str(log_dir)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"{path}: valid (and on the 2 layers logged in {log_dir})"

    log_dir = run_dir(tmp_path / "routed", ["model.1.fc1"], routing=["model.1.fc2", "model.1.fc1"])
    assert main(["validate", str(path), "--layers-from", str(log_dir)]) == 1
    err = capsys.readouterr().err.splitlines()
    # the routing lines that hold no record are said
    assert "routing_globalrank-0.jsonl" in err[0] and "skipped 2 lines" in err[0]
    assert err[1].startswith(f"{path}:1: config file '{path}': key '<top level>': sections 'first' and 'second' both")
    assert "for layers of the run such as ['model.1.fc2']" in err[1] and err[2] == f"{path}: 1 error"


def test_validate_layers_from_a_directory_without_logs(tmp_path, capsys):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config({"layer_numbers": [1]}, {"layer_types": ["fc2"]})))
    assert main(["validate", str(path), "--layers-from", str(tmp_path / "nowhere")]) == 1
    assert "nvdlfw-inspect validate: no statistics in" in capsys.readouterr().err
