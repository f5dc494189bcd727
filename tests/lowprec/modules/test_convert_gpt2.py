"""lowprec.convert on Hugging Face GPT-2 (Conv1D layers): every linear layer converted, the same numbers in
high precision, and FP8 training whose c_attn activations are inspected by nvdlfw_inspect."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from logreader import read_stats

import lowprec
import nvdlfw_inspect.api as debug_api

transformers = pytest.importorskip("transformers")

N_LAYER = 2
LOGGED = 6e-5  # the statistics log writes 4 decimals
C_ATTN_STATS = {
    "c_attn_stats": {
        "enabled": True,
        "layers": {"layer_name_regex_pattern": r".*attn\.c_attn"},
        "transformer_engine": {
            "LogTensorStats": {"enabled": True, "tensors": ["activation"], "stats": ["max", "l2_norm"], "freq": 1}
        },
    }
}


def tiny_gpt2() -> torch.nn.Module:
    """Random weights, nothing downloaded; no dropout so outputs compare exactly."""
    config = transformers.GPT2Config(
        n_layer=N_LAYER, n_embd=32, n_head=2, vocab_size=100, n_positions=32, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel._from_config(config, attn_implementation="eager")


def linear_paths(model: torch.nn.Module) -> list[str]:
    return [path for path, m in model.named_modules() if path.endswith(("c_attn", "c_proj", "c_fc", "lm_head"))]


def test_every_linear_layer_of_gpt2_converts_and_computes_the_same():
    model = tiny_gpt2()
    reference = copy.deepcopy(model)
    shapes = {key: value.shape for key, value in model.state_dict().items()}
    paths = linear_paths(model)
    assert len(paths) == 4 * N_LAYER + 1
    report = lowprec.convert_with_report(model)
    assert sorted(report.converted) == sorted(f"model.{path}" for path in paths) and report.skipped == []
    assert isinstance(model.transformer.h[0].attn.c_attn, lowprec.Conv1D) and isinstance(model.lm_head, lowprec.Linear)
    assert model.lm_head.weight is model.transformer.wte.weight  # tied embedding still tied
    assert {key: value.shape for key, value in model.state_dict().items()} == shapes
    ids = torch.randint(0, 100, (2, 16))
    out, ref = model(ids, labels=ids), reference(ids, labels=ids)
    assert torch.equal(out.logits, ref.logits)
    out.loss.backward()
    ref.loss.backward()
    for (name, p), p_ref in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_fp8_training_logs_c_attn_activation_stats(tmp_path):
    model = lowprec.convert(tiny_gpt2())
    debug_api.initialize(config_file=C_ATTN_STATS, feature_dirs=[lowprec.FEATURE_DIR], log_dir=str(tmp_path))
    inputs: dict[int, list[torch.Tensor]] = {block: [] for block in range(N_LAYER)}  # what each c_attn saw, per step
    for block, layer in enumerate(model.transformer.h):
        layer.attn.c_attn.register_forward_hook(lambda _, args, out, seen=inputs[block]: seen.append(args[0].detach().clone()))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    weight = model.transformer.h[0].attn.c_attn.weight
    start = weight.detach().clone()
    steps = 3
    for _ in range(steps):
        ids = torch.randint(0, 100, (2, 16))
        with lowprec.fp8_autocast(fp8_recipe=lowprec.Float8CurrentScaling()):
            loss = model(ids, labels=ids).loss
        assert math.isfinite(loss.item())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        debug_api.step()
    debug_api.end_debug()
    assert weight.shape == (32, 96) and not torch.equal(weight, start)  # the shared Parameter trained
    stats = read_stats(tmp_path)
    assert [len(seen) for seen in inputs.values()] == [steps] * N_LAYER
    names = [f"model.transformer.h.{block}.attn.c_attn_activation" for block in inputs]
    assert set(stats) == {(f"{name}_{stat}", i) for name in names for stat in ("max", "l2_norm") for i in range(steps)}
    for name, seen in zip(names, inputs.values(), strict=True):
        for i, x in enumerate(seen):
            assert stats[(f"{name}_max", i)] == pytest.approx(x.max().item(), abs=LOGGED)
            assert stats[(f"{name}_l2_norm", i)] == pytest.approx(x.double().norm().item(), abs=LOGGED)
