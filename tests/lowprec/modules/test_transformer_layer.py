"""lowprec.TransformerLayer: a reference computation, input formats, and the names of its debug layers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import lowprec
import nvdlfw_inspect.api as debug_api


def reference(layer: lowprec.TransformerLayer, x: torch.Tensor, causal: bool = True) -> torch.Tensor:
    """Pre-norm attention and MLP written out with torch ops, batch-first, no dropout."""
    attn = layer.self_attention
    qkv_layer, proj = attn.layernorm_qkv, attn.proj
    batch, seq, hidden = x.shape
    heads = attn.heads
    normed = F.layer_norm(x, (hidden,), qkv_layer.norm.weight, qkv_layer.norm.bias, qkv_layer.norm.eps)
    q, k, v = (normed @ qkv_layer.weight.t() + qkv_layer.bias).split(hidden, dim=-1)

    def split_heads(t):
        return t.reshape(batch, seq, heads, hidden // heads).transpose(1, 2)

    q, k, v = split_heads(q), split_heads(k), split_heads(v)
    scores = q @ k.transpose(-1, -2) / (hidden // heads) ** 0.5
    if causal:
        scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
    context = (scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, seq, hidden)
    h = x + context @ proj.weight.t() + proj.bias
    mlp = layer.layernorm_mlp
    n2 = F.layer_norm(h, (hidden,), mlp.norm.weight, mlp.norm.bias, mlp.norm.eps)
    inner = F.gelu(n2 @ mlp.fc1_weight.t() + mlp.fc1_bias, approximate="tanh")
    return h + inner @ mlp.fc2_weight.t() + mlp.fc2_bias


def make(**kwargs) -> lowprec.TransformerLayer:
    torch.manual_seed(0)
    return lowprec.TransformerLayer(32, 64, 4, hidden_dropout=0.0, attention_dropout=0.0, name="tl", **kwargs)


@pytest.mark.parametrize("mask", ["causal", "no_mask"])
def test_bshd_matches_reference(mask):
    layer = make(attn_input_format="bshd", self_attn_mask_type=mask)
    x = torch.randn(2, 7, 32)
    assert torch.allclose(layer(x), reference(layer, x, causal=mask == "causal"), atol=1e-5)


def test_sbhd_is_the_default_layout():
    layer = make()
    x = torch.randn(7, 2, 32)  # [seq, batch, hidden]
    expected = reference(layer, x.transpose(0, 1)).transpose(0, 1)
    assert torch.allclose(layer(x), expected, atol=1e-5)


def test_fp8_runs_forward_and_backward_close_to_high_precision():
    layer = make()
    x = torch.randn(6, 3, 32, requires_grad=True)
    with lowprec.fp8_autocast(fp8_recipe=lowprec.Float8CurrentScaling()):
        y = layer(x)
    y.square().mean().backward()
    exact = reference(layer, x.detach().transpose(0, 1)).transpose(0, 1)
    assert (y - exact).abs().max() < 0.25
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in layer.parameters())


def test_debug_layer_names_follow_the_seeds():
    layer = make()
    assert layer.self_attention.layernorm_qkv.name == "tl.self_attention.layernorm_qkv"
    assert layer.self_attention.proj.name == "tl.self_attention.proj"
    assert layer.layernorm_mlp.name == "tl.layernorm_mlp"
    layer.name = "decoder.3"
    assert layer.self_attention.proj.name == "decoder.3.self_attention.proj"


def test_infer_and_assign_layer_names_reaches_the_inner_layers():
    model = torch.nn.ModuleDict({"block": make()})
    debug_api.infer_and_assign_layer_names(model)
    assert model["block"].self_attention.layernorm_qkv.name == "model.block.self_attention.layernorm_qkv"
    assert model["block"].layernorm_mlp.name == "model.block.layernorm_mlp"


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"hidden_size \(30\) must be a multiple of num_attention_heads \(4\)"):
        lowprec.TransformerLayer(30, 8, 4)
    with pytest.raises(ValueError, match=r"attn_input_format must be one of \['sbhd', 'bshd'\], got 'hbsd'"):
        lowprec.TransformerLayer(32, 8, 4, attn_input_format="hbsd")
    with pytest.raises(ValueError, match=r"self_attn_mask_type must be one of"):
        lowprec.TransformerLayer(32, 8, 4, self_attn_mask_type="padding")
