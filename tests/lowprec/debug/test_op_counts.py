"""What statistics add to a training step, counted in dispatched operators (about one kernel launch
each on a GPU): one statistics operator per inspected tensor, at most 8 operators per inspected tensor
in all (step() included), and nothing at all on the steps a schedule skips or without a selected layer."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from debugrun import start

import lowprec
import nvdlfw_inspect.api as debug_api

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
from harness import count_ops  # noqa: E402

TENSORS = ["activation", "gradient", "weight"]
BASE_STATS = ["min", "max", "mean", "std", "l1_norm", "l2_norm", "cur_amax", "dynamic_range"]


def config(pattern: str, freq: int, fp8_stats: list[str]) -> dict:
    """The statistics of benchmarks/real_model.py on the layers matching ``pattern``."""
    features = {
        "LogTensorStats": {"enabled": True, "tensors": TENSORS, "stats": BASE_STATS, "freq": freq},
        "LogFp8TensorStats": {"enabled": True, "tensors": TENSORS, "stats": fp8_stats, "freq": freq},
    }
    return {"stats": {"enabled": True, "layers": {"layer_name_regex_pattern": pattern}, "transformer_engine": features}}


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 64)) for _ in range(3)]
    return lowprec.convert(torch.nn.Sequential(*blocks))


def ops_per_step(cfg: dict | None, log_dir: Path, recipe, steps: int = 4) -> list:
    """The ops of each of the last ``steps - 2`` training steps (forward, backward, SGD, debug step())."""
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    x = torch.randn(32, 64)
    if cfg is not None:
        start(cfg, log_dir)

    def step() -> None:
        with lowprec.fp8_autocast(fp8_recipe=recipe):
            loss = net(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if cfg is not None:
            debug_api.step()

    counts = []
    for i in range(steps):
        if i < 2:
            step()  # plans and buffers are made in the first steps
        else:
            counts.append(count_ops(step))
    if cfg is not None:
        debug_api.end_debug()
    return counts


@pytest.mark.parametrize("recipe", [lowprec.DelayedScaling(), lowprec.Float8CurrentScaling()])
def test_statistics_cost_at_most_eight_ops_per_inspected_tensor(log_dir, recipe):
    fp8_stats = ["underflows%", "scale_inv_min", "scale_inv_max", "mse"]
    plain = ops_per_step(None, log_dir, recipe)[0]
    idle = ops_per_step(config("no-such-layer", 1, fp8_stats), log_dir, recipe)[0]
    debugged = ops_per_step(config(r"\.[02]$", 1, fp8_stats), log_dir, recipe)[0]  # fc1 and fc2 of each block
    inspected = 6 * len(TENSORS)
    assert idle == plain  # a debug session that selects no layer adds no op
    assert debugged["nvdlfw_inspect::tensor_stats"] == inspected  # one launch per tensor, both features in it
    extra = sum(debugged.values()) - sum(plain.values())
    assert 0 < extra <= 8 * inspected, (extra / inspected, (debugged - plain).most_common(10))


def test_a_skipped_step_costs_nothing_and_a_what_if_recipe_little(log_dir):
    recipe = lowprec.DelayedScaling()
    plain = ops_per_step(None, log_dir, recipe)[0]
    # steps 2 and 3 of freq 3: 3 runs the statistics, 2 does not
    skipped, logged = ops_per_step(config(".*", 3, ["underflows%"]), log_dir, recipe)
    assert skipped == plain
    with_what_ifs = ops_per_step(
        config(".*", 3, ["underflows%", "fp8_current_scaling_mse", "fp8_delayed_scaling_mse"]), log_dir, recipe
    )[1]
    inspected = 6 * len(TENSORS)
    assert logged["nvdlfw_inspect::tensor_stats"] == with_what_ifs["nvdlfw_inspect::tensor_stats"] == inspected
    # both what-if per-tensor recipes ride in the same launch; only their scales cost ops: on the CPU
    # current scaling's amax and scale and the delayed shadow's history update are torch ops (19 per
    # tensor); on a GPU they are two and one tiny Triton kernels
    extra = sum(with_what_ifs.values()) - sum(logged.values())
    assert 0 < extra <= 20 * inspected, (extra / inspected, (with_what_ifs - logged).most_common(10))
