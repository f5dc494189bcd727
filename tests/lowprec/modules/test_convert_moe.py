"""lowprec.convert on Hugging Face mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE): every GEMM (attention,
router, each expert's two) converted or reported by name, the same numbers in high precision, FP8 training close
to high precision, and per-expert statistics logged with the tokens each expert received."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import yaml

import lowprec
import nvdlfw_inspect.api as debug_api
from lowprec.errors import LowprecValueError
from lowprec.modules.gemm_unit import GemmUnit
from lowprec.modules.grouped_gemm import GroupedGemm
from lowprec.modules.moe import GatedExperts, TopKRouter
from nvdlfw_inspect.reading import iter_statistics

transformers = pytest.importorskip("transformers")

EXPERTS, TOP_K, LAYERS, VOCAB = 4, 2, 2, 128
MODELS = ("mixtral", "qwen2_moe", "qwen3_moe")
# GEMMs of each tiny model: 4 attention projections per layer and the head, plus per layer the router and two per
# expert (Qwen2-MoE: its shared expert's three projections and their gate too)
GEMMS = {"mixtral": 27, "qwen2_moe": 35, "qwen3_moe": 27}


def tiny(kind: str, experts_implementation: str = "grouped_mm") -> torch.nn.Module:
    """Hidden size 64, 2 layers, 4 experts top-2; random weights, nothing downloaded."""
    common = {
        "vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": LAYERS, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_experts_per_tok": TOP_K, "intermediate_size": 64,
    }  # fmt: skip
    if kind == "mixtral":
        config, cls = transformers.MixtralConfig(num_local_experts=EXPERTS, **common), transformers.MixtralForCausalLM
    elif kind == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(
            num_experts=EXPERTS, moe_intermediate_size=32, shared_expert_intermediate_size=64, norm_topk_prob=True, **common
        )
        cls = transformers.Qwen2MoeForCausalLM
    else:
        config = transformers.Qwen3MoeConfig(num_experts=EXPERTS, moe_intermediate_size=32, head_dim=16, **common)
        cls = transformers.Qwen3MoeForCausalLM
    torch.manual_seed(0)
    return cls._from_config(config, experts_implementation=experts_implementation)


def hf_gemms(model: torch.nn.Module) -> int:
    """The GEMMs of an unconverted model, counted from its modules: linear layers, routers, two per expert."""
    count = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) or type(module).__name__.endswith("TopKRouter"):
            count += 1
        elif type(module).__name__.endswith("Experts"):
            count += 2 * module.gate_up_proj.shape[0]
    return count


def debug_layers(model: torch.nn.Module) -> list[str]:
    return [name for m in model.modules() if hasattr(m, "debug_layers") for name, _ in m.debug_layers()]


def gemm_units(model: torch.nn.Module) -> list[GemmUnit]:
    """Every GemmUnit of a converted model: one per GEMM."""
    units = []
    for module in model.modules():
        for value in vars(module).values():
            units += value.units if isinstance(value, GroupedGemm) else [value] if isinstance(value, GemmUnit) else []
    return units


def batch(seed: int, rows: int = 4) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, 16), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
@pytest.mark.parametrize("kind", MODELS)
def test_every_gemm_is_converted_and_computes_the_same(kind, implementation):
    model = tiny(kind, implementation)
    reference = copy.deepcopy(model)
    state = {key: (value.shape, value.dtype) for key, value in model.state_dict().items()}
    parameters = {id(p) for p in model.parameters()}
    assert hf_gemms(model) == GEMMS[kind]
    report = lowprec.convert_with_report(model)
    assert report.skipped == []
    names = debug_layers(model)
    assert len(names) == len(set(names)) == GEMMS[kind] == len(gemm_units(model))
    for layer in range(LAYERS):
        prefix = f"model.model.layers.{layer}.mlp"
        assert isinstance(model.model.layers[layer].mlp.experts, GatedExperts)
        assert isinstance(model.model.layers[layer].mlp.gate, TopKRouter) and f"{prefix}.gate" in names
        for expert in range(EXPERTS):
            assert {f"{prefix}.experts.gate_up_proj.gemm_{expert}", f"{prefix}.experts.down_proj.gemm_{expert}"} <= set(names)
    assert {key: (value.shape, value.dtype) for key, value in model.state_dict().items()} == state
    assert {id(p) for p in model.parameters()} == parameters  # the optimizer's Parameters are the model's
    ids = batch(0)
    out, ref = model(ids, labels=ids), reference(ids, labels=ids)
    assert torch.equal(out.logits, ref.logits)  # bit-exact in float32
    out.loss.backward()
    ref.loss.backward()
    for (name, p), p_ref in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-5, atol=1e-7, msg=name)  # summation order differs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("implementation", ["eager", "grouped_mm", "batched_mm"])
def test_converted_experts_sum_as_the_configured_implementation(implementation, dtype):
    """Top-3 routing: the order in which each token's three contributions are added shows (float32 and bfloat16).
    Bit-exact with "eager" (added into the output expert by expert) and "grouped_mm" (summed per token at once), each
    expert's rows in the implementation's order (the next test); the same summation as "batched_mm", whose batched
    GEMM kernel rounds differently from F.linear."""
    model = tiny("mixtral", implementation).to(dtype)
    hf_experts = copy.deepcopy(model.model.layers[0].mlp.experts)
    experts = lowprec.convert(model).model.layers[0].mlp.experts
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(12, 64, generator=generator).to(dtype)
    weights, index = torch.topk(torch.rand(12, EXPERTS, generator=generator), 3, dim=-1)
    weights = (weights / weights.sum(dim=-1, keepdim=True)).to(dtype)
    out, ref = experts(hidden, index, weights), hf_experts(hidden, index, weights)
    if implementation == "batched_mm":
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-8)
    else:
        assert torch.equal(out, ref)


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
def test_each_expert_gets_its_rows_in_the_configured_implementations_order(implementation, monkeypatch):
    """A GEMM may round a row by where it sits in the matrix (MKL on AVX2 CPUs does), so bit-exactness needs each
    expert's rows in the implementation's order: "eager" slot by slot (``torch.where`` over its mask), "grouped_mm"
    as its unstable ``torch.sort`` leaves them. Checked on the rows themselves, whatever the CPU."""
    model = tiny("mixtral", implementation)
    hf_experts = copy.deepcopy(model.model.layers[0].mlp.experts)
    experts = lowprec.convert(model).model.layers[0].mlp.experts
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(12, 64, generator=generator)
    index = torch.topk(torch.rand(12, EXPERTS, generator=generator), 3, dim=-1).indices
    weights = torch.rand(12, 3, generator=generator)
    ours, theirs = [], []
    grouped_forward = GroupedGemm.forward

    def record_ours(self, layer_name, x, *args):
        if layer_name.endswith("gate_up_proj"):
            ours.append(x.detach().clone())
        return grouped_forward(self, layer_name, x, *args)

    monkeypatch.setattr(GroupedGemm, "forward", record_ours)
    if implementation == "eager":  # one F.linear per expert and projection: keep the gate_up ones, in call order
        linear = torch.nn.functional.linear

        def record_theirs(x, weight, *args):
            if weight.shape == hf_experts.gate_up_proj.shape[1:]:
                theirs.append(x.detach().clone())
            return linear(x, weight, *args)

        monkeypatch.setattr(torch.nn.functional, "linear", record_theirs)
    else:
        hf_moe = pytest.importorskip("transformers.integrations.moe")
        grouped_mm = hf_moe._grouped_mm
        monkeypatch.setattr(
            hf_moe, "_grouped_mm", lambda x, weight, offs: theirs.append(x.detach().clone()) or grouped_mm(x, weight, offs)
        )
    with torch.no_grad():
        experts(hidden, index, weights)
        theirs.clear()  # the converted experts' high-precision GEMMs run F.linear too
        hf_experts(hidden, index, weights)
    if implementation == "grouped_mm":
        theirs = theirs[:1]  # its first grouped GEMM is gate_up, the second down
    assert len(ours) == 1 and torch.equal(ours[0], torch.cat(theirs))


class StackedExperts(torch.nn.Module):
    """Experts kept as one 3-D weight by a class lowprec does not know."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 8, 6))

    def forward(self, x, expert):
        return x @ self.w[expert].t()


def test_what_cannot_be_converted_is_reported_by_name():
    model = tiny("mixtral")
    experts_0, experts_1 = model.model.layers[0].mlp.experts, model.model.layers[1].mlp.experts
    experts_0.register_forward_hook(lambda *args: None)
    experts_1._is_expert_parallel = True
    model.model.layers[0].extra = StackedExperts()
    with pytest.warns(UserWarning, match="lowprec.convert: left 3 modules with GEMMs in high precision") as said:
        report = lowprec.convert_with_report(model)
    reasons = {skipped.path: skipped.reason for skipped in report.skipped}
    assert set(reasons) == {"model.layers.0.mlp.experts", "model.layers.1.mlp.experts", "model.layers.0.extra"}
    assert "hooks" in reasons["model.layers.0.mlp.experts"]
    assert "_is_expert_parallel=True" in reasons["model.layers.1.mlp.experts"]
    assert "3-D weights (w (4, 8, 6))" in reasons["model.layers.0.extra"]
    assert model.model.layers[0].mlp.experts is experts_0 and isinstance(model.model.layers[0].mlp.gate, TopKRouter)
    (message,) = [str(w.message) for w in said if "lowprec.convert" in str(w.message)]
    assert all(f"model.{path} " in message for path in reasons)  # said in the warning too, named as converted layers


@functools.cache
def losses(kind: str, recipe: lowprec.recipe.Recipe | None, steps: int = 30) -> tuple[float, ...]:
    """Losses of ``steps`` AdamW steps on one batch, in FP8 with ``recipe`` (None: high precision)."""
    model = lowprec.convert(tiny(kind))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = batch(1)
    out = []
    for _ in range(steps):
        with lowprec.autocast(enabled=recipe is not None, recipe=recipe):
            loss = model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        out.append(loss.item())
    if recipe is not None:
        assert all(
            unit._training == lowprec.plan.GemmRecipes.every(recipe) for unit in gemm_units(model)
        )  # every GEMM, each expert's included, ran FP8
    return tuple(out)


@pytest.mark.parametrize("recipe", [lowprec.Float8CurrentScaling(), lowprec.DelayedScaling()], ids=type)
@pytest.mark.parametrize("kind", MODELS)
def test_fp8_training_stays_within_3_percent_of_high_precision(kind, recipe):
    fp8, high = losses(kind, recipe), losses(kind, None)
    assert high[-1] < 0.6 * high[0]  # it learns
    assert fp8 != high
    gaps = [abs(a - b) / b for a, b in zip(fp8, high, strict=True)]
    assert max(gaps) < 0.03, gaps


EXPERTS_SECTION = {
    "experts": {
        "enabled": True,
        "layers": {"layer_types": ["grouped_linear"]},
        "transformer_engine": {"LogTensorStats": {"enabled": True, "tensors": ["activation"], "stats": ["max"]}},
    }
}
ROUTERS_SECTION = {
    "routers": {
        "enabled": True,
        "layers": {"layer_types": ["router"]},
        "transformer_engine": {"LogTensorStats": {"enabled": True, "tensors": ["activation"], "stats": ["max"]}},
    }
}


def logged(log_dir) -> dict[tuple[str, str, str, int], float]:
    return {(s.layer, s.tensor, s.stat, s.iteration): s.value for s in iter_statistics(log_dir)}


def test_experts_log_their_statistics_and_the_tokens_the_router_gave_them(tmp_path):
    model = lowprec.convert(tiny("mixtral"))
    config = tmp_path / "moe.yaml"
    config.write_text(yaml.safe_dump(EXPERTS_SECTION | ROUTERS_SECTION))
    debug_api.initialize(config_file=str(config), feature_dirs=[lowprec.FEATURE_DIR], log_dir=str(tmp_path / "logs"))
    debug_api.infer_and_assign_layer_names(model)
    seen: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {layer: [] for layer in range(LAYERS)}  # (input, experts)
    for layer, seen_here in seen.items():
        model.model.layers[layer].mlp.gate.register_forward_hook(
            lambda _, args, out, seen_here=seen_here: seen_here.append((args[0].detach().clone(), out[2].clone()))
        )
    steps, micro_batches = 2, 2
    for step in range(steps):
        for micro in range(micro_batches):
            ids = batch(10 * step + micro, rows=2)
            with lowprec.autocast(recipe=lowprec.DelayedScaling()):
                (model(ids, labels=ids).loss / micro_batches).backward()
        debug_api.step()
    debug_api.end_debug()
    stats = logged(tmp_path / "logs")
    expected = {}
    for layer, calls in seen.items():
        prefix = f"model.layers.{layer}.mlp"  # convert's and infer_and_assign_layer_names' names: "model." + path
        for step in range(steps):
            step_calls = calls[step * micro_batches : (step + 1) * micro_batches]
            x = torch.cat([x for x, _ in step_calls])
            indices = torch.cat([i for _, i in step_calls])
            expected[(f"model.{prefix}.gate", "activation", "max", step)] = x.max().item()
            tokens = torch.bincount(indices.reshape(-1), minlength=EXPERTS).tolist()
            assert sum(tokens) == x.shape[0] * TOP_K
            for expert in range(EXPERTS):
                name = f"model.{prefix}.experts.gate_up_proj.gemm_{expert}"
                expected[(name, "activation", "tokens", step)] = tokens[expert]
                expected[(name.replace("gate_up_proj", "down_proj"), "activation", "tokens", step)] = tokens[expert]
                routed = x[(indices == expert).any(dim=-1)]
                if tokens[expert]:
                    expected[(name, "activation", "max", step)] = routed.max().item()
    down_max = {key for key in stats if "down_proj" in key[0] and key[2] == "max"}
    assert {key: stats[key] for key in stats if key not in down_max} == pytest.approx(expected, rel=1e-6)
    assert len(down_max) == sum(1 for key, value in expected.items() if "down_proj" in key[0] and value > 0)


def test_an_expert_that_receives_no_token_logs_zero_tokens(tmp_path):
    model = tiny("qwen3_moe")
    hf_experts = copy.deepcopy(model.model.layers[0].mlp.experts)
    experts = lowprec.convert(model).model.layers[0].mlp.experts
    torch.manual_seed(2)
    hidden = torch.randn(6, 64)
    index = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 1], [1, 2], [2, 0]])  # expert 3 gets nothing
    weights = torch.rand(6, TOP_K)
    assert torch.equal(experts(hidden, index, weights), hf_experts(hidden, index, weights))
    debug_api.initialize(config_file=EXPERTS_SECTION, feature_dirs=[lowprec.FEATURE_DIR], log_dir=str(tmp_path))
    with lowprec.autocast(recipe=lowprec.Float8CurrentScaling()):
        experts(hidden, index, weights)
    debug_api.step()
    debug_api.end_debug()
    stats = logged(tmp_path)
    name = "model.model.layers.0.mlp.experts.gate_up_proj.gemm_{}"
    assert [stats[(name.format(e), "activation", "tokens", 0)] for e in range(EXPERTS)] == [4, 4, 4, 0]
    assert (name.format(3), "activation", "max", 0) not in stats and (name.format(2), "activation", "max", 0) in stats


def test_activation_checkpointing_repeats_the_experts_and_logs_nothing_twice(tmp_path):
    """A recomputed forward (``activation_checkpointing_enable``) casts with the original scales and feeds no statistic
    or token count again: gradients and logs equal those of the run without checkpointing."""
    model = lowprec.convert(tiny("mixtral"))
    checkpointed = copy.deepcopy(model)
    checkpointed.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    checkpointed.train()  # checkpointing runs in training mode only
    recomputed = []
    checkpointed.model.layers[0].mlp.experts.register_forward_pre_hook(
        lambda *args: recomputed.append(torch._C._current_graph_task_id())
    )
    runs = []
    for run, which in enumerate((model, checkpointed)):
        log_dir = tmp_path / str(run)
        debug_api.initialize(config_file=EXPERTS_SECTION, feature_dirs=[lowprec.FEATURE_DIR], log_dir=str(log_dir))
        for step in range(2):
            ids = batch(step)
            with lowprec.autocast(recipe=lowprec.DelayedScaling()):
                which(ids, labels=ids).loss.backward()
            debug_api.step()
        debug_api.end_debug()
        runs.append(logged(log_dir))
    assert sum(task != -1 for task in recomputed) == 2  # each step's experts ran again in backward
    assert runs[0] == runs[1] and any(key[2] == "tokens" for key in runs[0])
    for (name, p), p_ckpt in zip(model.named_parameters(), checkpointed.parameters(), strict=True):
        assert torch.equal(p.grad, p_ckpt.grad), name


def test_bad_expert_ids_shapes_and_top_k_are_named():
    down_proj = torch.nn.Parameter(torch.randn(4, 8, 8))
    experts = GatedExperts(torch.nn.Parameter(torch.randn(4, 16, 8)), down_proj, torch.nn.SiLU(), name="e")
    with pytest.raises(LowprecValueError, match=r"expert ids in \[0, 4\), got expert id 5"):
        experts(torch.randn(2, 8), torch.tensor([[0, 5], [1, 2]]), torch.rand(2, 2))
    with pytest.raises(LowprecValueError, match=r"gate_up_proj must be .* = \(4, 16, 8\) .* got \(4, 12, 8\)"):
        GatedExperts(torch.nn.Parameter(torch.randn(4, 12, 8)), down_proj, torch.nn.SiLU())
    with pytest.raises(LowprecValueError, match="top_k must be an integer from 1 to num_experts=4, got 5"):
        TopKRouter(8, 4, top_k=5)
