"""Debug features under the block formats, against float64 references (tests/references/blockref.py):
FakeQuant with MXFP8 and NVFP4, LogFp8TensorStats of a layer's own block recipe, LogNvfp4TensorStats own
and what-if."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from blockref import block_ref, mx_fake, mxfp8_ref, nvfp4_ref
from debugrun import make_linear, section, start, train_step
from test_log_fp8_tensor_stats import Collect, fp8_config, run, wide

import lowprec
import nvdlfw_inspect.api as debug_api
from lowprec.debug.features.log_fp8_tensor_stats import own_quantization
from lowprec.formats.elements import E4M3, E5M2
from nvdlfw_inspect.errors import ConfigError

STATS = ["underflows%", "mse", "scale_inv_min", "scale_inv_max"]


def nvfp4_stats(x: torch.Tensor, block: tuple[int, int] = (1, 16)) -> dict[str, float]:
    dequantized, values, scales = nvfp4_ref(x, block)
    nonzero = scales[scales != 0]
    return {
        "underflows%": 100 * ((x != 0) & (values == 0)).sum().item() / x.numel(),
        "mse": (x.double() - dequantized).square().mean().item(),
        "scale_inv_min": nonzero.min().item(),
        "scale_inv_max": scales.max().item(),
    }


X, DY = torch.randn(16, 64), torch.randn(16, 48)


@pytest.mark.parametrize(
    ("quant_format", "reference"),
    [
        ("MXFP8E4M3", lambda t: mx_fake(t, E4M3)),
        ("MXFP8E5M2", lambda t: mx_fake(t, E5M2)),
        ("NVFP4", lambda t: nvfp4_ref(t)[0].float()),
    ],
)
def test_fake_quant_block_formats(log_dir, quant_format, reference):
    config = {"quant_format": quant_format, "gemms_struct": [{"gemm": "fprop", "tensors": ["activation", "weight"]}]}
    start(section({"FakeQuant": {"enabled": True, **config}}), log_dir)
    layer = make_linear(in_f=64, out_f=48)
    for fp8 in (True, False):  # fprop runs in high precision on the rounded operands, with or without autocast
        y, _, _ = train_step(layer, X, DY, fp8=fp8)
        expected = F.linear(reference(X), reference(layer.weight.detach()), layer.bias.detach())
        torch.testing.assert_close(y, expected, rtol=1e-6, atol=1e-6)
    assert not torch.equal(reference(X), X)


def test_fake_quant_config_errors(log_dir):
    with pytest.raises(ConfigError, match=r"quant_format'.*'MXFP8E3M4'.*NVFP4"):
        start(
            section({"FakeQuant": {"enabled": True, "quant_format": "MXFP8E3M4", "gemms": ["fprop"], "tensors": ["weight"]}}),
            log_dir,
        )
    with pytest.raises(ConfigError, match=r"margin'.*block formats take no margin"):
        start(
            section(
                {"FakeQuant": {"enabled": True, "quant_format": "NVFP4", "margin": 1, "gemms": ["fprop"], "tensors": ["weight"]}}
            ),
            log_dir,
        )


def expect(got: dict, prefix: str, expected: dict[str, float], suffix: str = "") -> None:
    for stat, value in expected.items():
        assert got[(f"{prefix}{stat}{suffix}", 0)] == pytest.approx(value, rel=1e-5, abs=1e-12), (prefix, stat, suffix)


def test_own_mxfp8_recipe_rowwise_and_columnwise(log_dir):
    x, dy = wide((128, 256), 20), wide((128, 128), 21)
    layer = make_linear(in_f=256, out_f=128)
    w = layer.weight.detach().clone()
    stats = STATS + [s + "_columnwise" for s in STATS]
    got = run(fp8_config(stats), log_dir, [(x, dy)], recipe=lowprec.MXFP8BlockScaling(), layer=layer)
    for name, tensor in (("activation", x), ("weight", w), ("gradient", dy)):
        for columnwise, suffix in ((False, ""), (True, "_columnwise")):
            expected = mxfp8_ref(tensor, E4M3, columnwise)
            expect(got, f"lin_{name}_", expected, suffix)
    assert got[("lin_activation_underflows%", 0)] > 0


def test_own_float8_block_recipe_uses_its_tile_shapes(log_dir):
    x, dy = wide((128, 256), 22), wide((128, 128), 23)
    layer = make_linear(in_f=256, out_f=128)
    w = layer.weight.detach().clone()
    got = run(
        fp8_config(STATS, tensors=["activation", "weight"]), log_dir, [(x, dy)], recipe=lowprec.Float8BlockScaling(), layer=layer
    )
    # activations: 1 x 128 tiles; weights: 128 x 128; power-of-two scales 2**floor(log2(448 / amax))
    row_amax = x.double().reshape(128, 2, 128).abs().amax(-1, keepdim=True)
    row_scale = torch.pow(2.0, torch.floor(torch.log2(448 / row_amax)))
    expect(got, "lin_activation_", block_ref(x, E4M3, row_scale.expand(128, 2, 128).reshape(128, 256), 1 / row_scale.reshape(-1)))
    tile_amax = w.double().reshape(1, 128, 2, 128).abs().amax(dim=(1, 3), keepdim=True)
    tile_scale = torch.pow(2.0, torch.floor(torch.log2(448 / tile_amax)))
    expect(
        got, "lin_weight_", block_ref(w, E4M3, tile_scale.expand(1, 128, 2, 128).reshape(128, 256), 1 / tile_scale.reshape(-1))
    )


def signed_zeros_input() -> torch.Tensor:
    """Each block of 16 holds one large value and tiny ones of both signs: the tiny ones round to +0 and -0."""
    x = wide((32, 64), 24) * 1e-4
    x[:, ::16] = 100.0
    return x


def test_own_nvfp4_recipe_counts_negative_zero_codes_as_underflows(log_dir):
    x, dy = signed_zeros_input(), wide((32, 48), 25)
    layer = make_linear(in_f=64, out_f=48)
    recipe = lowprec.NVFP4BlockScaling()
    got = run(fp8_config(STATS, tensors=["activation"]), log_dir, [(x, dy)], recipe=recipe, layer=layer)
    expected = nvfp4_stats(x)
    assert expected["underflows%"] > 90  # +0 and -0 codes alike
    expect(got, "lin_activation_", expected)


def test_log_nvfp4_tensor_stats_own_and_what_if(log_dir):
    x, dy = signed_zeros_input(), wide((32, 48), 26)
    feature = {"enabled": True, "tensors": ["activation", "weight"], "stats": STATS, "what_if": True}
    config = section({"LogNvfp4TensorStats": feature})
    for recipe in (lowprec.NVFP4BlockScaling(), lowprec.Float8CurrentScaling(), lowprec.MXFP8BlockScaling(), None):
        layer = make_linear(in_f=64, out_f=48)
        w = layer.weight.detach().clone()
        got = run(config, log_dir, [(x, dy)], recipe=recipe, fp8=recipe is not None, layer=layer)
        expect(got, "lin_activation_nvfp4_", nvfp4_stats(x))
        expect(got, "lin_weight_nvfp4_", nvfp4_stats(w, (16, 16)))  # NVFP4BlockScaling's 16 x 16 weight blocks


@pytest.mark.parametrize("recipe", [lowprec.Float8CurrentScaling(), None], ids=["fp8", "high-precision"])
def test_log_nvfp4_tensor_stats_skips_layers_that_run_no_nvfp4_and_says_so(log_dir, recipe):
    """As in Transformer Engine: one config over a model whose layers are partly FP8, partly NVFP4."""
    config = section({"LogNvfp4TensorStats": {"enabled": True, "tensors": ["activation"], "stats": ["mse"]}})
    got = run(config, log_dir, [(X, DY)], recipe=recipe, fp8=recipe is not None, layer=make_linear(in_f=64, out_f=48))
    assert not any("nvfp4" in name for name, _ in got)
    debug_log = (log_dir / "nvdlfw_inspect_logs" / "nvdlfw_inspect_globalrank-0.log").read_text()
    runs = "runs fp8_current_scaling" if recipe is not None else "runs in high precision"
    said = f"LogNvfp4TensorStats: activation of lin skipped: the layer {runs}, not NVFP4BlockScaling; what_if: true"
    assert debug_log.count(said) == 1


def test_log_nvfp4_tensor_stats_what_if_must_be_a_bool(log_dir):
    with pytest.raises(ConfigError, match=r"LogNvfp4TensorStats\.what_if'.*must be true or false.*'yes'"):
        start(
            section({"LogNvfp4TensorStats": {"enabled": True, "tensors": ["activation"], "stats": ["mse"], "what_if": "yes"}}),
            log_dir,
        )


def test_log_nvfp4_tensor_stats_does_not_change_stochastic_rounding(log_dir):
    """The gradient's own cast is read, not redone: training numbers equal a run without the feature."""
    recipe = lowprec.NVFP4BlockScaling()
    results = []
    for features in ({}, {"LogNvfp4TensorStats": {"enabled": True, "tensors": ["gradient"], "stats": ["mse"]}}):
        start(section(features or {"LogTensorStats": {"enabled": True, "tensors": ["output"], "stats": ["max"]}}), log_dir)
        layer = make_linear(in_f=64, out_f=48)
        results.append([train_step(layer, X, DY, recipe=recipe) for _ in range(2)])
        debug_api.end_debug()
    for first, second in zip(*results, strict=True):
        for a, b in zip(first, second, strict=True):
            assert torch.equal(a, b)


def test_log_nvfp4_tensor_stats_config_errors(log_dir):
    with pytest.raises(ConfigError, match=r"LogNvfp4TensorStats\.stats\.1'.*unsupported statistic.*'overflows%'"):
        start(
            section({"LogNvfp4TensorStats": {"enabled": True, "tensors": ["activation"], "stats": ["mse", "overflows%"]}}),
            log_dir,
        )
    with pytest.raises(ConfigError, match=r"output"):
        start(section({"LogNvfp4TensorStats": {"enabled": True, "tensors": ["output"], "stats": ["mse"]}}), log_dir)


def hist_ref(exponents: torch.Tensor) -> dict[str, float]:
    """Counts per bin of integer exponents (-inf: a zero scale) as the feature names them."""
    out = {}
    finite = exponents[exponents.isfinite()]
    out["under"] = float((exponents < -32).sum())
    out["over"] = float((finite > 15).sum())
    for e in range(-32, 16):
        tag = "0" if e == 0 else f"{'m' if e < 0 else 'p'}{abs(e)}"
        out[tag] = float((exponents == e).sum())
    return out


def mx_exponents(x: torch.Tensor) -> torch.Tensor:
    amax = x.double().reshape(x.shape[0], -1, 32).abs().amax(-1).reshape(-1)
    return torch.where(amax > 0, torch.ceil(torch.log2(amax / 448)), -127.0)


def test_scale_std_and_exponent_histogram_sum_over_micro_batches(log_dir):
    """Own MXFP8 and what-if MXFP8 of two micro-batches: the histogram adds both, the std spans both."""
    x1, x2, dy = wide((32, 256), 30), wide((32, 256), 31) * 1e-6, wide((32, 128), 32)
    x2[0, :32] = 0  # an all-zero block: scale 2**-127, in the underflow bin
    stats = ["scale_inv_std", "scale_exp_hist", "mxfp8_scale_exp_hist_columnwise"]
    collect = Collect()
    start(fp8_config(stats, tensors=["activation"]), log_dir, statistics_logger=collect)
    layer = make_linear(in_f=256, out_f=128)
    for x in (x1, x2):
        train_step(layer, x, dy, recipe=lowprec.MXFP8BlockScaling())
    debug_api.step()
    debug_api.end_debug()
    got = collect.values
    exponents = torch.cat([mx_exponents(x1), mx_exponents(x2)])
    assert got[("lin_activation_scale_inv_std", 0)] == pytest.approx((exponents + 127).std().item(), rel=1e-9)
    expected = hist_ref(exponents)
    assert sum(expected.values()) == exponents.numel() and expected["under"] > 0 and expected["m4"] > 0
    for tag, count in expected.items():
        assert got[(f"lin_activation_scale_exp_hist_{tag}", 0)] == count, tag
    columnwise = hist_ref(torch.cat([mx_exponents(x1.t()), mx_exponents(x2.t())]))
    for tag, count in columnwise.items():
        assert got[(f"lin_activation_mxfp8_scale_exp_hist_{tag}_columnwise", 0)] == count, tag


def test_nvfp4_histogram_uses_the_whole_block_scale(log_dir):
    x, dy = wide((32, 64), 33), wide((32, 48), 34)
    config = section(
        {
            "LogNvfp4TensorStats": {
                "enabled": True,
                "tensors": ["activation"],
                "stats": ["scale_inv_std", "scale_exp_hist"],
                "what_if": True,
            }
        }
    )
    got = run(config, log_dir, [(x, dy)], recipe=lowprec.Float8CurrentScaling(), layer=make_linear(in_f=64, out_f=48))
    _, _, scales = nvfp4_ref(x)
    s_enc = torch.tensor(448.0 * 6.0 / x.abs().max().item(), dtype=torch.float32).double()
    whole = (scales.float() * (1 / s_enc).float()).double()  # E4M3 scale times the fp32 decode scale
    exponents = torch.where(whole > 0, torch.floor(torch.log2(whole)), -math.inf)
    assert got[("lin_activation_nvfp4_scale_inv_std", 0)] == pytest.approx(scales.std().item(), rel=1e-9)
    for tag, count in hist_ref(exponents).items():
        assert got[(f"lin_activation_nvfp4_scale_exp_hist_{tag}", 0)] == count, tag


@pytest.mark.parametrize("stat", ["fp8_current_scaling_scale_inv_std", "fp8_delayed_scaling_scale_exp_hist"])
def test_block_scale_stats_of_per_tensor_recipes_are_config_errors(log_dir, stat):
    with pytest.raises(ConfigError, match=r"stats\.0'.*describes block scales"):
        start(fp8_config([stat], tensors=["activation"]), log_dir)


def test_own_cast_of_a_high_precision_operand_replays_the_rounding_noise():
    """Stats of a gradient its GEMMs read in high precision: the cast the layer would make, its noise replayed,
    the stream not advanced, so the layer's next real cast is the one it would have made anyway."""
    quantizer = lowprec.NVFP4BlockScaling().quantizers("lin")["gradient"]
    g = wide((32, 64), 40)
    seen = own_quantization(g, True, {"quantizer": quantizer, "rowwise_quantized_tensor": g})
    assert quantizer.rounding.next_offset == 0
    real = quantizer.quantize(g, transpose=True).columnwise
    assert torch.equal(seen.data, real.data) and torch.equal(seen.dequantized, real.dequantize().t())


@pytest.mark.parametrize("recipe", [lowprec.Float8CurrentScaling(), lowprec.MXFP8BlockScaling()], ids=["fp8", "mxfp8"])
def test_stats_features_given_a_quantized_tensor_say_so_and_log_nothing(log_dir, recipe):
    """Block-scaled tensors are recognised where Float8Tensor is: a quantized tensor handed to a statistics
    feature is not read as a high-precision one (it used to fail on ``.numel()`` for block formats)."""
    features = {
        "LogTensorStats": {"enabled": True, "stats": ["max"], "tensors": ["activation"]},
        "LogFp8TensorStats": {"enabled": True, "stats": ["mxfp8_underflows%"], "tensors": ["activation"]},
        "LogNvfp4TensorStats": {"enabled": True, "stats": ["underflows%"], "tensors": ["activation"]},
    }
    start(section(features), log_dir)
    try:
        quantized = recipe.quantizers("lin")["activation"].quantize(X)
        debug_api.transformer_engine.inspect_tensor(layer_name="lin", tensor_name="activation", tensor=quantized, iteration=0)
        debug_api.step()
    finally:
        debug_api.end_debug()
    debug_log = (log_dir / "nvdlfw_inspect_logs" / "nvdlfw_inspect_globalrank-0.log").read_text()
    assert "LogTensorStats needs the high-precision activation; none was given, nothing is logged" in debug_log
    assert (log_dir / "nvdlfw_inspect_statistics_logs" / "nvdlfw_inspect_globalrank-0.log").read_text().strip() == ""


def test_block_scale_stats_of_a_tensor_read_in_high_precision_are_not_logged_and_said(log_dir):
    """Under MXFP8 with every GEMM in high precision there are no block scales to describe: scale_inv_std is not
    logged, and the debug log says why once; underflows% describes what the GEMMs read (nothing lost)."""
    config = fp8_config(["underflows%", "scale_inv_std"], tensors=["activation"])
    config["sec"]["transformer_engine"]["DisableFP8Layer"] = {"enabled": True}
    collect = Collect()
    start(config, log_dir, statistics_logger=collect)
    layer = make_linear(in_f=256, out_f=128)
    for _ in range(2):
        train_step(layer, wide((32, 256), 40), wide((32, 128), 41), recipe=lowprec.MXFP8BlockScaling())
        debug_api.step()
    debug_api.end_debug()
    assert collect.values == {("lin_activation_underflows%", 0): 0.0, ("lin_activation_underflows%", 1): 0.0}
    text = (log_dir / "nvdlfw_inspect_logs" / "nvdlfw_inspect_globalrank-0.log").read_text()
    assert text.count("LogFp8TensorStats: scale_inv_std of activation not logged: its GEMMs read it without") == 1
