"""The user-facing API: lifecycle, dispatch, messages, layer naming, reduction group, step counter."""

from __future__ import annotations

import logging

import pytest
import torch
from logreader import read_messages, read_stats

import nvdlfw_inspect.api as debug_api
from nvdlfw_inspect.config_manager import ConfigManager
from nvdlfw_inspect.errors import AlreadyInitializedError, NotInitializedError, UnknownAPIError
from nvdlfw_inspect.logging import LogFileHandler, MetricLogger, SingleMessageLogger
from nvdlfw_inspect.registry import Registry

STATS_CONFIG = {
    "stats": {
        "enabled": True,
        "layers": {"layer_name_regex_pattern": "^decoder"},
        "LogTensorStats": {"enabled": True, "stats": ["max", "mean"], "tensors": ["activation"]},
    }
}


def own_handlers(name: str) -> list[logging.Handler]:
    """Handlers the framework attached (pytest adds its own capture handlers)."""
    ours = (logging.FileHandler, logging.StreamHandler, LogFileHandler)
    return [h for h in logging.getLogger(name).handlers if type(h) in ours]


def messages(log_dir) -> list[str]:
    return [text for _, text in read_messages(log_dir)]


# --- lifecycle -----------------------------------------------------------------------------


def test_initialize_twice_is_an_error_until_end_debug(log_dir):
    debug_api.initialize(STATS_CONFIG, log_dir=log_dir)
    with pytest.raises(AlreadyInitializedError, match="Already initialized") as info:
        debug_api.initialize(STATS_CONFIG, log_dir=log_dir)
    assert isinstance(info.value, ValueError)
    debug_api.end_debug()
    debug_api.initialize(STATS_CONFIG, log_dir=log_dir)
    assert debug_api.DEBUG_MANAGER is not None


def test_unknown_initialize_kwarg_is_ignored_with_a_warning_and_extensions_is_accepted(log_dir):
    debug_api.initialize(STATS_CONFIG, log_dir=log_dir, tb_writter=None)
    warnings = [text for level, text in read_messages(log_dir) if level == "WARNING"]
    assert len(warnings) == 1 and "unknown keyword arguments ['tb_writter']" in warnings[0]
    debug_api.end_debug()
    debug_api.initialize(STATS_CONFIG, log_dir=log_dir, extensions=["x"])
    assert ("WARNING", "initialize(extensions=...) is accepted for compatibility and has no effect.") in read_messages(log_dir)


def test_failed_initialize_leaves_nothing_behind(log_dir, tmp_path):
    bad = dict(STATS_CONFIG)
    bad["other"] = {"enabled": True, "layers": {"layer_numbers": [1]}, "NoSuchFeature": {"enabled": True}}
    with pytest.raises(ValueError, match="NoSuchFeature"):
        debug_api.initialize(bad, log_dir=log_dir)
    assert debug_api.DEBUG_MANAGER is None
    assert Registry.data == {}
    assert ConfigManager.configs == {}
    assert MetricLogger.enabled_loggers == []
    assert own_handlers("nvdlfw_inspect") == []
    assert own_handlers("Default Statistics") == []
    # the failure itself was logged before the logs were closed
    assert any(level == "ERROR" and "initialize failed" in text for level, text in read_messages(log_dir))
    debug_api.initialize(STATS_CONFIG, log_dir=tmp_path / "second")
    assert list(Registry.data) == ["base"]


def test_end_debug_resets_everything_and_reinitialize_writes_each_line_once(log_dir, monkeypatch):
    monkeypatch.setenv("NVDLFW_INSPECT_ENABLE_LOG_OVERWRITE", "0")
    for _ in range(3):
        debug_api.initialize(STATS_CONFIG, log_dir=log_dir)
        debug_api.log_message("hello once")
        debug_api.end_debug()
        assert Registry.data == {} and ConfigManager.configs == {} and MetricLogger.enabled_loggers == []
        assert own_handlers("nvdlfw_inspect") == []
    # appended three sessions: one line per session, no duplicated handlers, message not suppressed later
    assert messages(log_dir).count("hello once") == 3
    assert messages(log_dir).count("Reading config from Python dictionary.") == 3


def test_calls_before_initialize(capsys):
    assert debug_api.DEBUG_MANAGER is None
    debug_api.step()
    debug_api.end_debug()
    debug_api.initialize_training_step(4)
    assert not hasattr(debug_api, "transformer_engine")
    with pytest.raises(NotInitializedError, match="Call initialize first") as info:
        debug_api.log_message("x")
    assert isinstance(info.value, RuntimeError)
    for call in (debug_api.list_features, debug_api.get_tensor_reduction_group, lambda: debug_api.explain_features("all")):
        with pytest.raises(NotInitializedError):
            call()
    with pytest.raises(NotInitializedError):
        debug_api.set_tensor_reduction_group(None)
    with pytest.raises(ImportError):
        from nvdlfw_inspect.api import transformer_engine  # noqa: F401


def test_statistics_calls_before_initialize_do_nothing_and_say_so_once(log_dir, recwarn):
    """A script whose debugging is optional calls log_tensor_stats as it calls step(): both do nothing before
    initialize; log_tensor_stats says so once (a forgotten initialize is not silent), then works once initialized."""
    SingleMessageLogger.reset()  # said once until the next session: not by an earlier test
    for _ in range(3):
        assert debug_api.log_tensor_stats("decoder.0", tensor=torch.ones(3), tensor_name="activation") == {}
        debug_api.step()
    assert [str(w.message) for w in recwarn] == [
        "debug_api.log_tensor_stats() before debug_api.initialize() logs nothing and returns {} (a run without debugging "
        "may make these calls); call debug_api.initialize(...) first to log statistics"
    ]
    assert not log_dir.exists()
    debug_api.initialize(config_file=STATS_CONFIG, log_dir=log_dir)
    assert debug_api.log_tensor_stats("decoder.0", tensor=torch.ones(3), tensor_name="activation")["max"] == 1.0
    debug_api.end_debug()
    assert read_stats(log_dir)


def test_no_config_runs_with_a_warning(log_dir):
    debug_api.initialize(log_dir=log_dir)
    assert ("WARNING", "No config given: no feature is active.") in read_messages(log_dir)
    assert debug_api.log_tensor_stats("decoder.1", tensor=torch.ones(3), tensor_name="activation") == {}


def test_config_from_path_logs_reading_and_sections(log_dir, tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(
        "a:\n  enabled: True\n  layers:\n    layer_types: [fc1]\n  LogTensorStats:\n    enabled: True\n"
        "    stats: [min]\n    tensors: [activation]\nb:\n  enabled: False\n"
    )
    debug_api.initialize(str(path), log_dir=log_dir)
    found = messages(log_dir)
    assert f"Reading config from {path}." in found
    assert "Loaded configs for dict_keys(['a', 'b'])." in found
    assert "Default logging to file enabled at " + str(log_dir) in found


# --- dispatch --------------------------------------------------------------------------------


def test_base_api_is_reachable_directly_and_through_the_namespace(log_dir):
    debug_api.initialize(STATS_CONFIG, log_dir=log_dir)
    t = torch.tensor([1.0, 2.0, 6.0])
    direct = debug_api.log_tensor_stats("decoder.0", tensor=t, tensor_name="activation")
    via_ns = debug_api.base.log_tensor_stats(layer_name="decoder.1", tensor=t, tensor_name="activation")
    assert direct == {"max": torch.tensor(6.0), "mean": torch.tensor(3.0)}
    assert via_ns == direct
    debug_api.step()
    stats = read_stats(log_dir)
    assert stats[("decoder.0_activation_max", 0)] == 6.0
    assert stats[("decoder.1_activation_mean", 0)] == 3.0


def test_unknown_names_raise_attribute_errors_with_hints(log_dir):
    debug_api.initialize(STATS_CONFIG, log_dir=log_dir)
    assert not hasattr(debug_api, "no_such_namespace")
    with pytest.raises(UnknownAPIError, match="did you mean 'log_tensor_stats'") as info:
        debug_api.log_tensor_stat  # noqa: B018
    assert isinstance(info.value, ValueError)
    with pytest.raises(AttributeError, match="has no API 'log_tensor_stat'.*did you mean 'log_tensor_stats'"):
        debug_api.base.log_tensor_stat  # noqa: B018


def test_routed_call_accepts_one_positional_argument_only(log_dir):
    debug_api.initialize(STATS_CONFIG, log_dir=log_dir)
    with pytest.raises(TypeError):
        debug_api.log_tensor_stats("decoder.0", torch.ones(2), tensor_name="activation")


def test_missing_required_kwarg_is_reported(log_dir):
    debug_api.initialize(STATS_CONFIG, log_dir=log_dir)
    with pytest.raises(TypeError, match="needs the keyword argument 'tensor_name'"):
        debug_api.log_tensor_stats("decoder.0", tensor=torch.ones(2))


# --- messages -------------------------------------------------------------------------------


def test_log_message_once_per_site_layer_args_and_text(log_dir):
    debug_api.initialize(STATS_CONFIG, log_dir=log_dir)
    for i in range(3):
        debug_api.log_message("same text")
        debug_api.log_message(f"tensor {i % 2}", "layer.a")
        debug_api.log_message("with args", "layer.a", extra_cachable_args=("fprop", i % 2))
    debug_api.log_message("warned", level=logging.WARNING)
    found = read_messages(log_dir)
    texts = [t for _, t in found]
    assert texts.count("same text") == 1
    assert texts.count("LAYER=layer.a: tensor 0") == 1
    assert texts.count("LAYER=layer.a: tensor 1") == 1
    assert texts.count("LAYER=layer.a: with args") == 2
    assert ("WARNING", "warned") in found


def test_log_level_from_environment(log_dir, monkeypatch):
    monkeypatch.setenv("NVDLFW_INSPECT_LOG_LEVEL", "warning")
    debug_api.initialize(STATS_CONFIG, log_dir=log_dir)
    debug_api.log_message("info is filtered")
    debug_api.log_message("warning passes", level=logging.WARNING)
    assert messages(log_dir) == ["warning passes"]


def test_debug_level_shows_routing_lines(log_dir, monkeypatch):
    monkeypatch.setenv("NVDLFW_INSPECT_LOG_LEVEL", "DEBUG")
    debug_api.initialize(STATS_CONFIG, log_dir=log_dir)
    debug_api.log_tensor_stats("decoder.0", tensor=torch.ones(2), tensor_name="activation")
    found = messages(log_dir)
    assert any(m.startswith("Debug API call 'log_tensor_stats' encountered at the line: ") and "test_api.py" in m for m in found)
    assert "Debug API call 'log_tensor_stats' found and the corresponding debug feature 'LogTensorStats' was called." in found


def test_bad_log_level_is_a_clear_error(log_dir, monkeypatch):
    monkeypatch.setenv("NVDLFW_INSPECT_LOG_LEVEL", "LOUD")
    with pytest.raises(ValueError, match="NVDLFW_INSPECT_LOG_LEVEL='LOUD'.*allowed: CRITICAL, ERROR, WARNING, INFO, DEBUG"):
        debug_api.initialize(STATS_CONFIG, log_dir=log_dir)
    assert debug_api.DEBUG_MANAGER is None


# --- features listing -----------------------------------------------------------------------


def test_list_and_explain_features(log_dir, capsys):
    debug_api.initialize(STATS_CONFIG, log_dir=log_dir)
    assert debug_api.list_features() == ["base.LogTensorStats"]
    assert capsys.readouterr().out == "['base.LogTensorStats'] \n"
    debug_api.explain_features("base.LogTensorStats")
    out = capsys.readouterr().out
    assert out.startswith("----- \nfeature: base.LogTensorStats \n")
    assert "Logs statistics of the tensors" in out and "tensors_struct" in out and out.endswith("***** \n")
    debug_api.explain_features(["base.Nope"])
    assert "feature: base.Nope is not supported in this tool." in capsys.readouterr().out
    debug_api.explain_features()
    assert capsys.readouterr().out.startswith("No feature provided.")
    debug_api.explain_features(3)
    assert capsys.readouterr().out.startswith("Invalid type is provided to the features argument.")
    debug_api.explain_features("all")
    assert capsys.readouterr().out.count("feature: ") == 1


# --- layer names ----------------------------------------------------------------------------


class Block(torch.nn.Module):
    def __init__(self, number: int | None = None):
        super().__init__()
        self.fc1 = torch.nn.Linear(2, 2)
        if number is not None:
            self.layer_number = number


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(2, 2)
        self.layers = torch.nn.ModuleList([Block(7), Block()])


class Wrapper:
    def __init__(self, module):
        self.module = module


def test_infer_and_assign_layer_names(log_dir):
    debug_api.initialize(STATS_CONFIG, log_dir=log_dir)
    net = Net()
    debug_api.infer_and_assign_layer_names(Wrapper(net))
    assert net.name == "model"
    assert net.embed.name == "model.embed"
    assert net.layers[0].name == "model.layers.7"
    assert net.layers[0].fc1.name == "model.layers.7.fc1"
    assert net.layers[1].fc1.name == "model.layers.1.fc1"
    assert not hasattr(net.layers, "name")
    assert "Assigned layer name: model.layers.1.fc1" in messages(log_dir)
    other = Net()
    debug_api.infer_and_assign_layer_names([other])
    assert other.layers[1].name == "model.layers.1"
    with pytest.raises(TypeError, match="not an nn.Module and has no .module"):
        debug_api.infer_and_assign_layer_names(object())


def test_layer_names_can_be_assigned_before_initialize():
    net = Net()
    debug_api.infer_and_assign_layer_names(net)
    assert net.layers[0].fc1.name == "model.layers.7.fc1"


# --- reduction group and step counter -------------------------------------------------------


def test_reduction_group_is_stored_and_announced(log_dir):
    debug_api.initialize(STATS_CONFIG, log_dir=log_dir)
    assert debug_api.get_tensor_reduction_group() is None
    marker = object()
    debug_api.set_tensor_reduction_group(marker)
    assert debug_api.get_tensor_reduction_group() is marker
    warnings = [t for level, t in read_messages(log_dir) if level == "WARNING"]
    assert any(t.startswith("Reduction group initialized for tensor reduction") for t in warnings)


def test_step_counter(log_dir):
    debug_api.initialize(STATS_CONFIG, log_dir=log_dir, init_training_step=65)
    debug_api.step()
    assert debug_api.DEBUG_MANAGER._trainer_iteration_count == 66
    debug_api.log_tensor_stats("decoder.0", tensor=torch.ones(2), tensor_name="activation")
    debug_api.initialize_training_step(3)
    debug_api.log_tensor_stats("decoder.0", tensor=torch.ones(2), tensor_name="activation")
    debug_api.step()
    assert set(read_stats(log_dir)) == {(f"decoder.0_activation_{s}", i) for s in ("max", "mean") for i in (66, 3)}
    with pytest.raises(ValueError, match="train_step must be a non-negative integer"):
        debug_api.initialize_training_step(-1)


def test_paused_records_nothing_nests_and_ends_with_its_block_also_on_error(log_dir):
    """Statistics calls inside paused() (directly or through the namespace) record nothing and return {}; the pause
    nests, survives an inner block's end, ends with the outermost block even when it raises, and leaves the
    iteration counter alone. Outside it the step's statistics are those of the calls made outside only."""
    with debug_api.paused():  # before initialize: nothing to pause
        pass
    debug_api.initialize(STATS_CONFIG, log_dir=log_dir)
    assert not debug_api.DEBUG_MANAGER.paused
    debug_api.log_tensor_stats("decoder.0", tensor=torch.ones(3), tensor_name="activation")
    with debug_api.paused():
        with debug_api.paused():
            assert debug_api.log_tensor_stats("decoder.0", tensor=torch.full((3,), 100.0), tensor_name="activation") == {}
        assert debug_api.DEBUG_MANAGER.paused
        assert (
            debug_api.base.log_tensor_stats(layer_name="decoder.0", tensor=torch.full((3,), -7.0), tensor_name="activation") == {}
        )
    assert not debug_api.DEBUG_MANAGER.paused
    with pytest.raises(RuntimeError, match="inside"), debug_api.paused():
        raise RuntimeError("inside")
    assert not debug_api.DEBUG_MANAGER.paused
    assert debug_api.DEBUG_MANAGER._trainer_iteration_count == 0
    debug_api.log_tensor_stats("decoder.0", tensor=torch.full((3,), 3.0), tensor_name="activation")
    debug_api.step()
    assert read_stats(log_dir) == {("decoder.0_activation_max", 0): 3.0, ("decoder.0_activation_mean", 0): 2.0}


def test_a_pause_entered_in_one_run_does_not_pause_the_next(log_dir):
    debug_api.initialize(STATS_CONFIG, log_dir=log_dir)
    with debug_api.paused():
        debug_api.end_debug()
        debug_api.initialize(STATS_CONFIG, log_dir=log_dir)
        assert not debug_api.DEBUG_MANAGER.paused
    assert debug_api.log_tensor_stats("decoder.0", tensor=torch.ones(3), tensor_name="activation")["max"] == 1.0


def test_bad_init_training_step(log_dir):
    with pytest.raises(ValueError, match="init_training_step must be a non-negative integer, got 'x'"):
        debug_api.initialize(STATS_CONFIG, log_dir=log_dir, init_training_step="x")
    assert debug_api.DEBUG_MANAGER is None
