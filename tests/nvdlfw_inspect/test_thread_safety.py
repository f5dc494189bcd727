"""Threads logging statistics while another calls ``debug_api.step()``: every call is logged exactly once. A training
thread racing ``end_debug()`` on another thread never fails: each call completes against the session or behaves as
before ``initialize``."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

import lowprec
import nvdlfw_inspect.api as debug_api
from nvdlfw_inspect import debug_manager
from nvdlfw_inspect.debug_manager import held
from nvdlfw_inspect.logging import BaseLogger

FEEDERS = 4
CALLS = 150
JOIN_S = 120.0


class Records(BaseLogger):
    """Every statistic handed to the loggers, in order."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, float, int]] = []

    def log_scalar(self, name: str, value: float, iteration: int, **kwargs) -> None:
        self.rows.append((name, float(value), int(iteration)))

    def sums(self, layer: str, tensor: str) -> tuple[float, float]:
        """(sum of every logged l1_norm, sum of every logged l2_norm squared) of ``layer``'s ``tensor``."""
        l1 = sum(value for name, value, _ in self.rows if name == f"{layer}_{tensor}_l1_norm")
        l2 = sum(value**2 for name, value, _ in self.rows if name == f"{layer}_{tensor}_l2_norm")
        return l1, l2


def call_value(call: int) -> torch.Tensor:
    """Call ``call``'s tensor: its l1 norm is ``call + 1``, its squared l2 norm ``(call + 1) ** 2``."""
    return torch.tensor([float(call + 1)])


def run_against_steps(feed: Callable[[int], None]) -> list[BaseException]:
    """``feed(thread)`` in ``FEEDERS`` threads while this thread calls ``debug_api.step()`` until they end;
    the exceptions of any thread."""
    errors: list[BaseException] = []
    done = threading.Event()

    def guarded(body: Callable[[], None]) -> None:
        try:
            body()
        except BaseException as error:  # reported by the test
            errors.append(error)

    feeders = [threading.Thread(target=guarded, args=(lambda k=k: feed(k),)) for k in range(FEEDERS)]
    stepper = threading.Thread(target=guarded, args=(lambda: steps_until(done),))
    stepper.start()
    for thread in feeders:
        thread.start()
    for thread in feeders:
        thread.join(JOIN_S)
    done.set()
    stepper.join(JOIN_S)
    assert not any(thread.is_alive() for thread in [*feeders, stepper]), "a thread did not finish in time"
    debug_api.step()  # the calls after the stepper's last step
    return errors


def steps_until(done: threading.Event) -> None:
    steps = 0
    while not done.is_set() or steps < 3:
        debug_api.step()
        steps += 1


def test_log_tensor_stats_from_threads_while_another_thread_steps(tmp_path):
    records = Records()
    stats = {"enabled": True, "tensors": ["activation"], "stats": ["l1_norm", "l2_norm"]}
    config = {"all": {"enabled": True, "layers": {"layer_name_regex_pattern": ".*"}, "LogTensorStats": stats}}
    debug_api.initialize(config_file=config, log_dir=str(tmp_path), statistics_logger=records)

    def feed(thread: int) -> None:
        for call in range(CALLS):
            debug_api.log_tensor_stats(layer_name=f"t{thread}", tensor=call_value(call), tensor_name="activation")

    assert run_against_steps(feed) == []
    want = (sum(call + 1 for call in range(CALLS)), sum((call + 1) ** 2 for call in range(CALLS)))
    for thread in range(FEEDERS):
        assert records.sums(f"t{thread}", "activation") == pytest.approx(want, rel=1e-12), thread


def test_lowprec_layers_in_threads_while_another_thread_steps(tmp_path):
    records = Records()
    stats = {"enabled": True, "tensors": ["activation"], "stats": ["l1_norm", "l2_norm"]}
    config = {
        "all": {"enabled": True, "layers": {"layer_name_regex_pattern": ".*"}, "transformer_engine": {"LogTensorStats": stats}}
    }
    debug_api.initialize(config_file=config, feature_dirs=[lowprec.FEATURE_DIR], log_dir=str(tmp_path), statistics_logger=records)
    layers = [lowprec.Linear(4, 2, name=f"t{thread}") for thread in range(FEEDERS)]
    inputs = [torch.randn(3, 4, generator=torch.Generator().manual_seed(call)) for call in range(CALLS // 3)]

    def feed(thread: int) -> None:
        with torch.no_grad():
            for x in inputs:
                layers[thread](x)

    assert run_against_steps(feed) == []
    every = torch.cat(inputs).double()
    want = (every.abs().sum().item(), every.square().sum().item())
    for thread in range(FEEDERS):
        assert records.sums(f"t{thread}", "activation") == pytest.approx(want, rel=1e-5), thread


RACES = 10
TE_FEATURES = {
    "LogTensorStats": {"enabled": True, "tensors": ["activation", "gradient", "weight"], "stats": ["max", "l1_norm"]},
    "LogFp8TensorStats": {"enabled": True, "tensors": ["activation", "gradient"], "stats": ["underflows%"]},
    "DisableFP8GEMM": {"enabled": True, "gemms": ["wgrad"]},
}
RACE_CONFIG = {
    "layers": {"enabled": True, "layers": {"exact_layer_names": ["lin"]}, "transformer_engine": TE_FEATURES},
    "tensors": {
        "enabled": True,
        "layers": {"exact_layer_names": ["stats"]},
        "LogTensorStats": {"enabled": True, "tensors": ["x"], "stats": ["max"]},
    },
}


def train_until_ended(layer: lowprec.Linear, running: threading.Event, ended: threading.Event, errors: list) -> None:
    """Training steps (FP8 forward and backward, a statistics call, ``step()``) until 3 after ``ended``; ``running``
    once 2 are done; an exception goes to ``errors``."""
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    try:
        iteration = after_end = 0
        while after_end < 3:
            after_end += ended.is_set()
            with lowprec.fp8_autocast(fp8_recipe=lowprec.Float8CurrentScaling()):
                y = layer(x)
            y.square().mean().backward()
            debug_api.log_tensor_stats(layer_name="stats", tensor=y.detach(), tensor_name="x")
            debug_api.step()
            iteration += 1
            if iteration == 2:
                running.set()
    except BaseException as error:  # reported by the test
        errors.append(error)
        running.set()


def test_a_training_thread_racing_end_debug_on_another_thread_never_fails(tmp_path):
    """The issue's run: NotInitializedError in 6 of 8 runs, once an AttributeError on None. Each race ends the session
    while the training thread is at a point of its loop that chance decides (a forward, a backward, a step, a
    statistics call), and the thread goes on after the end."""
    layer = lowprec.Linear(16, 16, name="lin")
    for race in range(RACES):
        debug_api.initialize(config_file=RACE_CONFIG, feature_dirs=[lowprec.FEATURE_DIR], log_dir=str(tmp_path / str(race)))
        running, ended, errors = threading.Event(), threading.Event(), []
        thread = threading.Thread(target=train_until_ended, args=(layer, running, ended, errors))
        thread.start()
        assert running.wait(JOIN_S)
        debug_api.end_debug()
        ended.set()
        thread.join(JOIN_S)
        assert not thread.is_alive(), "the training thread did not finish in time"
        assert errors == [], f"race {race}"


def test_end_debug_waits_for_a_call_under_way_on_another_thread_which_completes_against_the_session(tmp_path):
    """A call that began before ``end_debug()`` completes against the session, its statistics in the final step;
    ``end_debug`` returns only after it."""
    records = Records()
    stats = {"enabled": True, "tensors": ["x"], "stats": ["max"]}
    config = {"all": {"enabled": True, "layers": {"layer_name_regex_pattern": ".*"}, "LogTensorStats": stats}}
    debug_api.initialize(config_file=config, log_dir=str(tmp_path), statistics_logger=records)
    inside, release = threading.Event(), threading.Event()

    def call_under_way() -> None:
        with held(debug_api.DEBUG_MANAGER) as open_:
            assert open_
            inside.set()
            assert release.wait(JOIN_S)
            debug_api.log_tensor_stats(layer_name="late", tensor=torch.tensor([7.0]), tensor_name="x")

    caller = threading.Thread(target=call_under_way)
    closer = threading.Thread(target=debug_api.end_debug)
    caller.start()
    assert inside.wait(JOIN_S)
    closer.start()
    closer.join(0.5)
    assert closer.is_alive()  # waiting for the call
    release.set()
    for thread in (caller, closer):
        thread.join(JOIN_S)
        assert not thread.is_alive()
    assert debug_api.DEBUG_MANAGER is None
    assert ("late_x_max", 7.0, 0) in records.rows


def test_end_debug_closes_without_a_call_that_does_not_end_and_says_so(tmp_path, monkeypatch):
    """A call stuck in another thread cannot keep ``end_debug()`` from returning the process to a clean state."""
    monkeypatch.setattr(debug_manager, "CALLS_DRAIN_S", 0.2)
    debug_api.initialize(config_file="", log_dir=str(tmp_path))
    inside, release = threading.Event(), threading.Event()

    def stuck_call() -> None:
        with held(debug_api.DEBUG_MANAGER):
            inside.set()
            assert release.wait(JOIN_S)

    caller = threading.Thread(target=stuck_call)
    caller.start()
    try:
        assert inside.wait(JOIN_S)
        with pytest.warns(UserWarning, match=r"waited 0.2 s for debug calls of 1 other thread\(s\) still under way"):
            debug_api.end_debug()
        assert debug_api.DEBUG_MANAGER is None
    finally:
        release.set()
        caller.join(JOIN_S)
