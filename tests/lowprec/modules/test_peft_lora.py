"""PEFT's LoRA and lowprec in both orders: LoRA on a converted model (QLoRA's order) and conversion of a
LoRA model both train in FP8, LoRA's own A and B in FP8 or not as ``convert``'s filter says, and a merged
model's FP8 forward casts the merged weights (not the ones from before the merge)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_llama_config

import lowprec

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

RECIPE = lowprec.Float8CurrentScaling()
TARGETS = ["q_proj", "v_proj", "down_proj"]


def tiny_llama() -> torch.nn.Module:
    config = tiny_llama_config(tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def lora(model: torch.nn.Module) -> torch.nn.Module:
    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False)
    return peft.get_peft_model(model, config)


def batch() -> torch.Tensor:
    return torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(2))


def fp8_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with lowprec.fp8_autocast(fp8_recipe=RECIPE):
        return model(input_ids=ids, labels=ids).loss


def train(model: torch.nn.Module, steps: int = 4) -> list[float]:
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    losses = []
    ids = batch()  # the same batch every step: the loss must go down
    for _ in range(steps):
        loss = fp8_loss(model, ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def lora_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {name: module for name, module in model.named_modules() if isinstance(module, peft.tuners.lora.LoraLayer)}


def test_lora_on_a_converted_model_trains_in_fp8_with_a_and_b_in_high_precision():
    """QLoRA's order: PEFT wraps the converted layers (a lowprec.Linear is a torch.nn.Linear)."""
    model = lora(lowprec.convert(tiny_llama()))
    layers = lora_layers(model)
    assert len(layers) == 2 * len(TARGETS)
    for layer in layers.values():
        assert isinstance(layer.base_layer, lowprec.Linear)
        assert type(layer.lora_A["default"]) is torch.nn.Linear and type(layer.lora_B["default"]) is torch.nn.Linear
    frozen = {name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad}
    losses = train(model)
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    for name, p in model.named_parameters():
        if name in frozen:
            assert torch.equal(p, frozen[name]), name  # only LoRA's A and B train


@pytest.mark.parametrize("lora_in_fp8", [True, False], ids=["a-b-in-fp8", "a-b-filtered-out"])
def test_converting_a_lora_model_puts_a_and_b_in_fp8_as_the_filter_says(lora_in_fp8):
    report = lowprec.convert_with_report(lora(tiny_llama()), exclude=None if lora_in_fp8 else r"\.lora_[AB]\.")
    model = report.model
    for path, layer in lora_layers(model).items():
        assert isinstance(layer.base_layer, lowprec.Linear), path
        for adapter in (layer.lora_A["default"], layer.lora_B["default"]):
            assert isinstance(adapter, lowprec.Linear) is lora_in_fp8
    filtered = [s.path for s in report.skipped if s.reason == "filtered out"]
    assert len(filtered) == (0 if lora_in_fp8 else 4 * len(TARGETS))
    a = lora_layers(model)["base_model.model.model.layers.0.self_attn.q_proj"].lora_A["default"]
    x = torch.randn(4, 64)
    with lowprec.fp8_autocast(fp8_recipe=RECIPE):
        in_fp8 = a(x)
    assert torch.equal(in_fp8, torch.nn.functional.linear(x, a.weight)) is not lora_in_fp8
    losses = train(model)
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


@pytest.mark.parametrize("order", ["convert-then-lora", "lora-then-convert"])
def test_a_merged_model_casts_the_merged_weights(order):
    """``merge_and_unload`` writes through ``weight.data`` (no version bump): the FP8 forward after it
    must equal the FP8 forward of a fresh model given the merged weights, which casts from scratch."""
    model = lora(lowprec.convert(tiny_llama())) if order == "convert-then-lora" else lowprec.convert(lora(tiny_llama()))
    train(model)
    ids = batch()
    before = fp8_loss(model, ids).item()  # every base layer's weight cast under the LoRA model
    merged = model.merge_and_unload()
    assert not lora_layers(merged)
    after = fp8_loss(merged, ids)

    fresh = lowprec.convert(tiny_llama())
    fresh.load_state_dict(merged.state_dict())
    expected = fp8_loss(fresh, ids)
    assert torch.equal(after, expected) and after.item() != before
