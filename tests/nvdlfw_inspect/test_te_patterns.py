"""Code written against the reference framework as Transformer Engine writes its debug features
(``te_patterns/``: subclasses of the base ``LogTensorStats`` with their own statistics, a namespace API
overriding ``BaseNamespaceAPI`` as TE's does, a feature writing below ``root_log_dir``) runs on ours; and
which registration wins when a directory is loaded twice or beside lowprec's ``transformer_engine``."""

from __future__ import annotations

import importlib
import shutil
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch
from inspect_ns_factory import Namespace, unique, write_namespace

import lowprec  # imported here, not in a test: importing registers its directory for every initialize
import nvdlfw_inspect.api as debug_api
from nvdlfw_inspect import feature_loading
from nvdlfw_inspect.errors import ConfigError
from nvdlfw_inspect.logging import BaseLogger
from nvdlfw_inspect.registry import RegistrationWarning, Registry

TE_PATTERNS = Path(__file__).parent / "te_patterns"
LAYER = "model.fc1"
QUANTIZER = SimpleNamespace(recipe="fp8_current_scaling", step=0.5)

CONFIG = """
stats:
  enabled: True
  layers:
    layer_name_regex_pattern: .*fc1
  transformer_engine:
    LogExtraStats:
      enabled: True
      tensors: activation
      stats:
        - mean
        - cur_amax
        - dynamic_range
        - max_blockwise_dynamic_range:
            block_size: 4
            dims: 1
    LogQuantStats:
      enabled: True
      tensors_struct:
        - tensor: activation
          stats: [underflows%, mse, scale_inv_min, mxfp8_underflows%, fp8_delayed_scaling_overflows%,
                  mxfp8_scale_inv_max_columnwise]
          freq: 2
    LogFp4Stats:
      enabled: True
      tensors: [activation]
      stats: [underflows%, mse]
    LogListedStats:
      enabled: True
      tensors: [activation]
      stats: [underflows%]
"""


class Collect(BaseLogger):
    def __init__(self) -> None:
        self.rows: dict[tuple[str, int], float] = {}

    def log_scalar(self, name: str, value: float, iteration: int, **kwargs: object) -> None:
        self.rows[(name, iteration)] = value


def start(tmp_path: Path, config: str, dirs: list[Path] | None = None, **kwargs: object) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(config)
    config_file = str(path) if config else ""
    debug_api.initialize(
        config_file=config_file, feature_dirs=[TE_PATTERNS] if dirs is None else dirs, log_dir=str(tmp_path / "logs"), **kwargs
    )
    return path


def patterns_module(name: str) -> object:
    """A module of ``te_patterns`` as the loader loaded it (under a private name)."""
    (module,) = [m for m in list(sys.modules.values()) if getattr(m, "__file__", None) == str(TE_PATTERNS / f"{name}.py")]
    return module


def inspect(tensor: torch.Tensor, layer: str = LAYER) -> None:
    """One layer's inspection as TE's layers run it: ask the routing call, then inspect."""
    iteration = debug_api.DEBUG_MANAGER._trainer_iteration_count
    te = debug_api.transformer_engine
    if te.inspect_tensor_enabled(layer_name=layer, tensor_name="activation", iteration=iteration)[0]:
        te.inspect_tensor(
            layer_name=layer,
            tensor_name="activation",
            iteration=iteration,
            tp_group=None,
            tp_size=1,
            tensor=tensor,
            rowwise_quantized_tensor=None,
            columnwise_quantized_tensor=None,
            quantizer=QUANTIZER,
        )


def underflows(x: torch.Tensor, step: float) -> float:
    q = torch.round(x / step) * step
    return (((x != 0) & (q == 0)).sum() / x.numel() * 100).item()


# --- statistics subclasses end to end -------------------------------------------------------


def test_statistics_subclasses_end_to_end(tmp_path):
    collect = Collect()
    start(tmp_path, CONFIG, statistics_logger=collect)
    tensors = [torch.linspace(-2.0, 2.0, 16) * (it + 1) for it in range(3)]
    for t in tensors:
        inspect(t)
        inspect(t, layer="model.fc2")  # not selected: the defaults answer
        debug_api.step()
    for it, t in enumerate(tensors):
        row = {name.removeprefix(f"{LAYER}_activation_"): value for (name, i), value in collect.rows.items() if i == it}
        assert row["mean"] == pytest.approx(t.mean().item())
        assert row["cur_amax"] == pytest.approx(t.abs().max().item())
        assert row["dynamic_range"] == pytest.approx((torch.log2(t.abs().max()) - torch.log2(t.abs()[t != 0].min())).item())
        assert "max_blockwise_dynamic_range_block_size_4_dims_1" in row
        assert row["fp4_underflows%"] == pytest.approx(underflows(t, 1.0)) and "fp4_mse" in row
        assert row["listed_underflows%"] == pytest.approx(underflows(t, 0.5))  # logged at the trainer's step
        quant = {"underflows%", "mse", "scale_inv_min", "mxfp8_underflows%", "fp8_delayed_scaling_overflows%"}
        assert quant <= set(row) if it % 2 == 0 else not quant & set(row)  # freq: 2
    assert collect.rows[(f"{LAYER}_activation_mxfp8_underflows%", 0)] == pytest.approx(underflows(tensors[0], 0.25))
    assert collect.rows[(f"{LAYER}_activation_mxfp8_scale_inv_max_columnwise", 2)] == 0.25
    assert not any(name.startswith("model.fc2") for name, _ in collect.rows)


BAD_STATS = [
    ("LogExtraStats", "[median]", r"stats.0': unsupported statistic \(_is_supported_stat says no\); got 'median'"),
    ("LogExtraStats", "[{max_blockwise_dynamic_range: {block_size: 0}}]", "stats.0': unsupported statistic"),
    ("LogExtraStats", "[{max_blockwise_dynamic_range: {}, mean: {}}]", "stats.0': unsupported statistic: must be a statistic"),
    (
        "LogFp4Stats",
        "[underflows%, overflows%]",
        r"stats.1': unsupported statistic \(check_if_stat_is_supported: ValueError: .*FP4",
    ),
    ("LogListedStats", "[mean]", "stats.0': unsupported statistic; got 'mean'; allowed: 'underflows%'"),
    ("LogListedStats", "[{underflows%: 1}]", "stats.0': unsupported statistic: must be"),
    ("LogQuantStats", "[3]", "stats.0': unsupported statistic: must be a statistic name"),
    ("LogQuantStats", "underflows%", "stats': must be a non-empty list"),
]


@pytest.mark.parametrize(("feature", "stats", "message"), BAD_STATS)
def test_bad_statistics_fail_initialize_naming_file_key_and_value(tmp_path, feature, stats, message):
    config = f"s:\n  enabled: True\n  layers:\n    layer_numbers: [1]\n  transformer_engine:\n    {feature}:\n"
    config += f"      enabled: True\n      tensors: [activation]\n      stats: {stats}\n"
    with pytest.raises(ConfigError, match=message) as info:
        start(tmp_path, config)
    assert str(tmp_path / "config.yaml") in str(info.value) and f"s.transformer_engine.{feature}.stats" in str(info.value)


def test_statistic_needing_the_recipe_is_judged_at_the_call(tmp_path):
    config = CONFIG.replace("[underflows%, mse, scale_inv_min,", "[bogus_stat, mse, scale_inv_min,")
    start(tmp_path, config)  # LogQuantStats' check needs the call's recipe: initialize accepts the name
    with pytest.raises(ValueError, match="unsupported stat name: bogus_stat") as info:
        inspect(torch.ones(8))
    assert "LogQuantStats" in "".join(info.value.__notes__)


def test_base_feature_keeps_its_strict_list(tmp_path):
    config = "s:\n  enabled: True\n  layers:\n    layer_numbers: [1]\n  LogTensorStats:\n    enabled: True\n"
    config += "    tensors: [activation]\n    stats: [{max_blockwise_dynamic_range: {block_size: 4}}]\n"
    with pytest.raises(ConfigError, match="LogTensorStats.stats.0': unsupported statistic: must be a statistic name"):
        start(tmp_path, config)


# --- the namespace API as TE writes it ----------------------------------------------------


def test_namespace_api_hooks_as_te_uses_them(tmp_path):
    config = CONFIG + "    DumpTensors:\n      enabled: True\n      tensors: [activation]\n      high_precision_tensor: True\n"
    start(tmp_path, config)
    events = patterns_module("te_api").EVENTS
    events.clear()
    te = debug_api.transformer_engine
    assert te.fp8_gemm_enabled(layer_name=LAYER, gemm="fprop", iteration=0) == (True, None)  # _default_api_impl
    # several features answer: combined by the override, whose other APIs go to super() (all outputs equal)
    assert te.inspect_tensor_enabled(layer_name=LAYER, tensor_name="activation", iteration=1) == (True, 2)
    assert te.inspect_tensor(layer_name=LAYER, tensor_name="activation", iteration=1, tp_group=None, tensor=torch.ones(4)) is None
    assert te.inspect_tensor_enabled(layer_name="other", tensor_name="activation", iteration=0) == (False, None)
    debug_api.step()
    debug_api.end_debug()
    assert events == ["step", "end_debug"]


def test_feature_writes_below_root_log_dir(tmp_path):
    config = "d:\n  enabled: True\n  layers:\n    layer_name_regex_pattern: .*\n  transformer_engine:\n    DumpTensors:\n"
    config += "      enabled: True\n      tensors: [activation]\n      high_precision_tensor: True\n"
    start(tmp_path, config)
    t = torch.arange(6.0)
    inspect(t)
    saved = torch.load(tmp_path / "logs" / "tensor_dumps" / "rank_0" / "iter_000000" / f"{LAYER}_activation.pt")
    assert torch.equal(saved["high_precision"], t)


def test_append_parent_docstring_with_parent_keyword(tmp_path):
    start(tmp_path, "")
    doc = Registry.data["transformer_engine"].features["DumpTensors"].__doc__
    assert doc.startswith("Saves the high-precision tensor") and "Tensor selection: ``tensors: [names]``" in doc


# --- which registration wins ----------------------------------------------------------------


def test_copied_feature_directory_loaded_twice_warns_once_and_works(tmp_path):
    copy = shutil.copytree(TE_PATTERNS, tmp_path / "copy_of_te_patterns", ignore=shutil.ignore_patterns("__pycache__"))
    collect = Collect()
    with pytest.warns(RegistrationWarning) as record:
        start(tmp_path, CONFIG, dirs=[TE_PATTERNS, copy], statistics_logger=collect)
    assert len(record) == 1
    message = str(record[0].message)
    assert "registered twice" in message and "LogExtraStats" in message and "PatternsAPI" in message
    assert f"{TE_PATTERNS}" in message.split("LogExtraStats")[1].split(" is used")[0]  # the first directory wins
    ns = Registry.data["transformer_engine"]
    assert Path(sys.modules[type(ns.api).__module__].__file__).parent == TE_PATTERNS
    assert {Path(sys.modules[type(f).__module__].__file__).parent for f in ns.features.values()} == {TE_PATTERNS}
    inspect(torch.ones(8))
    debug_api.step()
    assert collect.rows[(f"{LAYER}_activation_mean", 0)] == 1.0
    assert "registered twice" in (tmp_path / "logs" / "nvdlfw_inspect_logs" / "nvdlfw_inspect_globalrank-0.log").read_text()


def imported_package_and_another_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Namespace, ModuleType, Path]:
    """A feature package imported from one site (registering its classes on import) and a copy in another."""
    package = unique("features_pkg")
    ns = write_namespace(tmp_path / "site_a" / package, relative_import=True)
    (ns.directory / "__init__.py").write_text("")
    other_install = shutil.copytree(ns.directory, tmp_path / "site_b" / package)
    monkeypatch.syspath_prepend(str(tmp_path / "site_a"))
    return ns, importlib.import_module(f"{package}.{ns.feature_module}"), other_install


def test_another_install_of_an_imported_package_warns_once_and_keeps_the_imported_classes(tmp_path, monkeypatch):
    ns, imported, other_install = imported_package_and_another_install(tmp_path, monkeypatch)
    with pytest.warns(RegistrationWarning, match="registered twice") as record:
        start(tmp_path, "", dirs=[ns.directory, other_install])
    assert len(record) == 1
    features = Registry.data[ns.name].features
    assert type(features["FeatA"]) is imported.FeatA and type(features["FeatB"]) is imported.FeatB
    assert getattr(debug_api, ns.name).probe("m.1.x") == {}  # routed; no feature configured


def test_only_the_other_install_named_replaces_the_imported_registrations_with_one_warning(tmp_path, monkeypatch):
    ns, imported, other_install = imported_package_and_another_install(tmp_path, monkeypatch)
    with pytest.warns(RegistrationWarning, match="registered on import") as record:
        start(tmp_path, "", dirs=[other_install])
    assert len(record) == 1
    feature = type(Registry.data[ns.name].features["FeatA"])
    assert feature is not imported.FeatA and Path(sys.modules[feature.__module__].__file__).parent == other_install


def test_feature_dirs_namespace_wins_over_lowprecs_and_lowprec_layers_keep_working(tmp_path, monkeypatch):
    monkeypatch.setattr(feature_loading, "_default_feature_dirs", [Path(lowprec.FEATURE_DIR)])
    config = CONFIG[: CONFIG.index("    LogQuantStats:")].replace(".*fc1", ".*")  # LogExtraStats on every layer
    collect = Collect()
    with pytest.warns(RegistrationWarning, match="namespace 'transformer_engine' comes from feature_dirs") as record:
        start(tmp_path, config, dirs=[TE_PATTERNS], statistics_logger=collect)
    assert len(record) == 1 and "DisableFp8Gemm" in str(record[0].message)  # lowprec's own names are set aside too
    ns = Registry.data["transformer_engine"]
    assert type(ns.api).__name__ == "PatternsAPI"
    assert set(ns.features) == {"DumpTensors", "LogExtraStats", "LogFp4Stats", "LogListedStats", "LogQuantStats"}
    layer = lowprec.Linear(16, 8, name="lin")
    x = torch.randn(4, 16, requires_grad=True)
    with lowprec.fp8_autocast(fp8_recipe=lowprec.Float8CurrentScaling()):
        layer(x).sum().backward()  # routed by the patterns API, whose LogExtraStats reads the layer's activation
    assert x.grad is not None and layer.weight.grad is not None
    debug_api.step()
    assert collect.rows[("lin_activation_mean", 0)] == pytest.approx(x.mean().item())
    debug_api.end_debug()
    start(tmp_path, "", dirs=[])  # without the directory, lowprec's namespace is back
    assert type(Registry.data["transformer_engine"].api).__module__ == "lowprec.debug.features.api"
