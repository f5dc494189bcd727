"""Statistics never read a value back to the host inside a step: only ``debug_api.step()`` does."""

from __future__ import annotations

import contextlib

import pytest
import torch
from debugrun import section, start
from torch.utils._python_dispatch import TorchDispatchMode

import lowprec
import nvdlfw_inspect.api as debug_api
from nvdlfw_inspect.logging import BaseLogger

READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__")


class Collect(BaseLogger):
    def __init__(self):
        self.names: set[str] = set()

    def log_scalar(self, name, value, iteration):
        self.names.add(name)


class HostDataForbidden(TorchDispatchMode):
    """Raises on operators that move host data into a tensor (``lift_fresh``: ``torch.tensor(...)``,
    ``t[i] = 1.5``; on CUDA a copy from pageable memory, which waits for the device) or read one back
    (``_local_scalar_dense``: ``.item()``). Counts the statistics operators it sees."""

    FORBIDDEN = ("aten::lift_fresh", "aten::lift_fresh_copy", "aten::_local_scalar_dense")

    def __init__(self):
        super().__init__()
        self.stats_calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name in self.FORBIDDEN:
            raise AssertionError(f"{name} inside the step")
        self.stats_calls += name == "nvdlfw_inspect::tensor_stats"
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def host_reads_forbidden(monkeypatch):
    """Every Python-level way of reading a tensor's value on the host raises while this is active, and
    so does every operator that moves host data into a tensor (``HostDataForbidden``); on CUDA, so does
    every operation that waits for the device (``torch.cuda.set_sync_debug_mode``)."""

    def forbidden(name):
        def read(self, *args, **kwargs):
            raise AssertionError(f"Tensor.{name} called inside the step")

        return read

    with monkeypatch.context() as patch:
        for name in READS:
            patch.setattr(torch.Tensor, name, forbidden(name))
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("error")
        try:
            with HostDataForbidden() as mode:
                yield mode
        finally:
            if torch.cuda.is_available():
                torch.cuda.set_sync_debug_mode("default")


def test_the_guard_catches_reads(monkeypatch):
    with host_reads_forbidden(monkeypatch), pytest.raises(AssertionError, match="Tensor.item"):
        torch.ones(1).sum().item()
    assert torch.ones(1).item() == 1.0  # restored afterwards


def test_the_guard_catches_host_data_written_into_tensors(monkeypatch):
    x = torch.zeros(4)
    with host_reads_forbidden(monkeypatch), pytest.raises(AssertionError, match="lift_fresh"):
        x[3] = 1.5  # the element-wise fill that synchronised on the H100
    with host_reads_forbidden(monkeypatch), pytest.raises(AssertionError, match="lift_fresh"):
        torch.tensor([1.0, 2.0])
    with host_reads_forbidden(monkeypatch):
        x[3:4].fill_(1.5)  # a fill takes the value as a kernel argument: allowed


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", [lowprec.DelayedScaling(), lowprec.Float8CurrentScaling()])
def test_stats_features_feed_buffers_without_host_reads(log_dir, monkeypatch, recipe, device):
    features = {
        "LogTensorStats": {
            "enabled": True,
            "tensors": ["activation", "weight", "gradient", "output", "wgrad", "dgrad"],
            "stats": [
                "min",
                "max",
                "mean",
                "std",
                "l1_norm",
                "l2_norm",
                "cur_amax",
                "dynamic_range",
                {"max_blockwise_dynamic_range": {"block_size": 8, "dims": 2}},
            ],
        },
        "LogFp8TensorStats": {
            "enabled": True,
            "tensors": ["activation", "weight", "gradient"],
            "stats": [
                "underflows%",
                "mse",
                "scale_inv_min",
                "fp8_delayed_scaling_overflows%",
                "fp8_current_scaling_mse",
                "mxfp8_underflows%_columnwise",
                "fp8_block_scaling_scale_inv_max",
            ],
        },
    }
    config = section(features)
    config["base"] = {
        "enabled": True,
        "layers": {"layer_name_regex_pattern": ".*"},
        "LogTensorStats": {"enabled": True, "tensors": ["input"], "stats": ["mean", "std"]},
    }
    collect = Collect()
    start(config, log_dir, statistics_logger=collect)
    layer = lowprec.LayerNormMLP(32, 64, name="mlp", device=device)
    x = torch.randn(2, 8, 32, device=device)
    for micro_batch in range(2):
        with host_reads_forbidden(monkeypatch) as guard:
            returned = debug_api.log_tensor_stats("model.input", tensor=x, tensor_name="input")
            with lowprec.fp8_autocast(fp8_recipe=recipe):
                layer(x).sum().backward()
        # one statistics operator per inspected tensor: 2 layers x 6 tensors, and the base input;
        # the weights count once per step, so the second micro-batch skips them
        assert guard.stats_calls == 1 + 2 * (6 if micro_batch == 0 else 5)
    assert set(returned) == {"mean", "std"} and collect.names == set()
    debug_api.step()
    assert "mlp.fc1_activation_max_blockwise_dynamic_range_block_size_8_dims_2_max_over_orientations" in collect.names
    assert "mlp.fc2_gradient_mxfp8_underflows%_columnwise" in collect.names
    assert "model.input_input_std" in collect.names
    assert len(collect.names) == 2 + 2 * (6 * 9 + 3 * 7)


@pytest.mark.parametrize("device", DEVICES)
def test_the_statistics_that_warn_early_feed_without_host_reads(log_dir, monkeypatch, device):
    early = ["kurtosis", "rms", "outlier_channel_ratio", "max_channel"]
    config = section({"LogTensorStats": {"enabled": True, "tensors": ["activation", "weight", "gradient"], "stats": early}})
    config["base"] = {
        "enabled": True,
        "layers": {"layer_name_regex_pattern": ".*"},
        "LogTensorStats": {"enabled": True, "tensors": ["input"], "stats": early},
    }
    collect = Collect()
    start(config, log_dir, statistics_logger=collect)
    layer = lowprec.LayerNormMLP(32, 64, name="mlp", device=device)
    x = torch.randn(2, 8, 32, device=device)
    for _ in range(2):  # micro-batches: the moments and the per-column amax merge on the device
        with host_reads_forbidden(monkeypatch):
            returned = debug_api.log_tensor_stats("model.input", tensor=x, tensor_name="input")
            with lowprec.fp8_autocast(fp8_recipe=lowprec.Float8CurrentScaling()):
                layer(x).sum().backward()
    assert set(returned) == set(early) and collect.names == set()
    debug_api.step()
    assert len(collect.names) == len(early) * (1 + 2 * 3)
