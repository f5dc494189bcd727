"""The plan search's calibration (``lowprec.planner``): probes of every GEMM in every candidate format on a real small
model, a planted sensitive layer (an outlier channel in its input) measured as the most damaged and kept wide by the
search, the damage model's fit, a calibration saved and read back giving the same plan, and the what-if statistics of
every GEMM's operands (checked against float64 computed here) on the page."""

from __future__ import annotations

import json
import math

import pytest
import torch
from planted_plan import WIDTH, factory

import lowprec
from lowprec.plan import named_recipe
from lowprec.plan.search import GEMMS, Unit, search
from lowprec.planner.calibrate import Calibration, calibrate
from lowprec.planner.operands import ERROR_STATS, OPERANDS, captured_operands, operand_errors
from lowprec.planner.page import reasons
from lowprec.planner.predict import fit_kappa, options, totals
from lowprec.study import decode_e4m3, decode_e8m0


def training():
    torch.manual_seed(0)
    model, batch = factory()
    return model, batch, model


def adam(model: torch.nn.Module, steps: int):
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)


@pytest.fixture(scope="module")
def calibration():
    return calibrate(training(), ["nvfp4", "mxfp8", "bf16"], steps=6, make_optimizer=adam, checkpoints=2, probe_batches=2)


def test_every_gemm_is_probed_in_every_candidate_and_the_planted_layer_is_the_most_damaged(calibration):
    assert calibration.sizes == {"model.a": WIDTH * WIDTH, "model.b": WIDTH * WIDTH, "model.c": WIDTH}
    assert calibration.checkpoints == [3, 6] and len(calibration.losses) == 6
    keys = {Calibration.key(layer, gemm, fmt) for layer in calibration.sizes for gemm in GEMMS for fmt in ("nvfp4", "mxfp8")}
    assert set(calibration.update) == keys and set(calibration.direct) == keys
    assert all(len(calibration.samples[key]) == 4 for key in keys)  # 2 checkpoints x 2 probe batches
    assert all(calibration.direct[key] == 0 for key in keys if "|fprop|" not in key)  # only fprop touches the forward
    # the outlier channel sets NVFP4's block scales of model.b's input: its fprop damages the gradient most
    worst = max(keys, key=lambda key: calibration.update[key])
    assert worst == "model.b|fprop|nvfp4"
    for layer in calibration.sizes:  # 4 bits lose more than 8, GEMM by GEMM
        for gemm in GEMMS:
            assert calibration.update[f"{layer}|{gemm}|nvfp4"] >= calibration.update[f"{layer}|{gemm}|mxfp8"]


def test_the_gradient_error_is_the_relative_squared_error_of_a_real_step(calibration):
    """Recompute one probe by hand from the calibrated model's first checkpoint is not possible after training, so
    check the quantity on a fresh model: ``||g_fmt - g||^2 / ||g||^2`` of one GEMM in one format."""
    model, batch, loss_of = training()
    x = batch(0)

    def grads(plan) -> torch.Tensor:
        model.zero_grad()
        with lowprec.autocast(enabled=False, plan=plan):
            loss_of(x).backward()
        return torch.cat([p.grad.reshape(-1).double() for p in model.parameters()])

    plan = {"rules": [{"layers": {"exact_layer_names": ["model.b"]}, "fprop": "nvfp4"}]}
    error = (grads(plan) - grads(None)).square().sum() / grads(None).square().sum()
    assert 1e-4 < error.item() < 1  # what a probe measures: a real, small, non-zero error


def test_the_damage_model_is_fitted_on_the_cheapest_run_and_the_search_keeps_the_planted_layer_wide(calibration):
    every = {Unit(layer, gemm): "nvfp4" for layer in calibration.sizes for gemm in GEMMS}
    direct, update = totals(calibration, every)
    kappa = fit_kappa(calibration, "nvfp4", measured_gap=direct + 2 * update)
    assert kappa == pytest.approx(2.0)
    assert fit_kappa(calibration, "nvfp4", measured_gap=direct / 2) == 0.0  # the direct damage explains it all
    units = options(calibration, kappa)
    full = sum(option.damage for unit, choices in units.items() for option in choices if option.format == "nvfp4")
    assert full == pytest.approx(direct + 2 * update)
    budget = full - 2 * calibration.update["model.b|fprop|nvfp4"] * 0.5  # room for all but half of model.b's fprop
    result = search(units, budget)
    formats = result.formats()
    assert formats["model.b"]["fprop"] != "nvfp4" and result.within_budget
    assert formats["model.a"] == dict.fromkeys(GEMMS, "nvfp4")


def test_a_calibration_saved_and_read_back_gives_the_same_plan(calibration, tmp_path):
    again = Calibration.load(calibration.save(tmp_path / "calibration.json"))
    assert again == calibration
    budget = 0.5 * sum(calibration.update.values())
    assert search(options(again, 1.0), budget) == search(options(calibration, 1.0), budget)
    assert math.isfinite(calibration.seconds) and calibration.seconds > 0


class Experts(torch.nn.Module):
    """Three experts of a ``GroupedLinear``; the router sends every token to the first two, none to ``gemm_2``."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = lowprec.GroupedLinear(3, WIDTH, WIDTH, name="model.experts")
        self.head = lowprec.Linear(WIDTH, 1, name="model.head")

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        half = x.shape[0] // 2
        hidden = self.experts(x, [half, x.shape[0] - half, 0])
        return torch.nn.functional.mse_loss(self.head(torch.tanh(hidden)), y)


def test_an_expert_no_probe_reaches_takes_its_peers_worst_damage_and_it_is_said():
    torch.manual_seed(0)
    model = Experts()
    _, batch = factory()
    with pytest.warns(UserWarning, match=r"1 GEMM layer\(s\) ran on no probe batch .*model\.experts\.gemm_2"):
        found = calibrate((model, batch, model), ["nvfp4"], steps=2, make_optimizer=adam, checkpoints=1)
    assert found.samples["model.experts.gemm_2|fprop|nvfp4"] == []
    for gemm in GEMMS:
        peers = [found.update[f"model.experts.gemm_{i}|{gemm}|nvfp4"] for i in (0, 1)]
        assert found.update[f"model.experts.gemm_2|{gemm}|nvfp4"] == max(peers)
        assert len(found.samples[f"model.experts.gemm_0|{gemm}|nvfp4"]) == 1


def test_every_operand_is_measured_in_every_candidate_and_the_outlier_channel_flushes_nvfp4(calibration):
    for layer in calibration.sizes:
        for gemm in GEMMS:
            for fmt in ("nvfp4", "mxfp8"):
                errors = calibration.errors[Calibration.key(layer, gemm, fmt)]
                assert list(errors) == [name for name, _ in OPERANDS[gemm]]
                assert all(list(stats) == list(ERROR_STATS) for stats in errors.values())
    flushed = {key: calibration.errors[key]["activation"]["underflow%"] for key in calibration.errors if "|fprop|" in key}
    # channel 7 sets the scale of its NVFP4 block of 16 in model.b's input: its neighbours flush to zero
    assert flushed["model.b|fprop|nvfp4"] > 15 and flushed["model.b|fprop|nvfp4"] > 2 * flushed["model.a|fprop|nvfp4"]
    assert flushed["model.b|fprop|mxfp8"] < 1 and flushed["model.a|fprop|mxfp8"] < 1


def test_the_statistics_are_those_of_the_gemms_real_operands_computed_in_float64():
    model, batch, loss_of = training()
    seen = {}
    model.b.register_forward_pre_hook(lambda module, args: seen.update(x=args[0].detach()))
    model.b.register_full_backward_hook(lambda module, grad_in, grad_out: seen.update(dy=grad_out[0].detach()))
    with captured_operands(model) as operands:
        loss_of(batch(0)).backward()
    assert set(operands) == {"model.a", "model.b", "model.c"}
    assert torch.equal(operands["model.b"]["activation"][0], seen["x"])
    assert torch.equal(operands["model.b"]["gradient"][0], seen["dy"])
    assert torch.equal(operands["model.b"]["weight"][0], model.b.weight.detach())
    errors = operand_errors(operands, ["nvfp4", "mxfp8"])
    x = seen["x"].double()
    for fmt, width, largest in (("nvfp4", 16, _nvfp4_largest), ("mxfp8", 32, _mxfp8_largest)):
        view = lowprec.quantize(seen["x"], named_recipe(fmt), "activation", layer_name="model.b")
        q = view.dequantize(torch.float64, "rowwise")
        blocks, cast = x.reshape(x.shape[0], -1, width), q.reshape(x.shape[0], -1, width)
        clipped = (blocks.abs() > cast.abs()) & (cast.abs() == largest(view.rowwise).unsqueeze(-1))
        nonzero = (x != 0).sum().item()
        expected = {
            "rel_mse": ((q - x).square().sum() / x.square().sum()).item(),
            "underflow%": 100 * ((x != 0) & (q == 0)).sum().item() / nonzero,
            "saturation%": 100 * clipped.sum().item() / nonzero,
            "worst_block_rel_err": ((cast - blocks).norm(dim=-1) / blocks.norm(dim=-1)).max().item(),
        }
        assert errors[("model.b", "fprop", fmt)]["activation"] == pytest.approx(expected, rel=1e-6), fmt
    assert errors[("model.b", "fprop", "nvfp4")]["activation"]["underflow%"] > 15


def _nvfp4_largest(rowwise) -> torch.Tensor:
    """E2M1's largest value 6 times each block's decode scale, in fp32 as the cast multiplies it."""
    return (6 * decode_e4m3(rowwise.scale_inv) * rowwise.global_scale_inv).double()


def _mxfp8_largest(rowwise) -> torch.Tensor:
    """E4M3's largest value 448 times each block's E8M0 scale."""
    return (448 * decode_e8m0(rowwise.scale_inv)).double()


def test_the_page_says_why_with_the_operands_errors_and_a_calibration_without_them_still_loads(calibration, tmp_path):
    formats = {layer: dict.fromkeys(GEMMS, "nvfp4") for layer in calibration.sizes}
    formats["model.b"]["fprop"] = "mxfp8"
    page = reasons(calibration, formats, kappa=1.0)
    stats = calibration.errors["model.b|fprop|nvfp4"]["activation"]
    assert f"activation: {stats['rel_mse']:.2g}, {stats['underflow%']:.3g}% flushed" in page
    assert f"nvfp4 on the activation, {stats['underflow%']:.3g}% flushed (relative mse {stats['rel_mse']:.2g})" in page
    assert "; kept mxfp8</td>" in page and "the cheapest candidate; kept</td>" in page
    data = json.loads(calibration.save(tmp_path / "calibration.json").read_text())
    del data["errors"]
    (tmp_path / "old.json").write_text(json.dumps(data))
    old = Calibration.load(tmp_path / "old.json")
    assert old.errors == {} and old.update == calibration.update
    assert "; kept mxfp8</td>" in reasons(old, formats, kappa=1.0)


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_checkpointed_forward_is_captured_once(reentrant):
    """Activation checkpointing runs each forward again inside the backward: its operands are the same, captured once
    (the gradient from whichever forward the backward goes through: the recomputed one when reentrant)."""
    torch.manual_seed(0)
    layers = torch.nn.Sequential(lowprec.Linear(16, 16, name="model.a"), torch.nn.GELU(), lowprec.Linear(16, 16, name="model.b"))
    x = torch.randn(8, 16, requires_grad=True)
    with captured_operands(layers) as operands:
        torch.utils.checkpoint.checkpoint(layers, x, use_reentrant=reentrant).square().sum().backward()
    for name in ("model.a", "model.b"):
        assert {tensor: len(seen) for tensor, seen in operands[name].items()} == {"activation": 1, "weight": 1, "gradient": 1}
    assert torch.equal(operands["model.a"]["activation"][0], x.detach())
