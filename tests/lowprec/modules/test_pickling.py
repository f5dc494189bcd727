"""A converted model pickles: ``torch.save(model)`` before or after training, with or without a debug session, loads
into a model that computes and trains on exactly as the original (its recipe state, delayed scaling's amax history,
kept; its transient state, weight casts and routing plans, rebuilt), and a spawned process given the model computes
the original's output."""

from __future__ import annotations

import io
import queue
import time

import pytest
import torch
import torch.multiprocessing as mp

import lowprec
import nvdlfw_inspect.api as debug_api
from lowprec.recipe import RECIPES

STATS = {"enabled": True, "tensors": ["activation", "gradient"], "stats": ["max"]}
CONFIG = {"all": {"enabled": True, "layers": {"layer_name_regex_pattern": ".*"}, "transformer_engine": {"LogTensorStats": STATS}}}
DELAYED = lowprec.DelayedScaling()
SPAWN_LIMIT_S = 120.0


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
    return torch.nn.Sequential(lowprec.convert(plain), lowprec.LayerNormMLP(32, 64, name="mlp"))


def batch(step: int) -> torch.Tensor:
    return torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(step))


def train_step(model: torch.nn.Module, recipe: lowprec.Recipe, step: int) -> list[torch.Tensor]:
    """One step of plain SGD (no optimizer state to carry over); the output and the parameters after it."""
    with lowprec.autocast(recipe=recipe):
        y = model(batch(step))
    y.square().mean().backward()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter -= 0.1 * parameter.grad
    model.zero_grad(set_to_none=True)
    debug_api.step()
    return [y.detach(), *(p.detach().clone() for p in model.parameters())]


def saved_and_loaded(model: torch.nn.Module) -> torch.nn.Module:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def test_a_model_saved_before_its_first_step_loads_and_trains_as_the_original():
    model = make_model()
    loaded = saved_and_loaded(model)
    for step in range(2):
        for a, b in zip(train_step(loaded, DELAYED, step), train_step(model, DELAYED, step), strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("debug", [False, True], ids=["plain", "debugged"])
@pytest.mark.parametrize("recipe", [cls() for cls in RECIPES], ids=[cls.__name__ for cls in RECIPES])
def test_a_model_saved_after_training_loads_and_trains_on_as_the_original(recipe, debug, log_dir):
    if debug:
        debug_api.initialize(config_file=CONFIG, feature_dirs=[lowprec.FEATURE_DIR], log_dir=log_dir)
    model = make_model()
    for step in range(2):
        train_step(model, recipe, step)
    loaded = saved_and_loaded(model)
    for step in (2, 3):  # the loaded model first: each step moves the recipe state on
        for a, b in zip(train_step(loaded, recipe, step), train_step(model, recipe, step), strict=True):
            assert torch.equal(a, b)


def output_in_child(rank: int, model: torch.nn.Module, x: torch.Tensor, results: mp.Queue) -> None:
    """The spawned process: the model's output under delayed scaling, sent back as numbers."""
    with lowprec.autocast(recipe=DELAYED):
        results.put(model(x).tolist())


def test_a_spawned_process_given_the_model_computes_its_output():
    model = make_model()
    for step in range(2):
        train_step(model, DELAYED, step)
    x = batch(2)
    results = mp.get_context("spawn").Queue()
    context = mp.spawn(output_in_child, args=(model, x, results), nprocs=1, join=False)  # the model is pickled here
    deadline = time.monotonic() + SPAWN_LIMIT_S
    try:
        with lowprec.autocast(recipe=DELAYED):
            expected = model(x).detach()
        while True:
            try:
                received = results.get(timeout=0.5)
                break
            except queue.Empty:
                context.join(0)  # raises the child's error, with its traceback, if it failed
                assert time.monotonic() < deadline, f"the spawned process sent nothing within {SPAWN_LIMIT_S} s"
        context.join(max(deadline - time.monotonic(), 0.0))
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    assert torch.equal(torch.tensor(received), expected)
