"""lowprec.Linear: exactly torch.nn.Linear outside autocast; hand-checked FP8 GEMMs inside it."""

from __future__ import annotations

import pytest
import torch
from fp8ref import e4m3_both, e5m2_first, linear_grads

import lowprec


def make_pair(in_f=32, out_f=24, bias=True, dtype=torch.float32):
    torch.manual_seed(0)
    ours = lowprec.Linear(in_f, out_f, bias=bias, name="lin", params_dtype=dtype)
    ref = torch.nn.Linear(in_f, out_f, bias=bias, dtype=dtype)
    with torch.no_grad():
        ref.weight.copy_(ours.weight)
        if bias:
            ref.bias.copy_(ours.bias)
    return ours, ref


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(8, 32), (2, 5, 32)])
def test_matches_torch_linear_outside_autocast(bias, shape):
    ours, ref = make_pair(bias=bias)
    x = torch.randn(*shape, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    y, y_ref = ours(x), ref(x_ref)
    assert torch.equal(y, y_ref)
    dy = torch.randn_like(y)
    y.backward(dy)
    y_ref.backward(dy)
    assert torch.equal(x.grad, x_ref.grad) and torch.equal(ours.weight.grad, ref.weight.grad)
    if bias:
        assert torch.equal(ours.bias.grad, ref.bias.grad)


def test_fp8_current_scaling_gemms_by_hand():
    ours, _ = make_pair()
    x = torch.randn(4, 6, 32, requires_grad=True)
    with lowprec.fp8_autocast(fp8_recipe=lowprec.Float8CurrentScaling()):
        y = ours(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    y_ref, dx_ref, dw_ref = linear_grads(x, ours.weight, dy, e4m3_both, e5m2_first, e5m2_first)
    assert torch.allclose(y, y_ref + ours.bias.detach(), rtol=1e-5, atol=1e-5)
    assert torch.allclose(x.grad, dx_ref, rtol=1e-5, atol=1e-6)
    assert torch.allclose(ours.weight.grad, dw_ref, rtol=1e-5, atol=1e-5)
    assert torch.allclose(ours.bias.grad, dy.sum(dim=(0, 1)))


def test_fp8_differs_from_high_precision_but_is_close():
    ours, ref = make_pair()
    x = torch.randn(16, 32)
    with lowprec.fp8_autocast(fp8_recipe=lowprec.Float8CurrentScaling()):
        y = ours(x)
    exact = ref(x)
    assert not torch.equal(y, exact)
    assert torch.allclose(y, exact, rtol=0.1, atol=0.1)


def test_delayed_scaling_first_step_uses_scale_one_then_the_amax():
    ours, _ = make_pair()
    x = torch.randn(16, 32) * 0.01  # with scale 1, values this small lose most of their bits in E4M3
    recipe = lowprec.DelayedScaling(amax_history_len=4)
    with lowprec.fp8_autocast(fp8_recipe=recipe):
        first = ours(x)
        first.sum().backward()
        second = ours(x)  # a second micro-batch: the unchanged weight's cast is reused
        with torch.no_grad():
            ours.weight.mul_(1.0)  # an optimizer step: the weight changed in place
        third = ours(x)
    w = ours.weight.detach()

    def with_scale(t, scale):
        return (t * scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() / scale

    expect_first = with_scale(x, 1.0) @ with_scale(w, 1.0).t() + ours.bias.detach()
    assert torch.allclose(first, expect_first, rtol=1e-5, atol=1e-6)
    # later casts take their scale from the first's amax: exactly current scaling for the same tensor
    xq, wq = e4m3_both(x, w)
    assert torch.allclose(second, xq @ with_scale(w, 1.0).t() + ours.bias.detach(), rtol=1e-5, atol=1e-6)
    assert torch.allclose(third, xq @ wq.t() + ours.bias.detach(), rtol=1e-5, atol=1e-6)
    quantizers = ours.gemm_unit.quantizers(recipe, ours.name)
    assert quantizers["activation"].amax_history[:3].tolist() == pytest.approx([x.abs().max().item()] * 3)
    assert quantizers["weight"].amax_history[:3].tolist() == pytest.approx([w.abs().max().item()] * 2 + [0.0])


def test_bf16_parameters_and_inputs():
    ours, ref = make_pair(dtype=torch.bfloat16)
    x = torch.randn(8, 32, dtype=torch.bfloat16, requires_grad=True)
    with lowprec.fp8_autocast():
        y = ours(x)
    y.float().sum().backward()
    assert y.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16 and ours.weight.grad.dtype == torch.bfloat16
    assert torch.allclose(y.float(), ref(x).float(), rtol=0.15, atol=0.15)


def test_names():
    assert lowprec.Linear(2, 2, name="encoder.fc").name == "encoder.fc"
    first, second = lowprec.Linear(2, 2), lowprec.Linear(2, 2)
    assert first.name.startswith("Layer_") and int(second.name[6:]) == int(first.name[6:]) + 1
    with pytest.raises(TypeError, match="name must be a string"):
        lowprec.Linear(2, 2, name=3)


def test_is_a_torch_linear_and_conv1d_is_not():
    """Code that checks ``isinstance(m, nn.Linear)`` (PEFT's LoRA, transformers' resize_token_embeddings) takes a
    lowprec.Linear; Conv1D keeps Hugging Face's transposed weight, so it must not pass for one."""
    layer, conv = lowprec.Linear(8, 4, name="fc"), lowprec.Conv1D(8, 4, name="c")
    assert isinstance(layer, torch.nn.Linear) and not isinstance(conv, torch.nn.Linear)
    assert list(layer.state_dict()) == ["weight", "bias"] and layer.weight.shape == (4, 8)
    x = torch.randn(3, 8)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    converted = lowprec.convert(torch.nn.Sequential(layer))  # already lowprec: left as it is, not converted again
    assert converted[0] is layer


def test_transformers_resize_token_embeddings_on_a_converted_model():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = lowprec.convert(transformers.LlamaForCausalLM(config))
    assert isinstance(model.lm_head, lowprec.Linear)
    model.resize_token_embeddings(80)  # raised "Old language model head is of type lowprec.modules.linear.Linear"
    assert model.lm_head.out_features == 80 and model.get_input_embeddings().num_embeddings == 80
    with lowprec.fp8_autocast(fp8_recipe=lowprec.Float8CurrentScaling()):
        logits = model(torch.randint(0, 80, (2, 16))).logits
    assert logits.shape == (2, 16, 80) and torch.isfinite(logits).all()


def test_a_batched_output_can_be_updated_in_place():
    """Models add to a layer's output in place (Falcon: ``mlp_output += attention_output``); autograd
    forbids that on a custom function's view outputs."""
    layer = lowprec.Linear(8, 4, name="fc")
    x = torch.randn(2, 3, 8)
    grads = []
    for in_place in (False, True):
        layer.zero_grad()
        with lowprec.fp8_autocast(fp8_recipe=lowprec.Float8CurrentScaling()):
            y = layer(x)
        y = y.add_(1.0) if in_place else y + 1.0
        (y * y).sum().backward()
        grads.append(layer.weight.grad.clone())
    assert torch.equal(grads[0], grads[1])
