"""The statistics that warn early, end to end: one config lists them under the base and the transformer_engine
namespaces, a tiny lowprec model trains a few steps of two micro-batches, and every logged value is the float64
one of the tensors the hooks saw."""

from __future__ import annotations

import pytest
import torch
from collecting import Collect
from debugrun import section, start, train_step

import lowprec
import nvdlfw_inspect.api as debug_api
from nvdlfw_inspect.errors import ConfigError

EARLY = ["kurtosis", "rms", "outlier_channel_ratio", "max_channel"]
TENSORS = ["activation", "weight", "gradient", "output", "wgrad", "dgrad"]


def reference(tensors: list[torch.Tensor]) -> dict[str, float]:
    """The four statistics of the tensors' rows together, in float64 torch from their definitions."""
    v = torch.cat([t.detach().double().reshape(-1, t.shape[-1]) for t in tensors])
    d = v - v.mean()
    amax = v.abs().amax(0)
    ordered = amax.sort().values
    k = ordered.numel()
    return {
        "kurtosis": ((d**4).mean() / (d**2).mean() ** 2).item(),
        "rms": (v**2).mean().sqrt().item(),
        "outlier_channel_ratio": (ordered[-1] / ((ordered[(k - 1) // 2] + ordered[k // 2]) / 2)).item(),
        "max_channel": float(amax.argmax()),
    }


def test_both_namespaces_log_the_float64_statistics_of_what_the_hooks_saw(log_dir):
    config = section(
        {"LogTensorStats": {"enabled": True, "tensors": TENSORS, "stats": EARLY}}, {"layer_name_regex_pattern": "lin"}
    )
    config["base"] = {
        "enabled": True,
        "layers": {"layer_name_regex_pattern": "hooked"},
        "LogTensorStats": {"enabled": True, "tensors": ["output"], "stats": EARLY},
    }
    collect = Collect()
    start(config, log_dir, statistics_logger=collect)
    torch.manual_seed(0)
    layer = lowprec.Linear(32, 24, name="lin")
    seen: list[torch.Tensor] = []

    def base_hook(module, inputs, output):  # the base namespace, fed from a forward hook
        seen.append(output.detach().clone())
        debug_api.log_tensor_stats("hooked", tensor=output, tensor_name="output")

    layer.register_forward_hook(base_hook)
    for step in range(3):
        fed: dict[str, list[torch.Tensor]] = {name: [] for name in TENSORS}
        seen.clear()
        for micro_batch in range(2):
            x = torch.randn(4 + 3 * micro_batch, 32)
            x[:, 7] *= 20.0 * (step + 1)  # an outlier channel of the activation
            dy = torch.randn(4 + 3 * micro_batch, 24) ** 3  # heavy-tailed gradients
            y, dx, dw = train_step(layer, x, dy)
            for name, t in zip(TENSORS, (x, layer.weight, dy, y, dw, dx), strict=True):
                fed[name].append(t.detach().clone())
        fed["weight"] = fed["weight"][:1]  # a weight counts once per step
        debug_api.step()
        for name, tensors in fed.items():
            want = reference(tensors)
            got = {stat: collect.values[(f"lin_{name}_{stat}", step)] for stat in EARLY}
            assert got == pytest.approx(want, rel=1e-9), name
        want = reference(seen)
        assert {stat: collect.values[(f"hooked_output_{stat}", step)] for stat in EARLY} == pytest.approx(want, rel=1e-9)
        assert collect.values[("lin_activation_max_channel", step)] == 7.0
    assert len(collect.values) == 3 * (len(TENSORS) + 1) * len(EARLY)


def test_an_unknown_statistic_is_a_clear_error_naming_the_new_ones(log_dir):
    config = section({"LogTensorStats": {"enabled": True, "tensors": ["activation"], "stats": ["rms", "kurtosys"]}})
    with pytest.raises(ConfigError) as error:
        start(config, log_dir)
    assert "kurtosys" in str(error.value) and all(stat in str(error.value) for stat in EARLY)
