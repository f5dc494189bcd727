"""debug_api.paused() on lowprec layers: nothing inspected or dumped, precision still steered, no debug path for a
layer whose features only look."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from debugrun import make_linear, section, start, train_step

import lowprec.modules.gemm_unit as gemm_unit
import nvdlfw_inspect.api as debug_api
from nvdlfw_inspect.reading import iter_statistics

STATS = {"LogTensorStats": {"enabled": True, "stats": ["max"], "tensors": ["activation", "weight", "gradient"]}}
X = torch.randn(4, 32)
DY = torch.randn(4, 24)


def read_stats(log_dir) -> dict[tuple[str, int], float]:
    """``{(layer_tensor_stat, iteration): value}`` from the run's records (full precision, unlike the text log)."""
    return {(f"{s.layer}_{s.tensor}_{s.stat}", s.iteration): s.value for s in iter_statistics(log_dir)}


def test_a_paused_forward_and_backward_add_nothing_to_the_step(log_dir):
    start(section(STATS), log_dir)
    layer = make_linear()
    train_step(layer, X, DY)
    with debug_api.paused():
        train_step(layer, 100 * X, 100 * DY)  # would raise the activation and gradient maxima if it were recorded
    debug_api.step()
    debug_api.end_debug()
    assert read_stats(log_dir) == {
        ("lin_activation_max", 0): X.max().item(),
        ("lin_gradient_max", 0): DY.max().item(),
        ("lin_weight_max", 0): layer.weight.max().item(),
    }


def test_paused_layers_whose_features_only_look_take_the_plain_path(log_dir, monkeypatch):
    start(section({**STATS, "DumpTensors": {"enabled": True, "tensors": ["activation"], "high_precision_tensor": True}}), log_dir)
    layer = make_linear()
    expected = train_step(layer, X, DY)

    def no_debug_path(*args, **kwargs):
        raise AssertionError("a paused layer with inspection features only took the debug path")

    monkeypatch.setattr(gemm_unit, "DebugProcessing", no_debug_path)
    with debug_api.paused():
        paused = train_step(layer, X, DY)
        train_step(layer, 100 * X, DY)  # would replace the iteration's dump if it were dumped
    for got, want in zip(paused, expected, strict=True):
        assert torch.equal(got, want)
    monkeypatch.undo()
    debug_api.step()
    debug_api.end_debug()
    (dump,) = log_dir.rglob("*.pt")
    assert torch.equal(torch.load(dump, weights_only=True)["high_precision"], X)


def test_paused_layers_keep_the_precision_features_set(log_dir):
    start(section({**STATS, "DisableFP8GEMM": {"enabled": True, "gemms": ["fprop"]}}), log_dir)
    layer = make_linear()
    with debug_api.paused():
        y, _, _ = train_step(layer, X, DY)
    assert torch.equal(y, F.linear(X, layer.weight, layer.bias).detach())  # fprop stays in high precision
    debug_api.step()
    debug_api.end_debug()
    assert read_stats(log_dir) == {}


@pytest.mark.parametrize("paused_first", [True, False])
def test_the_plan_of_an_iteration_serves_paused_and_inspected_forwards_alike(log_dir, paused_first):
    """An evaluation (paused) before the training forward of an iteration builds the layer's plan for that
    iteration; the training forward after it is inspected all the same."""
    start(section(STATS), log_dir)
    layer = make_linear()
    if paused_first:
        with debug_api.paused():
            train_step(layer, 100 * X, 100 * DY)
    train_step(layer, X, DY)
    if not paused_first:
        with debug_api.paused():
            train_step(layer, 100 * X, 100 * DY)
    debug_api.step()
    debug_api.end_debug()
    assert read_stats(log_dir)[("lin_activation_max", 0)] == X.max().item()
