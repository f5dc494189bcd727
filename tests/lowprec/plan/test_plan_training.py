"""Training under a precision plan: every GEMM of every layer reads its operands in the format the plan gives it,
bit for bit what ``lowprec.quantize`` makes of the same tensor under that recipe.

The demo's model (``lowprec.demo.GPT``) trains under a plan of four formats: attention MXFP8, the MLPs NVFP4, the head
in high precision and one projection's wgrad in FP8 current scaling. Every GEMM's operands are captured as the GEMM
reads them, with the tensors they were cast from, and each is checked against ``lowprec.quantize``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import lowprec
from lowprec.demo import GPT, Size
from lowprec.modules import linear_function
from lowprec.modules.gemm_unit import GemmUnit
from lowprec.modules.linear_function import LinearFunction
from lowprec.quant.protocol import QuantizedTensor
from lowprec.study import QuantizedView

NVFP4 = lowprec.NVFP4BlockScaling(disable_stochastic_rounding=True)  # stochastic rounding keys its noise per layer
MXFP8 = lowprec.MXFP8BlockScaling()
CURRENT = lowprec.Float8CurrentScaling()
PROJ_1 = "gpt.layers.1.self_attention.proj"

PLAN = {
    "rules": [
        {"name": "head in high precision", "layers": {"layer_name_regex_pattern": "head$"}, "recipe": "bf16"},
        {
            "name": "one projection's wgrad in current scaling",
            "layers": {"exact_layer_names": [PROJ_1]},
            "fprop": "mxfp8",
            "dgrad": "mxfp8",
            "wgrad": "current",
        },
        {"name": "attention MXFP8", "layers": {"layer_name_regex_pattern": "self_attention"}, "recipe": "mxfp8"},
        {
            "name": "MLP NVFP4",
            "layers": {"layer_name_regex_pattern": "layernorm_mlp"},
            "recipe": {"name": "nvfp4", "disable_stochastic_rounding": True},
        },
    ]
}


def expected_recipe(layer: str, gemm: str) -> lowprec.Recipe | None:
    if layer == "gpt.head":
        return None
    if layer == PROJ_1 and gemm == "wgrad":
        return CURRENT
    return MXFP8 if "self_attention" in layer else NVFP4


class GemmRecorder:
    """Every GEMM a ``LinearFunction`` runs: (layer, GEMM, left operand, right operand, the tensors cast)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.records: list[tuple[str, str, object, object, dict[str, torch.Tensor]]] = []
        self._layer: list[str] = []
        self._context: dict = {}
        original_linear, original_forward = GemmUnit.linear, LinearFunction.forward
        original_backward, original_gemm = LinearFunction.backward, linear_function.gemm_and_probe
        recorder = self

        def linear(unit, layer_name, *args, **kwargs):
            recorder._layer.append(layer_name)
            try:
                return original_linear(unit, layer_name, *args, **kwargs)
            finally:
                recorder._layer.pop()

        def forward(ctx, x, weight, bias, processing):
            ctx.recorded = (recorder._layer[-1], x.detach().reshape(-1, x.shape[-1]), weight.detach().clone())
            recorder._context = {"layer": ctx.recorded[0], "gemms": iter(["fprop"]), "sources": ctx.recorded}
            return original_forward(ctx, x, weight, bias, processing)

        def backward(ctx, grad_out):
            layer, x, weight = ctx.recorded
            gemms = [g for g, needed in (("dgrad", ctx.needs_input_grad[0]), ("wgrad", ctx.needs_input_grad[1])) if needed]
            dy = grad_out.detach().reshape(-1, grad_out.shape[-1])
            recorder._context = {"layer": layer, "gemms": iter(gemms), "sources": (layer, x, weight, dy)}
            return original_backward(ctx, grad_out)

        def gemm(a, b, *args, **kwargs):
            context = recorder._context
            sources = dict(zip(("activation", "weight", "gradient"), context["sources"][1:], strict=False))
            recorder.records.append((context["layer"], next(context["gemms"]), a, b, sources))
            return original_gemm(a, b, *args, **kwargs)

        monkeypatch.setattr(GemmUnit, "linear", linear)
        monkeypatch.setattr(LinearFunction, "forward", staticmethod(forward))
        monkeypatch.setattr(LinearFunction, "backward", staticmethod(backward))
        monkeypatch.setattr(linear_function, "gemm_and_probe", gemm)


def operand_views(gemm: str, a: object, b: object) -> dict[str, tuple[object, str]]:
    """What each tensor's operand of ``gemm`` is, and the orientation the GEMM reads (``a @ b`` reads ``a``'s rowwise
    and ``b.t()``'s rowwise: the columnwise copy of the tensor ``b`` is the transpose of)."""
    if gemm == "fprop":  # activation @ weight.t()
        return {"activation": (a, "rowwise"), "weight": (_t(b), "rowwise")}
    if gemm == "dgrad":  # gradient @ weight
        return {"gradient": (a, "rowwise"), "weight": (b, "columnwise")}
    return {"gradient": (_t(a), "columnwise"), "activation": (b, "columnwise")}  # gradient.t() @ activation


def _t(operand: object) -> object:
    return operand.t()


def check_operand(recipe: lowprec.Recipe | None, where: str, tensor_name: str, operand: object, orientation: str, source):
    """``operand`` is what ``lowprec.quantize`` makes of ``source`` under ``recipe`` (None: ``source`` itself)."""
    if recipe is None:
        assert not isinstance(operand, QuantizedTensor), where
        assert torch.equal(operand, source), where
        return
    assert isinstance(operand, QuantizedTensor), where
    got = getattr(QuantizedView(operand, source.shape), orientation)
    want = getattr(lowprec.quantize(source, recipe, tensor_name), orientation)
    assert got.block == want.block, where
    assert torch.equal(got.codes, want.codes), where
    assert torch.equal(got.scale_inv, want.scale_inv), where
    if want.global_scale_inv is not None:
        assert torch.equal(got.global_scale_inv, want.global_scale_inv), where


def tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(Size(hidden=64, layers=2, heads=4, seq=16, batch=4))


def test_every_gemm_reads_its_operands_in_the_format_the_plan_gives_it(monkeypatch):
    recorder = GemmRecorder(monkeypatch)
    model = tiny_gpt()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        with lowprec.autocast(recipe=CURRENT, plan=PLAN):
            logits = model(tokens[:, :-1])
        F.cross_entropy(logits.reshape(-1, 256), tokens[:, 1:].reshape(-1)).backward()
        optimizer.step()
        optimizer.zero_grad()
    layers = {record[0] for record in recorder.records}
    assert len(layers) == 8  # 2 x (layernorm_qkv, proj, fc1, fc2); the head, all high precision, runs F.linear
    assert "gpt.head" not in layers
    checked = set()
    for layer, gemm, a, b, sources in recorder.records:
        for tensor_name, (operand, orientation) in operand_views(gemm, a, b).items():
            where = f"{layer} {gemm} {tensor_name}"
            check_operand(expected_recipe(layer, gemm), where, tensor_name, operand, orientation, sources[tensor_name])
        checked.add((layer, gemm))
    assert checked == {(layer, gemm) for layer in layers for gemm in ("fprop", "dgrad", "wgrad")}
    # the one layer of three formats: MXFP8 fprop and dgrad, an FP8 (E4M3 activation, E5M2 gradient) wgrad
    proj = {gemm: (a, b) for layer, gemm, a, b, _ in recorder.records if layer == PROJ_1}
    assert type(proj["wgrad"][1]).__name__ == "Float8Tensor" and type(proj["fprop"][0]).__name__ == "BlockScaledTensor"


def test_evaluation_forwards_run_the_plans_evaluation_recipe(monkeypatch):
    recorder = GemmRecorder(monkeypatch)
    model = tiny_gpt().eval()
    plan = {
        "eval": "high_precision",
        "rules": [{"layers": {"layer_name_regex_pattern": "layernorm_mlp"}, "recipe": "nvfp4", "eval": "mxfp8"}],
    }
    with torch.no_grad(), lowprec.autocast(recipe=CURRENT, plan=plan):
        model(torch.randint(0, 256, (2, 16)))
    for layer, gemm, a, _, sources in recorder.records:
        assert gemm == "fprop"
        if "layernorm_mlp" in layer:
            check = QuantizedView(a, sources["activation"].shape).rowwise
            assert torch.equal(check.codes, lowprec.quantize(sources["activation"], MXFP8).rowwise.codes), layer
        else:
            assert not isinstance(a, QuantizedTensor), layer


def test_layers_no_rule_selects_run_the_autocast_recipe_and_without_it_high_precision(monkeypatch):
    recorder = GemmRecorder(monkeypatch)
    model = tiny_gpt()
    plan = {"rules": [{"layers": {"layer_name_regex_pattern": "head$"}, "recipe": "mxfp8"}]}
    tokens = torch.randint(0, 256, (2, 16))
    with lowprec.autocast(recipe=CURRENT, plan=plan):
        model(tokens)
    with lowprec.autocast(enabled=False, plan=plan):
        model(tokens)
    first, second = recorder.records[:9], recorder.records[9:]
    for layer, _, a, _, _ in first:
        assert type(a).__name__ == ("BlockScaledTensor" if layer == "gpt.head" else "Float8Tensor"), layer
    assert [layer for layer, *_ in second] == ["gpt.head"]  # the others run F.linear in high precision
    assert type(second[0][2]).__name__ == "BlockScaledTensor"
