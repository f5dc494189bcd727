"""Tiny FP8 (current scaling) runs that diverge, for ``diagnose``'s growth findings: each returns its losses, so a
test can tell where the loss diverged and how long before it the growth was flagged.

``growing_channel_run``: a two-layer MLP regression whose input channel ``CHANNEL`` is multiplied by ``growth`` more
each step (an outlier feature that grows); SGD diverges once that channel's curvature passes 2 / lr (x100 its starting
loss at step 17, NaN from step 20). ``growth=1``: the same run, healthy.
``attention_run``: one attention head (q, k, v projections) trained on a new sequence each step to match a fixed
teacher head, with SGD and momentum 0.95 (``SGD_MOMENTUM``). At a too-high ``lr`` (2.5) the query and key weights, and
so the attention logits, grow over tens of steps while the loss creeps up: the largest logit from 2 to 25 by step 28
(the q and k weights' scales x8 their start from iteration 28 to 34, the loss about x2) and 130 by step 36, where the
attention's entropy has fallen from 4.1 (uniform over 64 tokens) to 0.1; then the loss runs away, x100 its start at
step 50 to 53 (the step moves with the CPU's matmul kernels) and still finite within the 64 steps. Logit growth and
entropy collapse before the loss diverges, as in Wortsman et al. (arXiv 2309.14322). ``lr=0.5``: healthy, and so is
Adam at ``lr=0.01``; the q and k scales of both grow x2.6 to x3 while the loss falls.
Both log kurtosis, rms, outlier_channel_ratio, max_channel and cur_amax of every GEMM tensor (``LogTensorStats``)
and scale_inv_max of the cast ones (``LogFp8TensorStats``); with ``guard=True`` also ``NonfiniteGuard`` (warn), which
names the first tensor of a step that holds NaN or inf in the debug log.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from pathlib import Path

import torch

import lowprec
import nvdlfw_inspect.api as debug_api

EARLY = ["kurtosis", "rms", "outlier_channel_ratio", "max_channel", "cur_amax"]
STATS = {
    "LogTensorStats": {"enabled": True, "tensors": ["activation", "weight", "output"], "stats": EARLY},
    "LogFp8TensorStats": {"enabled": True, "tensors": ["activation", "weight"], "stats": ["scale_inv_max"]},
}
WIDTH, TOKENS, CHANNEL = 32, 64, 3
#: ``attention_run``'s optimizer: SGD with heavy-ball momentum
SGD_MOMENTUM = functools.partial(torch.optim.SGD, momentum=0.95)


def _start(log_dir: Path, guard: bool = False) -> None:
    features = STATS | ({"NonfiniteGuard": {"enabled": True}} if guard else {})
    config = {"early": {"enabled": True, "layers": {"layer_name_regex_pattern": ".*"}, "transformer_engine": features}}
    debug_api.initialize(config_file=config, feature_dirs=[lowprec.FEATURE_DIR], log_dir=str(log_dir))


def _train(optimizer: torch.optim.Optimizer, steps: int, loss_at: Callable[[int], torch.Tensor]) -> list[float]:
    """``steps`` optimizer steps on ``loss_at(step)``, each closed by ``debug_api.step()``; the debug run ends however
    they end. The losses. On one thread, given back after: the matmuls are too small to gain from more, and a pytest
    worker's OpenMP threads that wait on another worker's for the cores slow such a run tenfold."""
    losses, threads = [], torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for step in range(steps):
            loss = loss_at(step)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            debug_api.step()
    finally:
        debug_api.end_debug()
        torch.set_num_threads(threads)
    return losses


def diverged_at(losses: list[float], factor: float = 100.0) -> int | None:
    """The first step whose loss is not finite or ``factor`` times the median of the first three; None if none."""
    start = sorted(losses[:3])[1]
    return next((step for step, loss in enumerate(losses) if not math.isfinite(loss) or loss > factor * start), None)


def growing_channel_run(
    log_dir: Path, steps: int = 30, growth: float = 1.25, lr: float = 0.02, guard: bool = False
) -> list[float]:
    _start(log_dir, guard)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    fc1, fc2 = lowprec.Linear(WIDTH, WIDTH, name="model.fc1"), lowprec.Linear(WIDTH, 1, name="model.fc2")
    teacher = torch.randn(WIDTH, 1, generator=gen) / math.sqrt(WIDTH)
    optimizer = torch.optim.SGD([*fc1.parameters(), *fc2.parameters()], lr=lr)

    def loss_at(step: int) -> torch.Tensor:
        x = torch.randn(TOKENS, WIDTH, generator=gen)
        scaled = x.clone()
        scaled[:, CHANNEL] *= growth**step
        with lowprec.fp8_autocast(fp8_recipe=lowprec.Float8CurrentScaling()):
            y = fc2(torch.nn.functional.gelu(fc1(scaled)))
        return torch.nn.functional.mse_loss(y.float(), x @ teacher)

    return _train(optimizer, steps, loss_at)


def attention_run(
    log_dir: Path, steps: int = 64, lr: float = 2.5, optimizer: Callable[..., torch.optim.Optimizer] = SGD_MOMENTUM
) -> list[float]:
    _start(log_dir)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    names = ("q", "k", "v")
    proj = {name: lowprec.Linear(WIDTH, WIDTH, name=f"model.attn.{name}_proj") for name in names}
    xs = torch.randn(steps, TOKENS, WIDTH, generator=gen)  # a new sequence each step
    targets = torch.softmax(xs @ xs.mT / math.sqrt(WIDTH), dim=-1) @ xs  # a teacher head
    optimizer = optimizer([p for layer in proj.values() for p in layer.parameters()], lr=lr)

    def loss_at(step: int) -> torch.Tensor:
        x, target = xs[step], targets[step]
        with lowprec.fp8_autocast(fp8_recipe=lowprec.Float8CurrentScaling()):
            q, k, v = (proj[name](x).float() for name in names)
        out = torch.softmax(q @ k.T / math.sqrt(WIDTH), dim=-1) @ v
        return torch.nn.functional.mse_loss(out, target)

    return _train(optimizer, steps, loss_at)
