"""Rank bodies for test_nonfinite_guard_distributed: a NaN planted in fc1's gradient on rank 1 only."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

import lowprec
import nvdlfw_inspect.api as debug_api
from nvdlfw_inspect.errors import NonFiniteError

CONFIG = {
    "guard": {
        "enabled": True,
        "layers": {"layer_name_regex_pattern": ".*"},
        "transformer_engine": {"NonfiniteGuard": {"enabled": True, "on_nonfinite": "raise"}},
    }
}


def _step(rank: int, out_dir: Path, reduce: bool, config: dict = CONFIG, prefix: str = "model") -> None:
    debug_api.initialize(config_file=config, feature_dirs=[lowprec.FEATURE_DIR], log_dir=out_dir)
    if reduce:
        debug_api.set_tensor_reduction_group(dist.group.WORLD)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(lowprec.Linear(32, 32, name=f"{prefix}.{i}") for i in range(2)))
    optimizer = debug_api.guard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    for micro_batch in range(2):
        with lowprec.autocast(recipe=lowprec.MXFP8BlockScaling()):
            hidden = model[0](torch.randn(16, 32))
            if rank == 1 and micro_batch == 1:
                hidden.register_hook(lambda grad: grad * float("nan"))
            model[1](hidden).float().pow(2).mean().backward()
    before = [p.detach().clone() for p in model.parameters()]
    report: dict = {"raised": None}
    try:
        optimizer.step()
    except NonFiniteError as error:
        report["raised"] = {"message": str(error), "layer": error.layer, "micro_batch": error.micro_batch, "step": error.step}
    report["unchanged"] = all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
    report["poisoned"] = debug_api.run_poisoned()
    debug_api.step()
    (out_dir / f"rank{rank}_{reduce}.json").write_text(json.dumps(report))


def reduced(rank: int, world: int, out_dir: Path) -> None:
    _step(rank, out_dir, reduce=True)


def per_rank(rank: int, world: int, out_dir: Path) -> None:
    _step(rank, out_dir, reduce=False)


def one_rank_unguarded(rank: int, world: int, out_dir: Path) -> None:
    """The guard selects the layers named ``model.*``; rank 0's are ``other.*``: none of its tensors reaches the guard,
    and it still takes part in the verdict's reduction."""
    config = {"guard": CONFIG["guard"] | {"layers": {"layer_name_regex_pattern": r"^model\."}}}
    _step(rank, out_dir, reduce=True, config=config, prefix="model" if rank == 1 else "other")
