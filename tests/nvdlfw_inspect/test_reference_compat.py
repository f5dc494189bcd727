"""What code written for the reference framework (Transformer Engine, NeMo, the reference's own tests) uses:
``is_layer_in_cfg``, ``ConfigSpec()`` + ``initialize``/``reset``, ``import_and_exec_module``, unknown
``initialize`` keywords, ``root_log_dir``, the statistics directory layout, the logger classes,
``gather_along_first_dim(..., process_group=)`` and ``DEBUG_MANAGER._trainer_iteration_count``."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from logreader import main_log_path, read_messages, read_stats, stats_log_path, stats_records_path
from spawning import spawn

import nvdlfw_inspect
import nvdlfw_inspect.api as debug_api
from nvdlfw_inspect.config_manager import ConfigManager, ConfigSpec, is_layer_in_cfg
from nvdlfw_inspect.errors import ConfigError, FeatureLoadError
from nvdlfw_inspect.logging import (
    STATISTICS_LOG_DIR,
    STATISTICS_RECORDS_DIR,
    BaseLogger,
    MetricLogger,
    get_logger,
    wrap_tensorboard_writer,
)
from nvdlfw_inspect.reading import iter_statistics
from nvdlfw_inspect.registry import Registry
from nvdlfw_inspect.report import write_report
from nvdlfw_inspect.utils import gather_along_first_dim, import_and_exec_module

CONFIG = {
    "s": {
        "enabled": True,
        "layers": {"layer_types": ["fc"]},
        "LogTensorStats": {"enabled": True, "stats": ["min", "max"], "tensors": ["activation"]},
    }
}


@pytest.fixture(autouse=True)
def _clean_registry_and_config():
    """Registrations and layer types made outside ``initialize`` are not undone by ``end_debug``."""
    yield
    Registry.reset()
    ConfigManager.reset()


class ListLogger(BaseLogger):
    def __init__(self):
        self.records: list[tuple[str, float, int]] = []

    def log_scalar(self, name, value, iteration, **kwargs):
        self.records.append((name, float(value), iteration))


def log_steps(steps: int, value: float = 1.0) -> None:
    for _ in range(steps):
        debug_api.log_tensor_stats("net.fc1", tensor=torch.tensor([-value, value / 3]), tensor_name="activation")
        debug_api.step()


# --- ConfigSpec() and is_layer_in_cfg ---------------------------------------------------------


def spec_of(layers: dict) -> ConfigSpec:
    spec = ConfigSpec()
    spec.initialize({"enabled": True, "layers": layers})
    return spec


@pytest.mark.parametrize(
    ("layers", "selected", "not_selected"),
    [
        ({"layer_numbers": ["2-4"], "layer_types": ["fc2"]}, ["model.layers.3.mlp.fc2"], ["model.layers.3.mlp.fc1", "m.5.fc2"]),
        ({"layer_numbers": [7]}, ["decoder.7.attn.qkv", "decoder.7.mlp.fc1"], ["decoder.17.attn.qkv"]),
        ({"layer_types": ["qkv", "proj"]}, ["decoder.1.attn.qkv", "decoder.9.attn.proj"], ["decoder.1.mlp.fc1"]),
        ({"layer_numbers": ["all"], "layer_types": ["all"]}, ["decoder.1.mlp.fc1", "head"], []),
        ({"layer_name_regex_pattern": r"\.2\..*fc"}, ["decoder.2.mlp.fc1"], ["decoder.12.mlp.fc1", "decoder.2.attn.qkv"]),
        ({"exact_layer_names": ["a.b"]}, ["a.b"], ["a.c"]),  # the reference raises for a name not listed
    ],
)
def test_is_layer_in_cfg_with_a_spec_built_empty_then_initialized(layers, selected, not_selected):
    spec = spec_of(layers)
    assert spec.enabled is True and spec.extension_config == {}
    assert all(is_layer_in_cfg(name, spec) for name in selected)
    assert not any(is_layer_in_cfg(name, spec) for name in not_selected)


def test_is_layer_in_cfg_sees_declared_layer_types():
    spec = spec_of({"layer_types": ["Linear"]})
    assert not is_layer_in_cfg("net.0", spec)
    ConfigManager.set_layer_types("net.0", "Linear")
    assert is_layer_in_cfg("net.0", spec)


def test_is_layer_in_cfg_agrees_with_get_config_for_layer(log_dir):
    config = dict(CONFIG, t={**CONFIG["s"], "layers": {"layer_numbers": [3], "layer_types": ["qkv"]}})
    debug_api.initialize(config, log_dir=log_dir)
    specs = list(ConfigManager.configs.values())
    assert [spec.name for spec in specs] == ["s", "t"]  # the loader still builds named specs
    for name in ("m.1.fc1", "m.3.attn.qkv", "m.4.attn.qkv", "m.3.attn.proj"):
        chosen = [spec.name for spec in specs if is_layer_in_cfg(name, spec)]
        assert bool(chosen) == bool(ConfigManager.get_config_for_layer(name)), name


def test_spec_reset_empties_it_and_it_can_be_initialized_again():
    spec = spec_of({"layer_numbers": [1]})
    spec.reset()
    assert spec.layer_spec is None and spec.extension_config == {}
    with pytest.raises(ValueError, match=r"no layer selector: call spec.initialize\(section\) first"):
        is_layer_in_cfg("m.1.fc1", spec)
    spec.initialize({"enabled": False, "layers": {"layer_numbers": [2]}})
    assert spec.enabled is False and is_layer_in_cfg("m.2.fc1", spec) and not is_layer_in_cfg("m.1.fc1", spec)


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"enabled": True}, "missing required key 'layers'"),
        ({"layers": {"layer_numbers": [1]}}, "missing required key 'enabled'"),
        ({"enabled": "yes", "layers": {"layer_numbers": [1]}}, "key 'enabled': must be a boolean"),
        ({"enabled": True, "layers": {"layer_number": [1]}}, "unknown layer selector"),
        ({"enabled": True, "layers": {"layer_numbers": ["3-1"]}}, "range start is greater than its end"),
        (["enabled"], "a section must be a mapping"),
    ],
)
def test_spec_initialize_rejects_bad_sections(section, message):
    with pytest.raises(ConfigError, match=message):
        ConfigSpec().initialize(section)


def test_is_layer_in_cfg_rejects_wrong_types():
    with pytest.raises(TypeError, match="layer_name must be a string"):
        is_layer_in_cfg(3, spec_of({"layer_numbers": [3]}))
    with pytest.raises(TypeError, match="spec must be a ConfigSpec, got dict"):
        is_layer_in_cfg("m.3", {"layers": {"layer_numbers": [3]}})


# --- import_and_exec_module ---------------------------------------------------------------------

FEATURE_FILE = """
import compat_sibling
from nvdlfw_inspect.base import BaseNamespaceAPI
from nvdlfw_inspect.registry import Registry, api_method


@Registry.register_namespace_api(namespace="compat_ns")
class CompatAPI(BaseNamespaceAPI):
    def input_assertions_hook(self, api_name, **kwargs):
        pass

    def routing_condition(self, api_name, config, layer_name, feature_obj, **kwargs):
        return True, None

    def output_assertions_hook(self, api_name, ret, **kwargs):
        pass

    def is_multiple_feature_invocation_allowed(self, api_name):
        return False


@Registry.register_feature(namespace="compat_ns")
class CompatFeature:
    @api_method
    def probe(self, config, layer_name, **kwargs):
        return compat_sibling.VALUE
"""


@pytest.fixture
def feature_file(tmp_path):
    (tmp_path / "compat_sibling.py").write_text("VALUE = 42\n")
    path = tmp_path / "compat_feature.py"
    path.write_text(FEATURE_FILE)
    yield path
    sys.modules.pop("compat_sibling", None)


def test_import_and_exec_module_runs_the_file_every_time(feature_file):
    path_before = list(sys.path)
    first = import_and_exec_module(str(feature_file))
    assert "compat_ns" in Registry.data and "CompatFeature" in Registry.data["compat_ns"].features
    assert Registry.data["compat_ns"].feat_api_to_features["probe"] == ["CompatFeature"]
    Registry.reset()
    second = import_and_exec_module(feature_file)  # a Path works too
    assert "CompatFeature" in Registry.data["compat_ns"].features  # registered again: the file ran again
    assert first is not second and first.__name__ == "compat_feature" and "compat_feature" not in sys.modules
    assert second.compat_sibling.VALUE == 42  # the file beside it was importable while it ran
    assert sys.path == path_before


def test_import_and_exec_module_errors_name_the_file(tmp_path):
    path_before = list(sys.path)
    with pytest.raises(FeatureLoadError, match="module file not found: .*missing.py"):
        import_and_exec_module(tmp_path / "missing.py")
    broken = tmp_path / "broken.py"
    broken.write_text("raise KeyError('boom')\n")
    with pytest.raises(FeatureLoadError, match=r"broken.py' failed to run: KeyError: 'boom'"):
        import_and_exec_module(broken)
    assert sys.path == path_before


# --- initialize: unknown keywords, root_log_dir ----------------------------------------------------


def test_unknown_initialize_keywords_are_ignored_with_one_warning(log_dir, capsys):
    debug_api.initialize(CONFIG, log_dir=log_dir, multi_tensor_stat_collection=True, zeta=1)
    assert debug_api.DEBUG_MANAGER is not None
    warnings = [text for level, text in read_messages(log_dir) if level == "WARNING"]
    assert len(warnings) == 1
    assert "unknown keyword arguments ['multi_tensor_stat_collection', 'zeta']" in warnings[0]
    assert capsys.readouterr().err.count("unknown keyword arguments") == 1


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"strict_logging": "yes"}, TypeError, "strict_logging must be True or False"),
        ({"collective_timeout": 0}, ValueError, "collective_timeout must be a positive number"),
        ({"tb_writer": object()}, TypeError, "tb_writer must have an add_scalar method"),
    ],
)
def test_known_initialize_keywords_with_bad_values_are_still_errors(log_dir, kwargs, error, message):
    with pytest.raises(error, match=message):
        debug_api.initialize(CONFIG, log_dir=log_dir, unknown_too=1, **kwargs)
    assert debug_api.DEBUG_MANAGER is None


def test_root_log_dir_is_the_log_dir_given_to_initialize(log_dir):
    debug_api.initialize(CONFIG, log_dir=log_dir)
    logger = get_logger()
    assert logger.root_log_dir == logger.log_dir == str(log_dir)
    assert main_log_path(log_dir).parent == Path(logger.root_log_dir) / "nvdlfw_inspect_logs"


# --- the statistics directory layout -------------------------------------------------------------


def test_statistics_directory_holds_the_text_logs_only(log_dir):
    debug_api.initialize(CONFIG, log_dir=log_dir)
    log_steps(2)
    debug_api.end_debug()
    assert [p.name for p in (log_dir / STATISTICS_LOG_DIR).iterdir()] == ["nvdlfw_inspect_globalrank-0.log"]
    assert [p.name for p in (log_dir / STATISTICS_RECORDS_DIR).iterdir()] == ["nvdlfw_inspect_globalrank-0.jsonl"]
    assert stats_records_path(log_dir).parent.name == STATISTICS_RECORDS_DIR == "nvdlfw_inspect_statistics_jsonl"
    values = {(s.stat, s.iteration): s.value for s in iter_statistics(log_dir)}
    third = float(torch.tensor(1 / 3))
    assert values == {("min", 0): -1.0, ("max", 0): third, ("min", 1): -1.0, ("max", 1): third}  # full precision
    assert read_stats(log_dir)[("net.fc1_activation_max", 1)] == 0.3333


def test_runs_of_the_old_layout_are_still_read(log_dir, tmp_path):
    debug_api.initialize(CONFIG, log_dir=log_dir)
    log_steps(2)
    debug_api.end_debug()
    new = sorted(iter_statistics(log_dir))
    old_place = log_dir / STATISTICS_LOG_DIR / "nvdlfw_inspect_globalrank-0.jsonl"
    stats_records_path(log_dir).rename(old_place)  # records beside the text logs, as earlier versions wrote them
    shutil.rmtree(log_dir / STATISTICS_RECORDS_DIR)
    assert sorted(iter_statistics(log_dir)) == new
    frame = nvdlfw_inspect.read_stats(log_dir)
    assert len(frame) == 4 and frame.value.min() == -1.0
    assert write_report(log_dir, tmp_path / "r.html").exists()


def test_records_of_the_new_layout_win_over_stale_old_ones(log_dir):
    debug_api.initialize(CONFIG, log_dir=log_dir)
    log_steps(1)
    debug_api.end_debug()
    stale = {"layer": "old", "tensor": "activation", "stat": "max", "iteration": 0, "value": 9.0}
    (log_dir / STATISTICS_LOG_DIR / "nvdlfw_inspect_globalrank-0.jsonl").write_text(json.dumps(stale) + "\n")
    assert {s.layer for s in iter_statistics(log_dir)} == {"net.fc1"}


def test_no_statistics_directory_is_an_error_naming_both(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"neither .*{STATISTICS_RECORDS_DIR}.* nor .*{STATISTICS_LOG_DIR}.* exists"):
        list(iter_statistics(tmp_path))


# --- loggers -------------------------------------------------------------------------------------


def test_metric_logger_fans_out_to_added_loggers_and_the_file(log_dir):
    debug_api.initialize(CONFIG, log_dir=log_dir)
    extra = ListLogger()
    MetricLogger.add_logger(extra)
    MetricLogger.log_scalar("custom_metric", torch.tensor(1.5), 3)
    MetricLogger.flush()
    assert extra.records == [("custom_metric", 1.5, 3)]
    assert read_stats(log_dir) == {("custom_metric", 3): 1.5}


def test_base_logger_subclass_as_statistics_logger_gets_every_statistic(log_dir):
    logger = ListLogger()
    debug_api.initialize(CONFIG, log_dir=log_dir, statistics_logger=logger)
    log_steps(2)
    assert sorted(logger.records) == [
        ("net.fc1_activation_max", pytest.approx(1 / 3), 0),
        ("net.fc1_activation_max", pytest.approx(1 / 3), 1),
        ("net.fc1_activation_min", -1.0, 0),
        ("net.fc1_activation_min", -1.0, 1),
    ]
    assert not stats_log_path(log_dir).exists()  # another logger given: no file unless default_logging_enabled


def test_base_logger_needs_log_scalar_and_statistics_logger_must_be_one(log_dir):
    class Incomplete(BaseLogger):
        pass

    with pytest.raises(TypeError, match="abstract"):
        Incomplete()
    with pytest.raises(TypeError, match="statistics_logger must be an instance of nvdlfw_inspect.logging.BaseLogger"):
        debug_api.initialize(CONFIG, log_dir=log_dir, statistics_logger=object())


def test_wrap_tensorboard_writer_gives_a_base_logger():
    class Writer:
        def __init__(self):
            self.scalars = []

        def add_scalar(self, name, value, step):
            self.scalars.append((name, value, step))

    writer = Writer()
    logger = wrap_tensorboard_writer(writer)
    assert isinstance(logger, BaseLogger)
    logger.log_scalar("a_activation_max", torch.tensor(2.5), 7)
    assert writer.scalars == [("a_activation_max", 2.5, 7)]


# --- the iteration counter Transformer Engine reads -----------------------------------------------


def test_trainer_iteration_count_follows_steps_and_resets(log_dir):
    debug_api.initialize(CONFIG, log_dir=log_dir, init_training_step=7)
    assert debug_api.DEBUG_MANAGER._trainer_iteration_count == 7
    log_steps(1)
    assert debug_api.DEBUG_MANAGER._trainer_iteration_count == 8
    debug_api.initialize_training_step(20)
    assert debug_api.DEBUG_MANAGER._trainer_iteration_count == 20
    log_steps(1)
    debug_api.end_debug()
    assert sorted(read_stats(log_dir)) == [("net.fc1_activation_max", 7), ("net.fc1_activation_max", 20)] + [
        ("net.fc1_activation_min", 7),
        ("net.fc1_activation_min", 20),
    ]


# --- gather_along_first_dim(..., process_group=) on two ranks -------------------------------------


def gather_in_subgroup(rank: int, world: int, out_dir: Path) -> None:
    """Each rank gives ``rank + 1`` in rows of its own; the group is passed by keyword, as TE does."""
    group = dist.new_group(list(range(world)))
    gathered, handle = gather_along_first_dim(torch.full((2, 3), float(rank + 1)), process_group=group)
    torch.save({"gathered": gathered, "handle": handle}, out_dir / f"rank{rank}.pt")


def test_gather_along_first_dim_with_a_process_group(tmp_path):
    out_dir = spawn(Path(__file__), "gather_in_subgroup", 2, tmp_path)
    expected = torch.tensor([1.0, 1.0, 2.0, 2.0]).unsqueeze(1).expand(4, 3)
    for rank in range(2):
        saved = torch.load(out_dir / f"rank{rank}.pt")
        assert torch.equal(saved["gathered"], expected) and saved["handle"] is None
