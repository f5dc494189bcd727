"""FP8 training under DDP and FSDP2 on 2 gloo processes equals single-process training number for number.

Both ranks see the same data, so the averaged gradient is exactly each rank's gradient and every
loss and weight must match the single-process run bit for bit (``torch.equal``), with current and
delayed scaling and under a precision plan of mixed formats (``sharded_workers.PLAN``). FSDP2 used
to drift after a few steps: its unsharded parameter is one tensor whose storage is freed and
refilled, often at the same address, without a version bump, and the weight cache took the new
step's weight for the old one (see ``lowprec.quant.weight_cache``)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
from logreader import read_stats
from statref import reference_stats

import lowprec
from lowprec.quant.per_tensor import CurrentScalingQuantizer
from lowprec.quant.weight_cache import WeightCache, owns_its_storage

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import sharded_workers as workers  # noqa: E402
import spawning  # noqa: E402

WORLD = 2


def spawn(body: str, tmp_path: Path) -> Path:
    return spawning.spawn(HERE / "sharded_workers.py", body, WORLD, tmp_path)


# --- the cache on its own: reuse for a weight that owns its storage, a recast for an FSDP2-like one ---


class CountingQuantizer(CurrentScalingQuantizer):
    def __init__(self):
        super().__init__(lowprec.E4M3)
        self.casts = 0

    def quantize(self, tensor, transpose=False):
        self.casts += 1
        return super().quantize(tensor, transpose)


def test_cache_recasts_a_weight_refilled_through_another_tensor_without_a_version_bump():
    """FSDP2's pattern: the module's weight is a parameter over an all-gather buffer that FSDP2 frees,
    reallocates and refills under ``_unsafe_preserve_version_counter``: same object, address, version."""
    buffer = torch.empty(8 * 8)
    weight = torch.nn.Parameter(torch.as_strided(buffer, (8, 8), (8, 1), 0))
    cache, quantizer = WeightCache(), CountingQuantizer()
    for values in (torch.randn(64), torch.randn(64) * 3):
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(buffer):
            buffer.copy_(values)
        assert weight._version == 0 and not owns_its_storage(weight)
        cast = cache.quantize(weight, quantizer, transpose=False)
        assert torch.equal(cast.data.view(torch.uint8), quantizer.quantize(weight).data.view(torch.uint8))
    assert quantizer.casts == 4  # every call casts


def test_cache_reuses_the_cast_of_a_weight_owning_its_storage_and_of_views_of_it():
    weight = torch.nn.Parameter(torch.randn(8, 8))
    cache, quantizer = WeightCache(), CountingQuantizer()
    assert owns_its_storage(weight) and owns_its_storage(weight.t())
    first = cache.quantize(weight, quantizer, transpose=True)
    (weight * 1.0).sum().backward()  # a micro-batch's backward: the next one may reuse the cast
    assert cache.quantize(weight, quantizer, transpose=False) is first and quantizer.casts == 1
    transposed = WeightCache()  # a layer handing over weight.t() (a new view every call)
    once = transposed.quantize(weight.t(), quantizer, False)
    (weight * 1.0).sum().backward()
    again = transposed.quantize(weight.t(), quantizer, False)  # (a view still alive would be another holder)
    assert again is once and quantizer.casts == 2
    # a square weight and its transpose share address, version, shape and dtype: the strides tell them apart
    assert not torch.equal(cache.quantize(weight.t(), quantizer, False).data.float(), first.data.float())


def test_cache_does_not_take_a_new_tensor_at_a_freed_weights_address_for_it():
    """A weight computed in forward is a new tensor each time, often where the last one was freed,
    with the same version: only its identity tells it apart."""
    cache, quantizer = WeightCache(), CountingQuantizer()
    base = torch.randn(16, 16)
    for scale in (1.0, 2.0, 3.0):
        computed = base * scale
        cast = cache.quantize(computed, quantizer, transpose=False)
        assert torch.equal(cast.dequantize(), quantizer.quantize(computed).dequantize())
        del computed, cast
    assert quantizer.casts == 6


# --- 2 gloo processes ---


@pytest.fixture(scope="module")
def spawned(tmp_path_factory) -> Path:
    """One spawn for every distributed test below: most of its time is importing torch in the workers."""
    return spawn("everything", tmp_path_factory.mktemp("sharded"))


@pytest.fixture(scope="module")
def trained(spawned) -> list[dict]:
    return [torch.load(spawned / f"training{rank}.pt") for rank in range(WORLD)]


def assert_same_training(got: dict, want: dict) -> None:
    assert torch.equal(got["losses"], want["losses"]), (got["losses"], want["losses"])
    assert got["weights"].keys() == want["weights"].keys()
    for name, weight in want["weights"].items():
        assert torch.equal(got["weights"][name], weight), name


@spawning.needs_gloo
@pytest.mark.parametrize("scenario", [name for name, *_ in workers.SCENARIOS])
def test_distributed_fp8_training_equals_single_process_training(trained, scenario):
    single = trained[0][scenario]["single"]
    steps = workers.STEPS * dict((name, micro) for name, *_, micro in workers.SCENARIOS)[scenario]
    assert single["losses"].shape == (steps,) and single["losses"].isfinite().all()
    with torch.random.fork_rng():
        initial = workers.build_model()[0].weight.detach()
    assert not torch.equal(single["weights"]["0.weight"], initial)  # it trained
    for rank in range(WORLD):
        assert_same_training(trained[rank][scenario], single)


@spawning.needs_gloo
def test_the_cache_saves_recasts_where_it_can_and_only_there(trained):
    # 4 GEMM layers; single process and DDP: a weight cast per layer and step, reused by the second micro-batch
    per_step = {"cast": 4 * workers.STEPS, "reused": 4 * workers.STEPS}
    assert trained[0]["ddp-current"]["single"]["casts"] == per_step
    for rank in range(WORLD):
        assert trained[rank]["ddp-current"]["casts"] == per_step
        # FSDP2: its unsharded weights are refilled in place, so every micro-batch casts
        assert trained[rank]["fsdp2-current-accumulated"]["casts"] == {"cast": 8 * workers.STEPS, "reused": 0}


@spawning.needs_gloo
def test_fsdp2_weight_statistics_are_those_of_the_whole_weight_and_routing_uses_the_assigned_names(spawned):
    out_dir = spawned
    fed = [torch.load(out_dir / f"fed{rank}.pt") for rank in range(WORLD)]
    assert torch.equal(fed[0]["losses"], fed[1]["losses"])
    weights = {"model.0": "0.weight", "model.2.fc1": "2.fc1_weight"}
    for rank in range(WORLD):
        stats = read_stats(out_dir / "logs", rank)
        logged = {re.match(r"^(.*)_(activation|weight)_", name).groups() for name, _ in stats}
        assert logged == {(layer, tensor) for layer in weights for tensor in ("activation", "weight")}  # no other layer
        for step in range(2):
            for layer, param in weights.items():
                whole, shard = fed[rank]["whole"][step][param], fed[rank]["shards"][step][param]
                assert shard.numel() * WORLD == whole.numel()  # the parameter is sharded between forwards
                for stat, want in reference_stats(whole, tuple(workers.SIX)).items():
                    got = stats[(f"{layer}_weight_{stat}", step)]
                    assert got == pytest.approx(want, rel=1e-6, abs=6e-5), (rank, step, layer, stat)  # the file keeps 4 decimals
                shard_l2 = reference_stats(shard, ("l2_norm",))["l2_norm"]
                assert stats[(f"{layer}_weight_l2_norm", step)] != pytest.approx(shard_l2, rel=1e-3)
            # the first layer's activations: both micro-batches of both ranks (the same data)
            xs = fed[rank]["x"][2 * step : 2 * step + 2]
            for stat, want in reference_stats(torch.cat(xs * WORLD), tuple(workers.SIX)).items():
                assert stats[(f"model.0_activation_{stat}", step)] == pytest.approx(want, rel=1e-6, abs=6e-5), (rank, step, stat)
