"""Worker processes for tests/lowprec/modules/test_sharded_training.py (importable by spawned children).

Every rank builds the same model and feeds it the same data, so the gradient that DDP or FSDP2
averages over the ranks is each rank's own gradient, ``(g + g) / 2 == g`` exactly: a sharded or
replicated run can equal a single-process run number for number. Rank 0 also trains that
single-process run, in the same process (same threads, same kernels), for the test to compare.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

STEPS = 4
SIX = ["min", "max", "mean", "std", "l1_norm", "l2_norm"]
#: (name, wrapper, recipe, micro-batches per step)
SCENARIOS = [
    ("ddp-current", "ddp", "current", 2),
    ("ddp-delayed", "ddp", "delayed", 2),
    ("fsdp2-current", "fsdp2", "current", 1),
    ("fsdp2-delayed", "fsdp2", "delayed", 1),
    ("fsdp2-current-accumulated", "fsdp2", "current", 2),
    ("fsdp2-plan", "fsdp2", "plan", 1),
]
#: the "plan" scenario's precision plan (``fc_out`` runs the autocast's delayed scaling): GEMMs of three formats in one
#: layer, NVFP4 with stochastic rounding in another, and a layer in high precision
PLAN = {
    "rules": [
        {"layers": {"exact_layer_names": ["fc_in"]}, "fprop": "mxfp8", "dgrad": "nvfp4", "wgrad": "current"},
        {"layers": {"exact_layer_names": ["mlp.fc1"]}, "recipe": "high_precision"},
        {"layers": {"exact_layer_names": ["mlp.fc2"]}, "recipe": "nvfp4"},
    ]
}


warnings.filterwarnings("ignore", message=".*FSDP2-wrapped module.*")  # outputs are views: harmless here
warnings.filterwarnings("ignore", message=".*_register_pre_backward_hook.*")


def build_model() -> torch.nn.Module:
    """Two ``lowprec.Linear`` around a ``lowprec.LayerNormMLP`` (two GEMM layers and a norm in one module)."""
    import lowprec

    torch.manual_seed(0)
    return torch.nn.Sequential(
        lowprec.Linear(16, 32, name="fc_in"),
        torch.nn.GELU(),
        lowprec.LayerNormMLP(32, 64, name="mlp"),
        lowprec.Linear(32, 8, name="fc_out"),
    )


def batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same micro-batch on every rank."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randn(6, 16, generator=g) * 2.0, torch.randn(6, 8, generator=g)


def make_recipe(name: str):
    import lowprec

    return lowprec.Float8CurrentScaling() if name == "current" else lowprec.DelayedScaling()


def make_plan(name: str):
    from lowprec.plan import load_plan

    return load_plan(PLAN) if name == "plan" else None


def fsdp2(model: torch.nn.Module) -> torch.nn.Module:
    """``fully_shard`` on every lowprec layer, then on the root."""
    from torch.distributed.fsdp import fully_shard

    import lowprec

    for module in model:
        if isinstance(module, (lowprec.Linear, lowprec.LayerNormMLP)):
            fully_shard(module)
    return fully_shard(model)


def count_weight_casts() -> dict[str, int]:
    """Counts the weight casts the caches made and those they reused (``WeightCache.quantize`` calls
    that returned the cast they already held)."""
    from lowprec.quant.weight_cache import WeightCache

    counts = {"cast": 0, "reused": 0}
    original = WeightCache.quantize

    def counted(self, weight, quantizer, transpose):
        held = self._cast
        cast = original(self, weight, quantizer, transpose)
        counts["reused" if cast is held else "cast"] += 1
        return cast

    WeightCache.quantize = counted
    return counts


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, whole: DTensor shards are gathered (a collective: every rank must call)."""
    from torch.distributed.tensor import DTensor

    module = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for name, p in module.named_parameters()}


def train(wrapper: str, recipe_name: str, micro_batches: int, on_step=None) -> dict:
    """``STEPS`` Adam steps of ``build_model()`` wrapped by ``wrapper`` ("none", "ddp" or "fsdp2"),
    each accumulating ``micro_batches`` micro-batches (``recipe_name`` "plan": delayed scaling under ``PLAN``);
    returns the losses and the final whole weights."""
    import lowprec

    model = build_model()
    if wrapper == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif wrapper == "fsdp2":
        model = fsdp2(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    recipe, plan = make_recipe(recipe_name), make_plan(recipe_name)
    losses = []
    for step in range(STEPS):
        if on_step is not None:
            on_step(step, model)
        optimizer.zero_grad()
        for micro in range(micro_batches):
            x, target = batch(step, micro)
            with lowprec.autocast(recipe=recipe, plan=plan):
                out = model(x)
            loss = torch.nn.functional.mse_loss(out, target)
            loss.backward()
            losses.append(loss.detach())
        optimizer.step()
    return {"losses": torch.stack(losses), "weights": full_weights(model)}


def training(rank: int, world: int, out_dir: Path) -> None:
    """Every scenario of ``SCENARIOS`` on this rank (rank 0: and single-process); saves the results
    and how many weight casts were made and reused."""
    counts = count_weight_casts()
    results: dict = {}
    for name, wrapper, recipe, micro_batches in SCENARIOS:
        counts.update(cast=0, reused=0)
        results[name] = train(wrapper, recipe, micro_batches)
        results[name]["casts"] = dict(counts)
        if rank == 0:
            counts.update(cast=0, reused=0)
            results[name]["single"] = train("none", recipe, micro_batches)
            results[name]["single"]["casts"] = dict(counts)
    torch.save(results, out_dir / f"training{rank}.pt")


STATS_CONFIG = {
    "picked": {
        "enabled": True,
        "layers": {"layer_name_regex_pattern": r"^model\.(0|2\.fc1)$"},
        "transformer_engine": {"LogTensorStats": {"enabled": True, "tensors": ["activation", "weight"], "stats": SIX}},
    }
}


def fsdp2_statistics(rank: int, world: int, out_dir: Path) -> None:
    """FSDP2 model named by ``infer_and_assign_layer_names`` after ``fully_shard``, two steps of two
    micro-batches with weight and activation statistics of ``model.0`` and ``model.2.fc1``; saves the
    whole weights and the shards of this rank before each step, and the losses."""
    import lowprec
    import nvdlfw_inspect.api as debug_api

    debug_api.initialize(config_file=STATS_CONFIG, feature_dirs=[lowprec.FEATURE_DIR], log_dir=str(out_dir / "logs"))
    model = fsdp2(build_model())
    debug_api.infer_and_assign_layer_names(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    fed: dict = {"whole": [], "shards": [], "x": [], "losses": []}
    for step in range(2):
        fed["whole"].append(full_weights(model))
        fed["shards"].append({name: p.to_local().detach().clone() for name, p in model.named_parameters()})
        optimizer.zero_grad()
        for micro in range(2):
            x, target = batch(step, micro)
            fed["x"].append(x)
            with lowprec.fp8_autocast(fp8_recipe=lowprec.Float8CurrentScaling()):
                loss = torch.nn.functional.mse_loss(model(x), target)
            loss.backward()
            fed["losses"].append(loss.detach())
        optimizer.step()
        debug_api.step()
    fed["losses"] = torch.stack(fed["losses"])
    torch.save(fed, out_dir / f"fed{rank}.pt")


def everything(rank: int, world: int, out_dir: Path) -> None:
    """``training`` then ``fsdp2_statistics`` in one spawn: most of a spawn's time is importing torch."""
    training(rank, world, out_dir)
    fsdp2_statistics(rank, world, out_dir)
