"""Issue 38's planted run: a NaN in one expert's gradient at a known step and micro-batch, under MXFP8, with gradient
accumulation, on two gloo ranks (DDP), planted on rank 1 only. The guard names the expert's layer, the GEMM tensor, the
micro-batch and the step; its flag, all-reduced with MAX, makes both ranks skip that optimizer step (weights bit for
bit unchanged); the next step trains again; the checkpoint is refused unless ``allow_poisoned_checkpoint=True``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import spawning  # noqa: E402
from poisoned_moe_workers import (  # noqa: E402
    CONFIG,
    MICRO_BATCHES,
    POISON_EXPERT,
    POISON_MICRO_BATCH,
    POISON_STEP,
    STEPS,
    Net,
)

import lowprec  # noqa: E402
import nvdlfw_inspect.api as debug_api  # noqa: E402
from nvdlfw_inspect.errors import NonFiniteError  # noqa: E402

pytestmark = spawning.needs_gloo

LAYER = f"model.moe.experts.{POISON_EXPERT}.down_proj"
NAMED = (
    f"non-finite values (NaN or inf) at step {POISON_STEP}: first in layer {LAYER}, tensor gradient of the dgrad GEMM "
    f"(and wgrad), micro-batch {POISON_MICRO_BATCH}; "
)
ELSEWHERE = (
    f"non-finite values (NaN or inf) at step {POISON_STEP} on another rank of the reduction group; this rank's tensors are finite"
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[dict, Path]:
    """``{(rank, run): report}`` of both ranks and both runs (``refused``, ``allowed``), and where they wrote."""
    out_dir = spawning.spawn(HERE / "poisoned_moe_workers.py", "poisoned_moe", 2, tmp_path_factory.mktemp("moe"))
    reports = {
        (rank, run): json.loads((out_dir / f"rank{rank}_{run}.json").read_text())
        for rank in range(2)
        for run in ("refused", "allowed")
    }
    return reports, out_dir


def test_the_moe_has_one_debug_layer_per_expert_projection(runs):
    reports, _ = runs
    experts = [f"model.moe.experts.{e}.{proj}" for e in range(4) for proj in ("down_proj", "up_proj")]
    assert reports[0, "refused"]["names"] == sorted(["model.head", "model.moe.router", *experts])
    # the poisoned expert received tokens in every micro-batch of the poisoned step on both ranks: its n-th call of
    # the step is micro-batch n, so the guard's count is the micro-batch's own number
    for rank in range(2):
        tokens = reports[rank, "refused"]["steps"][POISON_STEP]["tokens"]
        assert len(tokens) == MICRO_BATCHES and all(t[POISON_EXPERT] > 0 for t in tokens), tokens


def test_the_guard_names_expert_tensor_micro_batch_and_step(runs):
    reports, _ = runs
    for run in ("refused", "allowed"):  # the second run is the same planted run: the same verdicts
        error = reports[1, run]["steps"][POISON_STEP]["error"]
        assert error["message"].startswith(NAMED), error["message"]
        assert (error["layer"], error["gemm"], error["tensor"], error["micro_batch"], error["step"]) == (
            LAYER,
            "dgrad",
            "gradient",
            POISON_MICRO_BATCH,
            POISON_STEP,
        )
        # rank 0's tensors were all finite: its verdict comes from the MAX all-reduce and names only the step
        error = reports[0, run]["steps"][POISON_STEP]["error"]
        assert error == {
            "message": ELSEWHERE,
            "layer": None,
            "gemm": None,
            "tensor": None,
            "micro_batch": None,
            "step": POISON_STEP,
        }
        for rank in range(2):
            message = reports[rank, run]["steps"][POISON_STEP]["error"]["message"]
            assert reports[rank, run]["warnings"] == [f"NonfiniteGuard: {message}"]  # warned once, on each rank
            assert reports[rank, run]["run_poisoned"] == message


def test_both_ranks_skip_the_poisoned_step_and_train_on(runs):
    reports, out_dir = runs
    for (rank, run), report in reports.items():
        steps = report["steps"]
        assert len(steps) == STEPS
        for step, record in enumerate(steps):
            if step == POISON_STEP:  # skipped: every parameter bit for bit as before
                assert record["unchanged"] and not record["all_changed"], (rank, run, step)
            else:  # a normal step, also the one after the poisoned step: every parameter updated
                assert record["error"] is None and record["all_changed"], (rank, run, step)
            assert record["finite"], (rank, run, step)
    # DDP kept the ranks in step: both skipped the same update, so their weights are identical, in both runs
    final = {(rank, run): torch.load(out_dir / f"rank{rank}_{run}.pt") for rank, run in reports}
    for params in list(final.values())[1:]:
        assert all(torch.equal(a, b) for a, b in zip(final[0, "refused"], params, strict=True))


def test_the_checkpoint_is_refused_unless_allowed(runs):
    reports, _ = runs
    for rank in range(2):
        refused = reports[rank, "refused"]
        message = refused["run_poisoned"]
        refusal = (
            f"refused: refusing to save a checkpoint of a poisoned run: {message}. Pass allow_poisoned_checkpoint=True "
            "to the integration to save it anyway"
        )
        before, after = POISON_STEP, STEPS - POISON_STEP
        # the run stays poisoned: also after a clean step, and after the session ended (a final save)
        assert [r["checkpoint"] for r in refused["steps"]] == ["saved"] * before + [refusal] * after
        assert refused["checkpoint_after_end"] == refusal
        allowed = reports[rank, "allowed"]
        assert [r["checkpoint"] for r in allowed["steps"]] == ["saved"] * STEPS
        assert allowed["checkpoint_after_end"] == "saved"


def test_an_expert_skipped_in_an_earlier_micro_batch_still_gets_the_right_number(tmp_path):
    debug_api.initialize(config_file=CONFIG, feature_dirs=[lowprec.FEATURE_DIR], log_dir=tmp_path)
    net = Net()
    debug_api.infer_and_assign_layer_names(net)
    optimizer = debug_api.guard_optimizer(torch.optim.SGD(net.parameters(), lr=0.1))
    route = net.moe.router.forward
    for micro_batch in range(POISON_MICRO_BATCH + 1):
        if micro_batch == 0:  # the router sends the poisoned expert nothing: it is not called in micro-batch 0
            net.moe.router.forward = lambda x: route(x).index_fill(1, torch.tensor([POISON_EXPERT]), -1e4)
        else:
            net.moe.router.forward = route
        net.moe.poison_expert = POISON_EXPERT if micro_batch == POISON_MICRO_BATCH else None
        with lowprec.autocast(recipe=lowprec.MXFP8BlockScaling()):
            net(torch.randn(64, 32)).float().pow(2).mean().backward()
        assert (net.moe.tokens[POISON_EXPERT] == 0) == (micro_batch == 0)
    with pytest.warns(RuntimeWarning), pytest.raises(NonFiniteError) as raised:
        optimizer.step()
    assert (raised.value.layer, raised.value.tensor) == (LAYER, "gradient")
    assert raised.value.micro_batch == POISON_MICRO_BATCH  # the layer's own call count would say one less
