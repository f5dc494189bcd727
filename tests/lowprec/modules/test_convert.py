"""lowprec.convert: linear layers (nn.Linear, its subclasses, Hugging Face Conv1D) become named lowprec layers
sharing their parameters; what cannot be converted is reported; filters choose what stays in high precision."""

from __future__ import annotations

import copy
import logging
import re
import warnings

import pytest
import torch
from fp8ref import e4m3_both, e5m2_first, linear_grads

import lowprec
import nvdlfw_inspect.api as debug_api
from lowprec.modules.convert import FILTERED_OUT, Skipped


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = torch.nn.MultiheadAttention(16, 2, batch_first=True)  # keeps its own out_proj
        self.mlp = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))

    def forward(self, x):
        return x + self.mlp(x + self.attention(x, x, x)[0])


class HFConv1D(torch.nn.Module):
    """Hugging Face's Conv1D as transformers defines it (weight (nx, nf), ``x @ W + b``), without importing it."""

    def __init__(self, nf: int, nx: int):
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = torch.nn.Parameter(torch.randn(nx, nf) * 0.1)
        self.bias = torch.nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x):
        out = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return out.view(x.size()[:-1] + (self.nf,))


HFConv1D.__name__ = HFConv1D.__qualname__ = "Conv1D"
HFConv1D.__module__ = "transformers.pytorch_utils"


class SubLinear(torch.nn.Linear):
    """A subclass keeping nn.Linear's forward: converted."""


class ScaledLinear(torch.nn.Linear):
    def forward(self, x):
        return 2 * super().forward(x)


class BufferedLinear(torch.nn.Linear):
    def __init__(self, *args):
        super().__init__(*args)
        self.register_buffer("mask", torch.ones(1))


class GPTBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn = HFConv1D(48, 16)
        self.c_proj = HFConv1D(16, 48)
        self.head = torch.nn.Linear(16, 8)

    def forward(self, x):
        return self.head(x + self.c_proj(torch.tanh(self.c_attn(x))))


def test_convert_replaces_linears_keeping_parameters_and_outputs():
    torch.manual_seed(0)
    model = torch.nn.Sequential(Block(), torch.nn.Linear(16, 4))
    x = torch.randn(2, 5, 16)
    before = model(x)
    params = {name: p for name, p in model.named_parameters()}
    assert lowprec.convert(model) is model
    assert isinstance(model[0].mlp[0], lowprec.Linear) and isinstance(model[1], lowprec.Linear)
    assert type(model[0].attention.out_proj) is not lowprec.Linear  # a Linear subclass MHA reads directly
    assert model[0].mlp[2].name == "model.0.mlp.2" and model[1].name == "model.1"
    assert {name: p for name, p in model.named_parameters()} == params  # same names, same Parameter objects
    assert torch.equal(model(x), before)
    with lowprec.fp8_autocast():
        y = model(x)
    assert not torch.equal(y, before) and torch.allclose(y, before, atol=0.2)


def test_convert_a_bare_linear():
    layer = torch.nn.Linear(3, 2)
    converted = lowprec.convert(layer, prefix="head")
    assert isinstance(converted, lowprec.Linear) and converted.name == "head" and converted.weight is layer.weight


def test_report_lists_converted_names_and_skipped_modules():
    model = torch.nn.Sequential(Block(), torch.nn.Conv1d(16, 16, 3), torch.nn.Linear(16, 4))
    report = lowprec.convert_with_report(model, prefix="net")
    assert report.model is model
    assert report.converted == ["net.0.mlp.0", "net.0.mlp.2", "net.2"]
    assert [(s.path, s.type_name) for s in report.skipped] == [("0.attention", "MultiheadAttention"), ("1", "Conv1d")]
    assert "multi_head_attention_forward" in report.skipped[0].reason and "convolution" in report.skipped[1].reason
    assert report.skipped[0] == ("0.attention", "MultiheadAttention", report.skipped[0].reason)  # a plain tuple too
    text = str(report)
    assert text.splitlines()[0] == "lowprec.convert: 3 layers converted, 2 modules left in high precision"
    assert "  converted net.0.mlp.2" in text and "  skipped net.0.attention (MultiheadAttention): its projections" in text


def test_modules_inside_multihead_attention_stay_and_it_still_computes_the_same():
    torch.manual_seed(0)
    block = Block()
    x = torch.randn(2, 5, 16)
    before = block(x)
    out_proj = block.attention.out_proj
    report = lowprec.convert_with_report(block)
    assert block.attention.out_proj is out_proj and report.converted == ["model.mlp.0", "model.mlp.2"]
    assert not any(s.path.startswith("attention.") for s in report.skipped)
    assert torch.equal(block(x), before)


def test_linear_subclasses_keeping_forward_are_converted():
    model = torch.nn.Sequential(
        SubLinear(4, 4), torch.nn.modules.linear.NonDynamicallyQuantizableLinear(4, 4), torch.nn.LazyLinear(4)
    )
    model(torch.randn(2, 4))  # materializes the LazyLinear (it becomes an nn.Linear)
    report = lowprec.convert_with_report(model)
    assert report.converted == ["model.0", "model.1", "model.2"] and report.skipped == []
    assert all(isinstance(layer, lowprec.Linear) for layer in model)


def test_linears_that_cannot_be_converted_are_reported_with_the_reason():
    patched = torch.nn.Linear(4, 4)
    patched.forward = lambda x: x  # as accelerate's hooks do
    hooked = torch.nn.Linear(4, 4)
    hooked.register_forward_hook(lambda module, args, out: out)
    parametrized = torch.nn.Linear(4, 4)
    torch.nn.utils.parametrize.register_parametrization(parametrized, "weight", torch.nn.Identity())
    model = torch.nn.ModuleDict(
        {
            "scaled": ScaledLinear(4, 4),
            "patched": patched,
            "hooked": hooked,
            "parametrized": parametrized,
            "lazy": torch.nn.LazyLinear(4),
            "buffered": BufferedLinear(4, 4),
        }
    )
    originals = dict(model.items())
    report = lowprec.convert_with_report(model)
    assert report.converted == [] and dict(model.items()) == originals
    reasons = {s.path: (s.type_name, s.reason) for s in report.skipped}
    assert reasons["scaled"] == (
        "ScaledLinear",
        "ScaledLinear overrides forward; if it computes x @ weight.T + bias, convert it with plain_linears=[ScaledLinear]",
    )
    assert reasons["patched"] == ("Linear", "its forward is replaced on the instance")
    assert "hooks" in reasons["hooked"][1]
    assert reasons["parametrized"][0] == "ParametrizedLinear" and "parametrize" in reasons["parametrized"][1]
    assert reasons["lazy"][0] == "LazyLinear" and "uninitialized lazy layer" in reasons["lazy"][1]
    assert "(mask)" in reasons["buffered"][1]


class MatmulLinear(torch.nn.Linear):
    """Falcon's way: a linear layer whose forward is ``x @ W.T + b``."""

    def forward(self, x):
        return x @ self.weight.T + self.bias


class OwnLinear(torch.nn.Module):
    """A plain linear layer that is not a torch.nn.Linear."""

    def __init__(self, n: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n + 1, n))
        self.bias = None

    def forward(self, x):
        return x @ self.weight.T


class SubMatmulLinear(MatmulLinear):
    def forward(self, x):
        return super().forward(x) * 2


def test_classes_declared_plain_linear_layers_are_converted():
    model = torch.nn.ModuleDict({"matmul": MatmulLinear(4, 3), "own": OwnLinear(4), "sub": SubMatmulLinear(4, 3)})
    x = torch.randn(2, 4)
    want = {name: module(x) for name, module in model.items()}
    report = lowprec.convert_with_report(model, plain_linears=[MatmulLinear, OwnLinear])
    assert report.converted == ["model.matmul", "model.own"]
    assert [s.path for s in report.skipped] == ["sub"] and "SubMatmulLinear overrides forward" in report.skipped[0].reason
    for name in ("matmul", "own"):
        layer = model[name]
        assert isinstance(layer, lowprec.Linear) and layer.weight is report.model[name].weight
        torch.testing.assert_close(layer(x), want[name])
    assert (model["own"].in_features, model["own"].out_features, model["own"].bias) == (4, 5, None)


def test_a_declared_plain_linear_without_the_parameters_of_one_is_reported():
    odd = OwnLinear(4)
    odd.weight = torch.nn.Parameter(torch.randn(2, 3, 4))
    report = lowprec.convert_with_report(torch.nn.Sequential(odd), plain_linears=(OwnLinear,))
    assert report.skipped == [Skipped("0", "OwnLinear", "declared a plain linear layer, but has no 2-D weight Parameter")]


def test_falcon_converts_completely_and_trains_in_fp8():
    """Falcon's FalconLinear overrides forward with x @ W.T + b: a known plain linear layer."""
    transformers = pytest.importorskip("transformers")
    config = transformers.FalconConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, new_decoder_architecture=False
    )
    torch.manual_seed(0)
    model = transformers.FalconForCausalLM(config)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    want = model(input_ids=ids, labels=ids).loss
    report = lowprec.convert_with_report(model)
    assert len(report.converted) == 9 and report.skipped == []  # 4 per layer and the head
    torch.testing.assert_close(model(input_ids=ids, labels=ids).loss, want)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(3):
        with lowprec.fp8_autocast(fp8_recipe=lowprec.Float8CurrentScaling()):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert abs(losses[0] - want.item()) < 0.01 * want.item() and losses[-1] < losses[0]


@pytest.mark.parametrize(
    ("module", "words"),
    [
        (torch.nn.Conv2d(2, 2, 3), "convolution"),
        (torch.nn.Conv3d(2, 2, 3), "convolution"),
        (torch.nn.ConvTranspose1d(2, 2, 3), "transposed convolution"),
        (torch.nn.Bilinear(2, 2, 2), "bilinear"),
        (torch.nn.LSTM(2, 2), "recurrent"),
        (torch.nn.GRU(2, 2), "recurrent"),
        (torch.nn.RNN(2, 2), "recurrent"),
        (torch.nn.LSTMCell(2, 2), "recurrent"),
    ],
)
def test_other_gemm_modules_are_reported(module, words):
    report = lowprec.convert_with_report(torch.nn.Sequential(module))
    assert report.skipped == [Skipped("0", type(module).__name__, report.skipped[0].reason)]
    assert words in report.skipped[0].reason


def test_lowprec_layers_are_left_alone_and_converting_twice_changes_nothing():
    model = torch.nn.Sequential(lowprec.LayerNormMLP(8, 16, name="mlp"), torch.nn.Linear(8, 8))
    lowprec.convert(model)
    converted = model[1]
    report = lowprec.convert_with_report(model)
    assert report.converted == [] and report.skipped == [] and model[1] is converted and model[0].name == "mlp"


def test_conv1d_shares_parameters_and_state_dict_and_computes_the_same():
    torch.manual_seed(0)
    model = GPTBlock()
    reference = copy.deepcopy(model)
    keys = {key: value.shape for key, value in model.state_dict().items()}
    weight = model.c_attn.weight
    report = lowprec.convert_with_report(model)
    assert report.converted == ["model.c_attn", "model.c_proj", "model.head"]
    assert isinstance(model.c_attn, lowprec.Conv1D) and model.c_attn.weight is weight and weight.shape == (16, 48)
    assert (model.c_attn.in_features, model.c_attn.out_features) == (16, 48)
    assert {key: value.shape for key, value in model.state_dict().items()} == keys
    x = torch.randn(2, 3, 16)
    y, y_ref = model(x), reference(x)
    assert torch.equal(y, y_ref)
    y.square().sum().backward()
    y_ref.square().sum().backward()
    for (name, p), p_ref in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-6, atol=1e-7, msg=name)
    assert weight.grad.shape == (16, 48)


def test_conv1d_runs_the_fp8_gemms_of_a_linear():
    torch.manual_seed(0)
    layer = lowprec.convert(HFConv1D(24, 32), prefix="c_fc")
    assert layer.layer_types == ("linear",) and layer.name == "c_fc"
    x = torch.randn(4, 6, 32, requires_grad=True)
    with lowprec.fp8_autocast(fp8_recipe=lowprec.Float8CurrentScaling()):
        y = layer(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    y_ref, dx_ref, dw_ref = linear_grads(x, layer.weight.t(), dy, e4m3_both, e5m2_first, e5m2_first)
    assert torch.allclose(y, y_ref + layer.bias.detach(), rtol=1e-5, atol=1e-5)
    assert torch.allclose(x.grad, dx_ref, rtol=1e-5, atol=1e-6)
    assert torch.allclose(layer.weight.grad, dw_ref.t(), rtol=1e-5, atol=1e-5)


def test_a_standalone_conv1d_layer():
    layer = lowprec.Conv1D(8, 4, name="proj")
    assert layer.weight.shape == (8, 4) and layer.bias.shape == (4,)
    assert layer.weight.abs().max() <= 8**-0.5  # nn.Linear's initialisation, by fan-in
    x = torch.randn(3, 8)
    torch.testing.assert_close(layer(x), torch.addmm(layer.bias, x, layer.weight), rtol=0, atol=0)
    assert "in_features=8, out_features=4, bias=True, name='proj'" in repr(layer)


def test_a_module_registered_twice_is_converted_once():
    shared = torch.nn.Linear(4, 4)
    model = torch.nn.Sequential(shared, torch.nn.ReLU(), shared)
    report = lowprec.convert_with_report(model)
    assert report.converted == ["model.0"] and model[0] is model[2] and isinstance(model[0], lowprec.Linear)


def test_converted_layers_keep_the_training_mode():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), HFConv1D(4, 4)).eval()
    lowprec.convert(model)
    assert not model[0].training and not model[1].training


def test_filters_keep_layers_in_high_precision():
    def make():
        return torch.nn.ModuleDict({"block": GPTBlock(), "lm_head": torch.nn.Linear(8, 8)})

    report = lowprec.convert_with_report(make(), exclude="lm_head")
    assert "model.lm_head" not in report.converted and report.skipped == [Skipped("lm_head", "Linear", FILTERED_OUT)]
    report = lowprec.convert_with_report(make(), include=[r"c_attn$", "head"], exclude=r"^lm_head")
    assert report.converted == ["model.block.c_attn", "model.block.head"]
    assert [s.path for s in report.skipped] == ["block.c_proj", "lm_head"]
    seen = []

    def keep_small(path, module):
        seen.append((path, type(module).__name__))
        return module.weight.numel() < 256

    model = make()
    report = lowprec.convert_with_report(model, module_filter_fn=keep_small, exclude="block.head")
    assert seen == [("block.c_attn", "Conv1D"), ("block.c_proj", "Conv1D"), ("lm_head", "Linear")]  # after the regexes
    assert report.converted == ["model.lm_head"] and isinstance(model["block"].c_attn, HFConv1D)
    assert report.skipped == [Skipped(path, kind, FILTERED_OUT) for path, kind in seen[:2]] + [
        Skipped("block.head", "Linear", FILTERED_OUT)
    ]


def test_a_filtered_out_bare_layer_is_returned_as_it_is():
    layer = torch.nn.Linear(4, 4)
    report = lowprec.convert_with_report(layer, module_filter_fn=lambda path, module: path != "")
    assert report.model is layer and report.skipped == [Skipped("", "Linear", FILTERED_OUT)]
    assert "skipped model (Linear): filtered out" in str(report)
    assert "skipped <root> (Linear): filtered out" in str(lowprec.convert_with_report(layer, "", exclude=""))


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"include": "lm_(head"}, ValueError, "include: 'lm_(head' is not a valid regular expression (missing )"),
        ({"exclude": ["ok", "[a-"]}, ValueError, "exclude: '[a-' is not a valid regular expression (unterminated"),
        ({"exclude": r"(\w+\.?)+head$"}, ValueError, r"exclude: '(\\w+\\.?)+head$' can take time that explodes"),
        ({"include": 5}, TypeError, "include must be a regex string or a list of regex strings, got 5"),
        ({"exclude": ["a", None]}, TypeError, "exclude must be a regex string or a list of regex strings, got ['a', None]"),
        ({"include": []}, ValueError, "include must hold at least one regex, got []; pass None to select every module"),
        ({"module_filter_fn": "fc"}, TypeError, "module_filter_fn must be callable as fn(path, module) -> bool, got 'fc'"),
        ({"module_filter_fn": lambda path, m: None}, TypeError, "module_filter_fn must return a bool, got None for path '0'"),
        ({"prefix": None}, TypeError, "prefix must be a string, got None"),
        (
            {"plain_linears": [len]},
            TypeError,
            "plain_linears must be a list of torch.nn.Module classes whose forward computes x @ weight.T + bias, got [<built-in",
        ),
    ],
)
def test_bad_arguments_are_named(kwargs, error, message):
    with pytest.raises(error, match=re.escape(message)):
        lowprec.convert(torch.nn.Sequential(torch.nn.Linear(2, 2)), **kwargs)


def test_model_must_be_a_module():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got dict"):
        lowprec.convert({"fc": torch.nn.Linear(2, 2)})


def start_session(log_dir) -> None:
    """A debug session whose log says what convert says once."""
    stats = {"LogTensorStats": {"enabled": True, "tensors": ["activation"], "stats": ["max"]}}
    section = {"enabled": True, "layers": {"layer_name_regex_pattern": ".*"}, "transformer_engine": stats}
    debug_api.initialize(config_file={"stats": section}, log_dir=log_dir)


def test_convert_logs_what_it_did_naming_skipped_modules_as_converted_ones(caplog, log_dir):
    start_session(log_dir)
    caplog.set_level(logging.INFO, logger="lowprec")
    blocked = (
        "lowprec.convert: left 1 modules with GEMMs in high precision: model.0.attention (MultiheadAttention): "
        "its projections run in F.multi_head_attention_forward, which reads the weights directly"
    )
    with pytest.warns(UserWarning) as said:
        lowprec.convert(torch.nn.Sequential(Block(), torch.nn.Linear(16, 4)), exclude=r"^1$")
    assert [str(w.message) for w in said] == [blocked]
    records = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "lowprec"]
    assert records == [
        ("INFO", "lowprec.convert: converted 2 layers: model.0.mlp.0, model.0.mlp.2"),
        ("INFO", "lowprec.convert: filtered out (kept in high precision): model.1"),
    ]
    debug_api.end_debug()
    assert blocked in (log_dir / "nvdlfw_inspect_logs" / "nvdlfw_inspect_globalrank-0.log").read_text()


def test_filtering_alone_warns_only_when_nothing_is_converted(caplog, log_dir):
    start_session(log_dir)
    caplog.set_level(logging.INFO, logger="lowprec")
    with pytest.warns(UserWarning, match="^lowprec.convert: converted no layer$"):
        lowprec.convert(torch.nn.Sequential(torch.nn.Linear(2, 2)), exclude="0")
    assert [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "lowprec"] == [
        ("INFO", "lowprec.convert: filtered out (kept in high precision): model.0"),
    ]
    caplog.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lowprec.convert(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)), exclude="0")
    assert all(r.levelno == logging.INFO for r in caplog.records if r.name == "lowprec")
