"""The recipe in force is per thread, as ``torch.autocast``'s dtype is: a thread outside autocast runs high
precision while another is inside one, and a backward casts as its forward did on whichever thread it runs."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
import torch.nn.functional as F

import lowprec
import nvdlfw_inspect.api as debug_api
from lowprec.autocast import active_recipe

WAIT_S = 60.0
DELAYED, CURRENT = lowprec.DelayedScaling(), lowprec.Float8CurrentScaling()


def make_layer() -> lowprec.Linear:
    torch.manual_seed(0)
    return lowprec.Linear(32, 16, name="lin")


def data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(8, 32, generator=generator), torch.randn(8, 16, generator=generator)


def run_in_thread(body: Callable[[], None]) -> threading.Thread:
    """``body`` on a new thread; its exception, if any, re-raised by ``join_all``."""

    def guarded() -> None:
        try:
            body()
        except BaseException as error:  # handed to the test's thread
            thread.error = error

    thread = threading.Thread(target=guarded, daemon=True)
    thread.error = None
    thread.start()
    return thread


def join_all(*threads: threading.Thread) -> None:
    for thread in threads:
        thread.join(WAIT_S)
        assert not thread.is_alive(), "a thread did not finish in time"
        if thread.error is not None:
            raise thread.error


def test_a_thread_outside_autocast_runs_high_precision_while_another_is_inside_one():
    layer = make_layer()
    x, dy = data()
    inside, release = threading.Event(), threading.Event()
    seen: dict[str, object] = {}

    def in_fp8() -> None:
        with lowprec.fp8_autocast(fp8_recipe=CURRENT):
            seen["fp8"] = layer(x).detach()
            inside.set()
            assert release.wait(WAIT_S)
            seen["recipe at the end"] = active_recipe()

    worker = run_in_thread(in_fp8)
    try:
        assert inside.wait(WAIT_S)
        assert active_recipe() is None
        x_grad = x.clone().requires_grad_()
        y = layer(x_grad)
        y.backward(dy)
    finally:
        release.set()
        join_all(worker)
    plain_x = x.clone().requires_grad_()
    plain = F.linear(plain_x, layer.weight.detach(), layer.bias.detach())
    plain.backward(dy)
    assert torch.equal(y, plain) and torch.equal(x_grad.grad, plain_x.grad)
    assert not torch.equal(seen["fp8"], plain.detach())  # the other thread did run in FP8 meanwhile
    assert seen["recipe at the end"] == CURRENT


def test_a_backward_on_another_thread_casts_with_the_recipe_its_forward_ran_under():
    x, dy = data()
    reference = make_layer()
    with lowprec.fp8_autocast(fp8_recipe=DELAYED):
        reference(x).backward(dy)
    layer = make_layer()
    with lowprec.fp8_autocast(fp8_recipe=DELAYED):
        y = layer(x)

    def backward_under_another_recipe() -> None:
        with lowprec.autocast(recipe=CURRENT):
            y.backward(dy)

    join_all(run_in_thread(backward_under_another_recipe))
    assert torch.equal(layer.weight.grad, reference.weight.grad)
    high = make_layer()
    high(x).backward(dy)
    assert not torch.equal(layer.weight.grad, high.weight.grad)  # the gradient was cast, not left in high precision


def test_the_high_precision_gemm_watch_follows_only_the_thread_whose_autocast_started_it(log_dir):
    debug_api.initialize(config_file="", log_dir=log_dir)  # a new session: the watch is due
    converted = lowprec.convert(torch.nn.Sequential(torch.nn.Linear(32, 16)))
    torch.manual_seed(0)
    unconverted = torch.nn.Linear(32, 16)  # another thread's model, run outside any autocast
    x, _ = data()
    with lowprec.fp8_autocast(fp8_recipe=CURRENT):
        join_all(run_in_thread(lambda: unconverted(x)))
        converted(x)
    debug_api.end_debug()
    log = (log_dir / "nvdlfw_inspect_logs" / "nvdlfw_inspect_globalrank-0.log").read_text()
    assert "in high precision although an FP8 recipe is in force" not in log
