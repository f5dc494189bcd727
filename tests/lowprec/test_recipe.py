"""Recipes: formats per direction and argument checks."""

from __future__ import annotations

import pytest

from lowprec.formats.elements import E2M1, E4M3, E5M2
from lowprec.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format, MXFP8BlockScaling, NVFP4BlockScaling


def test_formats_per_direction():
    assert (Format.HYBRID.forward, Format.HYBRID.backward) == (E4M3, E5M2)
    assert (Format.E4M3.forward, Format.E4M3.backward) == (E4M3, E4M3)
    assert (Format.E5M2.forward, Format.E5M2.backward) == (E5M2, E5M2)


def test_defaults():
    recipe = DelayedScaling()
    assert (recipe.margin, recipe.fp8_format, recipe.amax_history_len, recipe.amax_compute_algo) == (
        0,
        Format.HYBRID,
        1024,
        "max",
    )
    assert Float8CurrentScaling().fp8_format is Format.HYBRID


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"margin": -1}, r"margin must be a non-negative integer, got -1"),
        ({"amax_history_len": 0}, r"amax_history_len must be a positive integer, got 0"),
        ({"amax_compute_algo": "mean"}, r"amax_compute_algo must be one of \['max', 'most_recent'\], got 'mean'"),
        ({"fp8_format": "HYBRID"}, r"fp8_format must be a lowprec.Format \(E4M3, E5M2, HYBRID\), got 'HYBRID'"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DelayedScaling(**kwargs)


def test_block_recipe_defaults_are_transformer_engines():
    mx = MXFP8BlockScaling()
    assert (mx.margin, mx.fp8_format, mx.enable_2d_quantization) == (0, Format.E4M3, False)
    block = Float8BlockScaling()
    assert (block.use_f32_scales, block.fp8_format) == (False, Format.E4M3)
    assert (block.x_block_scaling_dim, block.w_block_scaling_dim, block.grad_block_scaling_dim) == (1, 2, 1)
    nvfp4 = NVFP4BlockScaling()
    assert (nvfp4.disable_rht, nvfp4.disable_stochastic_rounding, nvfp4.disable_2d_quantization) == (False, False, False)
    assert (nvfp4.fp4_format, nvfp4.fp8_format, nvfp4.seed) == (Format.E2M1, Format.E4M3, 0)
    assert (Format.E2M1.forward, Format.E2M1.backward) == (E2M1, E2M1)
    assert MXFP8BlockScaling(fp8_format=Format.HYBRID) != MXFP8BlockScaling() and hash(NVFP4BlockScaling(seed=1))


@pytest.mark.parametrize(
    ("recipe", "kwargs", "message"),
    [
        (
            MXFP8BlockScaling,
            {"fp8_format": Format.E2M1},
            r"fp8_format must be a lowprec.Format \(E4M3, E5M2, HYBRID\), got <Format.E2M1",
        ),
        (MXFP8BlockScaling, {"enable_2d_quantization": 1}, r"MXFP8BlockScaling.enable_2d_quantization must be a bool, got 1"),
        (Float8BlockScaling, {"x_block_scaling_dim": 3}, r"Float8BlockScaling.x_block_scaling_dim must be 1 or 2, got 3"),
        (
            Float8BlockScaling,
            {"x_block_scaling_dim": 2},
            r"x_block_scaling_dim and w_block_scaling_dim are both 2, but a GEMM cannot take two 2-D block-scaled operands",
        ),
        (Float8BlockScaling, {"use_f32_scales": "yes"}, r"Float8BlockScaling.use_f32_scales must be a bool, got 'yes'"),
        (
            NVFP4BlockScaling,
            {"fp4_format": Format.E4M3},
            r"NVFP4BlockScaling.fp4_format must be lowprec.Format.E2M1, got <Format.E4M3",
        ),
        (
            NVFP4BlockScaling,
            {"fp8_format": Format.HYBRID},
            r"NVFP4BlockScaling.fp8_format \(the format of the block scales\) must be",
        ),
        (NVFP4BlockScaling, {"seed": -1}, r"NVFP4BlockScaling.seed must be an integer in \[0, 2\*\*63\), got -1"),
        (NVFP4BlockScaling, {"disable_rht": None}, r"NVFP4BlockScaling.disable_rht must be a bool, got None"),
        (DelayedScaling, {"fp8_format": Format.E2M1}, r"fp8_format must be a lowprec.Format \(E4M3, E5M2, HYBRID\)"),
    ],
)
def test_block_recipes_reject_bad_arguments(recipe, kwargs, message):
    with pytest.raises(ValueError, match=message):
        recipe(**kwargs)
