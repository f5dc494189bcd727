"""Rank bodies for test_poisoned_moe_step (issue 38): a small mixture of experts of ``lowprec.Linear`` layers trained
under MXFP8 with gradient accumulation on two gloo ranks (DDP), a NaN planted on rank 1 only into the gradient
reaching expert 2's down projection at step ``POISON_STEP``, micro-batch ``POISON_MICRO_BATCH``. Each rank writes what
the guard said and what each step did to ``rank{r}_{run}.json``, and its final parameters to ``rank{r}_{run}.pt``."""

from __future__ import annotations

import contextlib
import json
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import lowprec
import nvdlfw_inspect.api as debug_api
from lowprec.integrations.session import DebugSession
from nvdlfw_inspect.errors import NonFiniteError, PoisonedCheckpointError

CONFIG = {
    "guard": {
        "enabled": True,
        "layers": {"layer_name_regex_pattern": ".*"},
        "transformer_engine": {"NonfiniteGuard": {"enabled": True, "on_nonfinite": "raise"}},
    }
}
HIDDEN, INTERMEDIATE, EXPERTS, TOKENS = 32, 64, 4, 64
STEPS, MICRO_BATCHES = 5, 4
POISON_RANK, POISON_STEP, POISON_MICRO_BATCH, POISON_EXPERT = 1, 3, 2, 2


class Expert(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up_proj = lowprec.Linear(HIDDEN, INTERMEDIATE)
        self.down_proj = lowprec.Linear(INTERMEDIATE, HIDDEN)

    def forward(self, x: torch.Tensor, poison: bool) -> torch.Tensor:
        y = self.down_proj(torch.relu(self.up_proj(x)))
        if poison:  # the gradient into this expert's down projection gets one NaN
            y.register_hook(_one_nan)
        return y


def _one_nan(grad: torch.Tensor) -> torch.Tensor:
    grad = grad.clone()
    grad[0, 0] = float("nan")
    return grad


class MoE(torch.nn.Module):
    """Top-1 routing: each token goes to its most probable expert, scaled by that probability; an expert that
    receives no token is not called (the test checks that the poisoned expert received tokens in every micro-batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.router = lowprec.Linear(HIDDEN, EXPERTS)
        self.experts = torch.nn.ModuleList(Expert() for _ in range(EXPERTS))
        self.poison_expert: int | None = None  # set by the training loop for the planted micro-batch
        self.tokens: list[int] = []  # how many tokens each expert received in the last forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.router(x).float(), dim=-1)
        weight, choice = probs.max(dim=-1)
        out = torch.zeros_like(x)
        self.tokens = []
        for index, expert in enumerate(self.experts):
            rows = (choice == index).nonzero().squeeze(1)
            self.tokens.append(rows.numel())
            if rows.numel():
                y = expert(x[rows], poison=index == self.poison_expert)
                out = out.index_add(0, rows, y * weight[rows, None].to(y.dtype))
        return out


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same initial weights on every rank
        self.moe = MoE()
        self.head = lowprec.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x + self.moe(x))


def _error(error: NonFiniteError) -> dict:
    return {
        "message": str(error),
        "layer": error.layer,
        "gemm": error.gemm,
        "tensor": error.tensor,
        "micro_batch": error.micro_batch,
        "step": error.step,
    }


def _checkpoint(session: DebugSession) -> str:
    try:
        session.check_checkpoint()
    except PoisonedCheckpointError as error:
        return f"refused: {error}"
    return "saved"


def _train(rank: int, out_dir: Path, allow: bool) -> None:
    run = "allowed" if allow else "refused"
    net = Net()
    model = DistributedDataParallel(net)
    session = DebugSession(
        CONFIG,
        feature_dirs=[lowprec.FEATURE_DIR],
        log_dir=out_dir / run,
        recipe=lowprec.MXFP8BlockScaling(),
        allow_poisoned_checkpoint=allow,
    )
    session.start(model)  # names the layers of the model inside DDP: model.moe.experts.2.down_proj, ...
    debug_api.set_tensor_reduction_group(dist.group.WORLD)
    optimizer = debug_api.guard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    data = torch.Generator().manual_seed(100 + rank)  # each rank its own batches
    report: dict = {"names": sorted(m.name for m in net.modules() if isinstance(m, lowprec.Linear)), "steps": []}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            tokens = []
            for micro_batch in range(MICRO_BATCHES):
                planted = (rank, step, micro_batch) == (POISON_RANK, POISON_STEP, POISON_MICRO_BATCH)
                net.moe.poison_expert = POISON_EXPERT if planted else None
                last = micro_batch == MICRO_BATCHES - 1
                with contextlib.nullcontext() if last else model.no_sync():  # DDP all-reduces at the last only
                    out = model(torch.randn(TOKENS, HIDDEN, generator=data))  # under MXFP8 (the session's autocast)
                    out.float().pow(2).mean().backward()
                tokens.append(net.moe.tokens)
            before = [p.detach().clone() for p in net.parameters()]
            record: dict = {"tokens": tokens, "error": None}
            try:
                optimizer.step()
            except NonFiniteError as error:
                record["error"] = _error(error)
            after = list(net.parameters())
            record["unchanged"] = all(torch.equal(b, a) for b, a in zip(before, after, strict=True))
            record["all_changed"] = not any(torch.equal(b, a) for b, a in zip(before, after, strict=True))
            record["finite"] = all(bool(torch.isfinite(a).all()) for a in after)
            optimizer.zero_grad()
            session.step()  # debug_api.step(): reuses the verdict the optimizer read, raises nothing more
            record["checkpoint"] = _checkpoint(session)
            report["steps"].append(record)
    report["warnings"] = [str(w.message) for w in caught if "NonfiniteGuard" in str(w.message)]
    report["run_poisoned"] = debug_api.run_poisoned()
    session.end()
    report["checkpoint_after_end"] = _checkpoint(session)
    (out_dir / f"rank{rank}_{run}.json").write_text(json.dumps(report))
    torch.save([p.detach() for p in net.parameters()], out_dir / f"rank{rank}_{run}.pt")


def poisoned_moe(rank: int, world: int, out_dir: Path) -> None:
    """The planted run twice: with the integrations' default (checkpoints refused after the poisoned step), and with
    ``allow_poisoned_checkpoint=True``."""
    _train(rank, out_dir, allow=False)
    _train(rank, out_dir, allow=True)
