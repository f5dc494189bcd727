"""Two sections configuring one feature for one layer: an error when that layer routes (as in the reference
framework), never at ``initialize`` for selectors that merely could overlap on a name no layer has (the reference's
own ``basic_stat_collection.yaml`` and Transformer Engine's ``tensor_manipulation_transformer_engine.yaml`` load
and run). ``initialize`` warns about overlaps certain by construction; ``validate`` warns about possible ones with
a witness name, and ``validate --layers-from`` makes a real name of the run both select an error."""

from __future__ import annotations

import json
import re

import pytest
import torch
import yaml
from logreader import main_log_path

import nvdlfw_inspect.api as debug_api
from nvdlfw_inspect.cli import main
from nvdlfw_inspect.config_manager import ConfigManager, LayerSpec, find_config_errors
from nvdlfw_inspect.errors import ConfigError
from nvdlfw_inspect.registry import Registry
from nvdlfw_inspect.section_overlaps import possible_overlaps

LTS = {"enabled": True, "tensors": ["activation"], "stats": ["max"], "freq": 1}


def config(first: dict, second: dict, second_enabled: bool = True) -> dict:
    return {
        "first": {"enabled": True, "layers": first, "LogTensorStats": dict(LTS)},
        "second": {"enabled": second_enabled, "layers": second, "LogTensorStats": dict(LTS)},
    }


def errors_of(cfg: dict, layers: list[str] = ()) -> list[str]:
    return [str(error) for error in find_config_errors(cfg, Registry.data, Registry.unusable, layers)]


def possible(cfg: dict) -> list[str]:
    ConfigManager.load_config(cfg, Registry.data)
    return possible_overlaps(list(ConfigManager.configs.values()))


@pytest.fixture
def loaded(tmp_path):
    """The base namespace registered (``initialize`` with no config), as ``validate`` has it."""
    debug_api.initialize(config_file="", log_dir=str(tmp_path / "scratch"))
    yield
    debug_api.end_debug()


# The reference's tests/unit/test_configs/basic_stat_collection.yaml, as it is.
REFERENCE_SECTIONS = {
    "stat_collection_1": ".*(self_attention).*",
    "stat_collection_2": ".*(mlp).*",
    "stat_collection_3": ".*(fc2)",
}


def reference_config() -> dict:
    stats = {"enabled": True, "stats": ["max", "mean", "std", "l1_norm"], "freq": 1}
    return {
        name: {
            "enabled": True,
            "layers": {"layer_name_regex_pattern": regex},
            "LogTensorStats": {**stats, "tensors": ["activation"]},
        }
        for name, regex in REFERENCE_SECTIONS.items()
    }


def test_regex_sections_that_overlap_only_on_names_no_layer_has_load_and_run(tmp_path):
    """The reference's own config: initialize accepts it and every layer selected by one section logs."""
    debug_api.initialize(config_file=reference_config(), log_dir=str(tmp_path))
    try:
        for layer in ("model.self_attention.qkv", "model.mlp.fc1", "model.proj.fc2"):
            stats = debug_api.log_tensor_stats(layer, tensor=torch.tensor([1.0, -3.0]), tensor_name="activation")
            assert stats["max"].item() == 1.0 and stats["l1_norm"].item() == 4.0
        debug_api.step()
    finally:
        debug_api.end_debug()
    assert "both configure" not in main_log_path(tmp_path).read_text()


def test_a_layer_both_select_fails_when_it_routes_with_the_sections_named(tmp_path):
    """``model.mlp.fc2`` is selected by '.*(mlp).*' and '.*(fc2)': the call raises, naming both sections and the layer."""
    debug_api.initialize(config_file=reference_config(), log_dir=str(tmp_path))
    try:
        expected = (
            "config dict: sections 'stat_collection_2' and 'stat_collection_3' both configure base.LogTensorStats for "
            "layer 'model.mlp.fc2'; a layer may get each feature from one section only"
        )
        with pytest.raises(ConfigError, match=re.escape(expected)):
            debug_api.log_tensor_stats("model.mlp.fc2", tensor=torch.ones(2), tensor_name="activation")
    finally:
        debug_api.end_debug()


WITNESSED = [
    ({"exact_layer_names": ["model.fc1"]}, {"layer_name_regex_pattern": r"fc\d$"}, "layers ['model.fc1']"),
    ({"exact_layer_names": ["model.3.fc2"]}, {"layer_numbers": [3], "layer_types": ["fc2"]}, "layers ['model.3.fc2']"),
    ({"layer_name_regex_pattern": ".*"}, {"layer_types": ["fc1"]}, "layers such as 'fc1'"),
    ({"layer_name_regex_pattern": r"^model\.layers\.\d+\.mlp"}, {"layer_types": ["mlp"]}, "layers such as 'model.layers.0.mlp'"),
    ({"layer_name_regex_pattern": r"layers\.1\."}, {"layer_name_regex_pattern": r"fc1$"}, "layers such as 'layers.1.fc1'"),
    ({"layer_name_regex_pattern": r"^(?:qkv|proj)"}, {"layer_name_regex_pattern": "proj"}, "layers such as 'proj'"),
    ({"layer_name_regex_pattern": ".*(self_attention).*"}, {"layer_name_regex_pattern": ".*(mlp).*"}, None),
]


@pytest.mark.parametrize(("first", "second", "which"), WITNESSED)
def test_possible_overlaps_are_warnings_with_a_witness_and_the_witness_really_fails(loaded, first, second, which):
    """Loading accepts each pair; ``possible_overlaps`` names a layer both select, and routing that very name
    raises the runtime error: the advice is never wrong about the name it gives."""
    assert errors_of(config(first, second)) == []
    (warning,) = possible(config(first, second))
    assert warning.startswith("sections 'first' and 'second' both configure ['base.LogTensorStats'] for ")
    if which is not None:
        assert f" for {which}: routing a layer both select raises an error" in warning
    name = re.search(r"for (?:layers such as '(.*)'|layers \['(.*)'\]):", warning).groups()
    witness = next(n for n in name if n)
    with pytest.raises(ConfigError, match=f"both configure base.LogTensorStats for layer '{re.escape(witness)}'"):
        ConfigManager.get_config_for_layer(witness)


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ({"layer_name_regex_pattern": r"^a\."}, {"layer_name_regex_pattern": r"^b\."}),
        ({"layer_name_regex_pattern": r"fc1$"}, {"layer_name_regex_pattern": r"fc2$"}),
        ({"exact_layer_names": ["model.fc1"]}, {"layer_name_regex_pattern": "fc2"}),
        ({"exact_layer_names": ["model.fc1"]}, {"exact_layer_names": ["model.fc2"]}),
        ({"layer_numbers": [1]}, {"layer_types": ["fc2"]}),  # names decide: checked at routing (and --layers-from)
    ],
)
def test_selectors_that_show_no_overlap_give_no_warning(loaded, first, second):
    assert errors_of(config(first, second)) == [] and possible(config(first, second)) == []


def test_a_disabled_section_configures_nothing(loaded):
    assert possible(config({"layer_name_regex_pattern": ".*"}, {"exact_layer_names": ["x"]}, second_enabled=False)) == []


def test_the_same_feature_spelt_twice_or_disabled_still_claims_the_layer(loaded):
    cfg = config({"layer_name_regex_pattern": ".*"}, {"exact_layer_names": ["x"]})
    del cfg["second"]["LogTensorStats"]
    cfg["second"]["base"] = {"LogTensorStats": dict(LTS)}  # the same feature, another spelling: still one feature
    assert len(possible(cfg)) == 1
    cfg["first"]["LogTensorStats"]["enabled"] = False  # configured, though disabled: still claims the layer
    assert len(possible(cfg)) == 1


def test_initialize_warns_once_about_overlaps_certain_by_construction(tmp_path):
    """The same selector twice, or one exact name in two sections: loaded, said once in the debug log and as a
    warning; a pair that only regexes could make overlap is not said at initialize (validate says it)."""
    cfg = {
        **config({"exact_layer_names": ["model.fc1", "model.fc2"]}, {"exact_layer_names": ["model.fc2"]}),
        "third": {"enabled": True, "layers": {"layer_types": ["qkv"]}, "LogTensorStats": dict(LTS)},
        "fourth": {"enabled": True, "layers": {"layer_types": ["qkv"]}, "LogTensorStats": dict(LTS)},
        "fifth": {"enabled": True, "layers": {"layer_name_regex_pattern": "proj"}, "LogTensorStats": dict(LTS)},
    }
    with pytest.warns(UserWarning) as caught:
        debug_api.initialize(config_file=cfg, log_dir=str(tmp_path))
    debug_api.end_debug()
    said = [str(w.message) for w in caught if "both configure" in str(w.message)]
    assert said == [
        "config dict: sections 'first' and 'second' both configure ['base.LogTensorStats'] for layer 'model.fc2': "
        "routing a layer both select raises an error (a layer may get each feature from one section only); merge "
        "the two sections or narrow one's selector",
        "config dict: sections 'third' and 'fourth' both configure ['base.LogTensorStats'] for the same layers: "
        "routing a layer both select raises an error (a layer may get each feature from one section only); merge "
        "the two sections or narrow one's selector",
    ]
    log = main_log_path(tmp_path).read_text()
    assert all(log.count(message) == 1 for message in said)


def test_initialize_never_compares_selectors_pairwise(tmp_path, monkeypatch):
    """Loading 2,000 regex sections of one feature matches no layer name and builds no witness: its time grows with
    the sections, not their pairs (benchmarks/host_cost.py times 6,000)."""
    calls = []
    monkeypatch.setattr(LayerSpec, "matches", lambda self, *args: calls.append(args) or False)
    sections = {
        f"s{i}": {"enabled": True, "layers": {"layer_name_regex_pattern": rf"layers\.{i}\.fc1$"}, "LogTensorStats": dict(LTS)}
        for i in range(2000)
    }
    debug_api.initialize(config_file=sections, log_dir=str(tmp_path))
    debug_api.end_debug()
    assert calls == []


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


def test_validate_warns_about_possible_overlaps_and_accepts_the_config(tmp_path, capsys):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(reference_config()))
    assert main(["validate", str(path)]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[-1] == f"{path}: valid, 3 warnings"
    warned = err.splitlines()
    assert len(warned) == 3 and all(line.startswith(f"{path}: warning: sections 'stat_collection_") for line in warned)
    assert any("'stat_collection_2' and 'stat_collection_3'" in line and "mlpfc2" in line for line in warned)


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
