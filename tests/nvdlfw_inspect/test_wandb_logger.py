"""The W&B statistics logger, with the real wandb package in offline mode, its run file read back."""

from __future__ import annotations

import math
import sys

import pytest
import torch

import nvdlfw_inspect.api as debug_api

wandb = pytest.importorskip("wandb")
from wandb_reader import history, records, step_metrics  # noqa: E402

from nvdlfw_inspect.wandb_logger import WandbLogger  # noqa: E402

CONFIG = {
    "s": {
        "enabled": True,
        "layers": {"layer_types": ["fc"]},
        "LogTensorStats": {"enabled": True, "stats": ["min", "max"], "tensors": ["activation", "gradient"]},
    }
}


@pytest.fixture
def wandb_dir(tmp_path, monkeypatch):
    """Keep wandb's settings, cache and runs inside the test's folder, and off the network."""
    for variable in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(variable, str(tmp_path / "wandb_home"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    return tmp_path


def offline_run(wandb_dir):
    return wandb.init(mode="offline", dir=str(wandb_dir), project="lowprec-tests")


def run_dir(wandb_dir):
    (folder,) = (wandb_dir / "wandb").glob("offline-run-*")
    return folder


def test_statistics_reach_the_run_one_row_per_iteration(wandb_dir, log_dir):
    run = offline_run(wandb_dir)
    debug_api.initialize(CONFIG, log_dir=log_dir, statistics_logger=WandbLogger(run))
    debug_api.log_tensor_stats("net.fc", tensor=torch.tensor([-2.0, 5.0]), tensor_name="activation")
    debug_api.log_tensor_stats("net.fc", tensor=torch.tensor([0.5, 0.25]), tensor_name="gradient")
    run.log({"loss": 3.5})  # the user's own metrics share the run
    debug_api.step()
    debug_api.log_tensor_stats("net.fc", tensor=torch.tensor([1.5, float("nan")]), tensor_name="activation")
    debug_api.end_debug()  # sends the unfinished step
    run.finish()

    rows = [row for row in history(run_dir(wandb_dir)) if "debug_iteration" in row]
    assert rows == [
        {
            "net.fc/activation_min": -2.0,
            "net.fc/activation_max": 5.0,
            "net.fc/gradient_min": 0.25,
            "net.fc/gradient_max": 0.5,
            "debug_iteration": 0,
        },
        {
            "net.fc/activation_min": pytest.approx(float("nan"), nan_ok=True),
            "net.fc/activation_max": pytest.approx(float("nan"), nan_ok=True),
            "debug_iteration": 1,
        },
    ]
    assert {"loss": 3.5} in history(run_dir(wandb_dir))
    assert step_metrics(run_dir(wandb_dir)) == {"net.fc/*": "debug_iteration"}


def test_logger_started_run_is_finished_by_it(wandb_dir):
    logger = WandbLogger(mode="offline", dir=str(wandb_dir), project="lowprec-tests", step_metric="it")
    logger.log_scalar("custom_metric", 2.0, 4)
    logger.log_scalar("custom_metric", 3.0, 9)  # a new iteration sends the previous row
    logger.finish()
    folder = run_dir(wandb_dir)
    assert history(folder) == [{"custom_metric": 2.0, "it": 4}, {"custom_metric": 3.0, "it": 9}]
    assert step_metrics(folder) == {"custom_metric": "it"}
    assert records(folder)[-1].WhichOneof("record_type") == "exit"


def test_run_and_init_arguments_are_exclusive(wandb_dir):
    run = offline_run(wandb_dir)
    try:
        with pytest.raises(ValueError, match=r"either a run or wandb.init arguments, not both: \['project'\]"):
            WandbLogger(run, project="x")
    finally:
        run.finish()


def test_missing_wandb_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError, match="WandbLogger needs the wandb package: pip install wandb"):
        WandbLogger()


def test_nan_is_recorded_as_nan(wandb_dir):
    logger = WandbLogger(mode="offline", dir=str(wandb_dir), project="lowprec-tests")
    logger.log_statistic("layer", "weight", "max", float("inf"), 0)
    logger.log_statistic("layer", "weight", "min", float("nan"), 0)
    logger.finish()
    (row,) = history(run_dir(wandb_dir))
    assert row["layer/weight_max"] == math.inf and math.isnan(row["layer/weight_min"])


def test_wrap_wandb_logger_takes_a_run_as_nemo_adds_it(wandb_dir, log_dir):
    """NeMo's tensor-inspection callback: ``MetricLogger.add_logger(wrap_wandb_logger(logger))`` after initialize."""
    from nvdlfw_inspect.logging import MetricLogger, wrap_wandb_logger

    run = offline_run(wandb_dir)
    debug_api.initialize(CONFIG, log_dir=log_dir)
    MetricLogger.add_logger(wrap_wandb_logger(run))
    debug_api.log_tensor_stats("net.fc", tensor=torch.tensor([-2.0, 5.0]), tensor_name="activation")
    debug_api.step()
    debug_api.end_debug()
    assert not run._is_finished  # the run stays the caller's
    run.finish()
    rows = [row for row in history(run_dir(wandb_dir)) if "debug_iteration" in row]
    assert rows == [{"net.fc/activation_min": -2.0, "net.fc/activation_max": 5.0, "debug_iteration": 0}]


def test_wrap_wandb_logger_takes_lightnings_wandb_logger(wandb_dir, log_dir):
    loggers = pytest.importorskip("lightning.pytorch.loggers")
    from nvdlfw_inspect.logging import wrap_wandb_logger

    lightning_logger = loggers.WandbLogger(project="lowprec-tests", save_dir=str(wandb_dir), offline=True)
    debug_api.initialize(CONFIG, log_dir=log_dir, statistics_logger=wrap_wandb_logger(lightning_logger))
    debug_api.log_tensor_stats("net.fc", tensor=torch.tensor([1.0, 3.0]), tensor_name="gradient")
    debug_api.end_debug()
    lightning_logger.experiment.finish()
    (row,) = [row for row in history(run_dir(wandb_dir)) if "debug_iteration" in row]
    # Lightning's run defines its own step with step_sync, which W&B's service adds to a row when it has processed that
    # definition before the row (its order, not ours: one run of this test found the row without it); the statistics keep
    # their axis either way
    assert row.pop("trainer/global_step", 0) == 0
    assert row == {"net.fc/gradient_min": 1.0, "net.fc/gradient_max": 3.0, "debug_iteration": 0}
    assert step_metrics(run_dir(wandb_dir))["net.fc/*"] == "debug_iteration"


def test_wrap_wandb_logger_rejects_what_is_no_run():
    from nvdlfw_inspect.logging import wrap_wandb_logger

    with pytest.raises(TypeError, match="needs a W&B run .* or a Lightning WandbLogger .*, got SummaryWriter"):
        wrap_wandb_logger(type("SummaryWriter", (), {"add_scalar": lambda *a: None})())


def test_early_warning_statistics_reach_the_run(wandb_dir, log_dir):
    """kurtosis, rms, outlier_channel_ratio and max_channel (issue 38) reach W&B as the other statistics do, one row
    per step, with the values of float64 torch on the step's tensors."""
    from test_logging import EARLY, early_warning_reference, early_warning_steps

    config = {"s": CONFIG["s"] | {"LogTensorStats": {"enabled": True, "stats": EARLY, "tensors": ["activation"]}}}
    run = offline_run(wandb_dir)
    debug_api.initialize(config, log_dir=log_dir, statistics_logger=WandbLogger(run))
    seen = early_warning_steps()
    debug_api.end_debug()
    run.finish()
    rows = [row for row in history(run_dir(wandb_dir)) if "debug_iteration" in row]
    expected = [early_warning_reference(x) for x in seen]
    assert rows == [
        {f"net.fc/activation_{stat}": pytest.approx(ref[stat], rel=1e-12) for stat in EARLY} | {"debug_iteration": step}
        for step, ref in enumerate(expected)
    ]
    assert [row["net.fc/activation_max_channel"] for row in rows] == [1, 2, 3]
