"""Statistics never read a value back to the host inside a step: only ``debug_api.step()`` does."""

from __future__ import annotations

import contextlib

import pytest
import torch
from debugrun import section, start

import lowprec
import nvdlfw_inspect.api as debug_api
from nvdlfw_inspect.logging import BaseLogger

READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__")


class Collect(BaseLogger):
    def __init__(self):
        self.names: set[str] = set()

    def log_scalar(self, name, value, iteration):
        self.names.add(name)


@contextlib.contextmanager
def host_reads_forbidden(monkeypatch):
    """Every Python-level way of reading a tensor's value on the host raises while this is active; on
    CUDA, so does every operation that waits for the device (``torch.cuda.set_sync_debug_mode``)."""

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
            yield
        finally:
            if torch.cuda.is_available():
                torch.cuda.set_sync_debug_mode("default")


def test_the_guard_catches_reads(monkeypatch):
    with host_reads_forbidden(monkeypatch), pytest.raises(AssertionError, match="Tensor.item"):
        torch.ones(1).sum().item()
    assert torch.ones(1).item() == 1.0  # restored afterwards


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
    for _ in range(2):  # micro-batches
        with host_reads_forbidden(monkeypatch):
            returned = debug_api.log_tensor_stats("model.input", tensor=x, tensor_name="input")
            with lowprec.fp8_autocast(fp8_recipe=recipe):
                layer(x).sum().backward()
    assert set(returned) == {"mean", "std"} and collect.names == set()
    debug_api.step()
    assert "mlp.fc1_activation_max_blockwise_dynamic_range_block_size_8_dims_2_max_over_orientations" in collect.names
    assert "mlp.fc2_gradient_mxfp8_underflows%_columnwise" in collect.names
    assert "model.input_input_std" in collect.names
    assert len(collect.names) == 2 + 2 * (6 * 9 + 3 * 7)
