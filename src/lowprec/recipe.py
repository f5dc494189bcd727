"""Scaling recipes: how a layer picks the scales that map its tensors into a low-precision format's range.

Per-tensor FP8: ``DelayedScaling``, ``Float8CurrentScaling``. Block-scaled (one scale per block of
values along the GEMM's inner dimension, see ``formats/scales.py``): ``MXFP8BlockScaling``,
``Float8BlockScaling``, ``NVFP4BlockScaling``. Names, fields and defaults follow Transformer Engine's
``transformer_engine.common.recipe``, so configs and code written for it carry over. ``MXBlockScaling``
(lowprec's) covers the whole OCP MX family, MXFP8, MXFP6 and MXFP4, under either E8M0 scale rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from lowprec.errors import LowprecValueError
from lowprec.formats import elements, hadamard
from lowprec.formats.elements import E2M1, MX_ELEMENTS, ElementFormat, FP4Format, FP8Format
from lowprec.formats.noise import RoundingStream
from lowprec.formats.scales import (
    FLOAT8_BLOCK,
    MX_BLOCK,
    MX_SCALE_RULES,
    NVFP4_BLOCK,
    NVIDIA,
    Float8BlockScaleRule,
    NVFP4ScaleRule,
    default_mx_scale_rule,
)
from lowprec.quant.block import FLOAT8_BLOCK_LABEL, NVFP4_LABEL, BlockQuantizer, mx_quantizer
from lowprec.quant.per_tensor import CurrentScalingQuantizer, DelayedScalingQuantizer
from lowprec.quant.protocol import Quantizer
from nvdlfw_inspect.errors import is_int

OPERANDS = ("activation", "weight", "gradient")
"""The tensors a recipe casts: the GEMMs of a linear layer read each in one or two orientations."""


class Format(Enum):
    """Which format the forward tensors (activations, weights) and the gradients use. ``E2M1`` is FP4,
    only for ``NVFP4BlockScaling.fp4_format``."""

    E4M3 = (elements.E4M3, elements.E4M3)
    E5M2 = (elements.E5M2, elements.E5M2)
    HYBRID = (elements.E4M3, elements.E5M2)
    E2M1 = (E2M1, E2M1)

    @property
    def forward(self) -> FP8Format | FP4Format:
        return self.value[0]

    @property
    def backward(self) -> FP8Format | FP4Format:
        return self.value[1]


FP8_FORMATS = (Format.E4M3, Format.E5M2, Format.HYBRID)


_AMAX_ALGOS = ("max", "most_recent")
RHT_SIGNS = (hadamard.TE_SIGNS, "seeded")
"""``NVFP4BlockScaling.rht_signs``: Transformer Engine's fixed Hadamard signs, or signs drawn from the seed."""


class Recipe:
    """Base of the recipes: ``quantizers`` says how each operand of a layer's GEMMs is cast."""

    def quantizers(self, layer_name: str) -> dict[str, Quantizer]:
        """One quantizer per operand (``OPERANDS``), configured as Transformer Engine configures them;
        ``layer_name`` keys what is drawn per layer (stochastic-rounding noise)."""
        raise NotImplementedError


def _per_operand(fmt: Format, make) -> dict[str, Quantizer]:
    """``make(format)`` per operand: the forward format for activation and weight, the backward one for the gradient."""
    return {"activation": make(fmt.forward), "weight": make(fmt.forward), "gradient": make(fmt.backward)}


@dataclass(frozen=True)
class DelayedScaling(Recipe):
    """Scale from the amax of earlier casts: the largest of the last ``amax_history_len`` (``"max"``)
    or the latest one (``"most_recent"``). The first cast of a tensor uses scale 1.

    ``scale = fp8_max / amax / 2**margin``.
    """

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"

    def __post_init__(self) -> None:
        _check_format(self.fp8_format)
        _check_margin(self.margin)
        if not is_int(self.amax_history_len) or self.amax_history_len < 1:
            raise LowprecValueError(f"DelayedScaling.amax_history_len must be a positive integer, got {self.amax_history_len!r}")
        if self.amax_compute_algo not in _AMAX_ALGOS:
            raise LowprecValueError(
                f"DelayedScaling.amax_compute_algo must be one of {list(_AMAX_ALGOS)}, got {self.amax_compute_algo!r}"
            )

    def quantizers(self, layer_name: str) -> dict[str, Quantizer]:
        return _per_operand(self.fp8_format, lambda fmt: DelayedScalingQuantizer(fmt, self))


@dataclass(frozen=True)
class Float8CurrentScaling(Recipe):
    """One scale per tensor from its own amax at the time of the cast: ``scale = fp8_max / amax``."""

    fp8_format: Format = Format.HYBRID

    def __post_init__(self) -> None:
        _check_format(self.fp8_format)

    def quantizers(self, layer_name: str) -> dict[str, Quantizer]:
        return _per_operand(self.fp8_format, CurrentScalingQuantizer)


@dataclass(frozen=True)
class MXFP8BlockScaling(Recipe):
    """MXFP8 (OCP Microscaling): FP8 elements, one E8M0 (power-of-two) scale per 32 consecutive values
    along the GEMM's inner dimension. ``fp8_format`` defaults to E4M3 for every tensor, as in Transformer
    Engine (HYBRID: E5M2 gradients). ``enable_2d_quantization``: one scale per 32 x 32 block of the
    weight, shared by its two orientations. ``margin`` is accepted for compatibility and, as in
    Transformer Engine, unused."""

    margin: int = 0
    fp8_format: Format = Format.E4M3
    enable_2d_quantization: bool = False

    def __post_init__(self) -> None:
        _check_margin(self.margin)
        _check_format(self.fp8_format)
        _check_bool("MXFP8BlockScaling.enable_2d_quantization", self.enable_2d_quantization)

    def quantizers(self, layer_name: str) -> dict[str, Quantizer]:
        fwd, bwd = self.fp8_format.forward, self.fp8_format.backward
        return _mx_quantizers((fwd, NVIDIA), (bwd, NVIDIA), self.enable_2d_quantization)


def _mx_quantizers(forward: tuple[ElementFormat, str], gradient: tuple[ElementFormat, str], two_d: bool) -> dict[str, Quantizer]:
    """The MX quantizers of each operand from ``(element, scale rule)`` of the forward operands and the gradient;
    ``two_d``: one scale per 32 x 32 block of the weight. Per-tensor features use E4M3 (E5M2 for gradients) where
    the element is not FP8."""
    weight_block = (MX_BLOCK, MX_BLOCK) if two_d else (1, MX_BLOCK)
    return {
        "activation": mx_quantizer(*forward),
        "weight": mx_quantizer(*forward, block=weight_block),
        "gradient": mx_quantizer(*gradient, fmt=elements.E5M2),
    }


@dataclass(frozen=True)
class MXBlockScaling(Recipe):
    """Any OCP MX format: ``element`` values (``"e4m3"``, ``"e5m2"``: MXFP8; ``"e3m2"``, ``"e2m3"``: MXFP6;
    ``"e2m1"``: MXFP4), one E8M0 scale per 32 consecutive values along the GEMM's inner dimension.
    ``gradient_element``: the gradients' element (None: ``element``), e.g. ``"e5m2"`` under ``"e4m3"`` as
    Transformer Engine's HYBRID. ``scale_rule``: ``"nvidia"`` (rounded up, Transformer Engine's MXFP8: no
    value saturates) or ``"ocp"`` (the specification's floor); None takes each element's default, NVIDIA's
    for FP8 elements (where Transformer Engine has the format) and the specification's for FP6 and FP4
    (only it defines them). ``enable_2d_quantization``: one scale per 32 x 32 block of the weight.
    ``MXBlockScaling(element="e4m3", scale_rule="nvidia")`` is ``MXFP8BlockScaling()``, bit for bit."""

    element: str = "e4m3"
    gradient_element: str | None = None
    scale_rule: str | None = None
    enable_2d_quantization: bool = False

    def __post_init__(self) -> None:
        for name in ("element", "gradient_element"):
            value = getattr(self, name)
            if not (isinstance(value, str) and value in MX_ELEMENTS) and not (name == "gradient_element" and value is None):
                raise LowprecValueError(f"MXBlockScaling.{name} must be one of {list(MX_ELEMENTS)}, got {value!r}")
        if self.scale_rule is not None and not (isinstance(self.scale_rule, str) and self.scale_rule in MX_SCALE_RULES):
            raise LowprecValueError(
                f"MXBlockScaling.scale_rule must be one of {list(MX_SCALE_RULES)} or None (each element's default), "
                f"got {self.scale_rule!r}"
            )
        _check_bool("MXBlockScaling.enable_2d_quantization", self.enable_2d_quantization)

    def rule_of(self, element: ElementFormat) -> str:
        """The scale rule ``element``'s operands use: ``scale_rule``, or the element's default."""
        return self.scale_rule or default_mx_scale_rule(element)

    def quantizers(self, layer_name: str) -> dict[str, Quantizer]:
        fwd = MX_ELEMENTS[self.element]
        bwd = MX_ELEMENTS[self.gradient_element or self.element]
        return _mx_quantizers((fwd, self.rule_of(fwd)), (bwd, self.rule_of(bwd)), self.enable_2d_quantization)


@dataclass(frozen=True)
class Float8BlockScaling(Recipe):
    """FP8 with fp32 scales per block (Transformer Engine's "blockwise" recipe): ``1`` = 1 x 128 tiles
    along the inner dimension, ``2`` = 128 x 128 blocks, per tensor (activations ``x``, weights ``w``,
    gradients ``grad``). Scales are powers of two unless ``use_f32_scales``. Two 2-D operands may not
    meet in one GEMM (as in Transformer Engine)."""

    use_f32_scales: bool = False
    fp8_format: Format = Format.E4M3
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1

    def __post_init__(self) -> None:
        _check_bool("Float8BlockScaling.use_f32_scales", self.use_f32_scales)
        _check_format(self.fp8_format)
        dims = {"x": self.x_block_scaling_dim, "w": self.w_block_scaling_dim, "grad": self.grad_block_scaling_dim}
        for name, dim in dims.items():
            if not is_int(dim) or dim not in (1, 2):
                raise LowprecValueError(f"Float8BlockScaling.{name}_block_scaling_dim must be 1 or 2, got {dim!r}")
        two_d = [f"{name}_block_scaling_dim" for name, dim in dims.items() if dim == 2]
        if len(two_d) > 1:
            raise LowprecValueError(
                f"Float8BlockScaling: {' and '.join(two_d)} are both 2, but a GEMM cannot take two 2-D block-scaled "
                "operands; set at most one of them to 2"
            )

    def quantizers(self, layer_name: str) -> dict[str, Quantizer]:
        power_2 = not self.use_f32_scales

        def quantizer(fmt: FP8Format, dim: int) -> BlockQuantizer:
            block = (FLOAT8_BLOCK, FLOAT8_BLOCK) if dim == 2 else (1, FLOAT8_BLOCK)
            return BlockQuantizer(Float8BlockScaleRule(fmt, power_2), fmt, block, fmt, label=FLOAT8_BLOCK_LABEL)

        fwd, bwd = self.fp8_format.forward, self.fp8_format.backward
        return {
            "activation": quantizer(fwd, self.x_block_scaling_dim),
            "weight": quantizer(fwd, self.w_block_scaling_dim),
            "gradient": quantizer(bwd, self.grad_block_scaling_dim),
        }


@dataclass(frozen=True)
class NVFP4BlockScaling(Recipe):
    """NVFP4: E2M1 elements, one E4M3 scale per 16 consecutive values along the inner dimension, and one
    fp32 scale per tensor. As in Transformer Engine, by default weights use 16 x 16 blocks, gradients
    stochastic rounding, and the wgrad operands (activation and gradient, columnwise) the random
    Hadamard transform; each ``disable_*`` turns one off. ``rht_signs``: the Hadamard transform's sign vector,
    ``"transformer_engine"`` (TE's fixed vector, the default: bit for bit TE's casts) or ``"seeded"`` (drawn
    from ``seed``). ``seed`` (lowprec's, not Transformer Engine's) draws the stochastic-rounding noise and the
    seeded signs, so runs are reproducible."""

    disable_rht: bool = False
    disable_stochastic_rounding: bool = False
    disable_2d_quantization: bool = False
    fp4_format: Format = Format.E2M1
    fp8_format: Format = Format.E4M3
    seed: int = 0
    rht_signs: str = hadamard.TE_SIGNS

    def __post_init__(self) -> None:
        if self.rht_signs not in RHT_SIGNS:
            raise LowprecValueError(f"NVFP4BlockScaling.rht_signs must be one of {list(RHT_SIGNS)}, got {self.rht_signs!r}")
        for name in ("disable_rht", "disable_stochastic_rounding", "disable_2d_quantization"):
            _check_bool(f"NVFP4BlockScaling.{name}", getattr(self, name))
        if self.fp4_format is not Format.E2M1:
            raise LowprecValueError(f"NVFP4BlockScaling.fp4_format must be lowprec.Format.E2M1, got {self.fp4_format!r}")
        if self.fp8_format is not Format.E4M3:
            raise LowprecValueError(
                f"NVFP4BlockScaling.fp8_format (the format of the block scales) must be lowprec.Format.E4M3, "
                f"got {self.fp8_format!r}"
            )
        if not is_int(self.seed) or not 0 <= self.seed < 2**63:
            raise LowprecValueError(f"NVFP4BlockScaling.seed must be an integer in [0, 2**63), got {self.seed!r}")

    def quantizers(self, layer_name: str) -> dict[str, Quantizer]:
        fmt, rule, row = self.fp8_format.forward, NVFP4ScaleRule(), (1, NVFP4_BLOCK)
        rht = None if self.disable_rht else (hadamard.TE_SIGNS if self.rht_signs == hadamard.TE_SIGNS else self.seed)
        weight_block = row if self.disable_2d_quantization else (NVFP4_BLOCK, NVFP4_BLOCK)
        rounding = None if self.disable_stochastic_rounding else RoundingStream(self.seed, f"{layer_name}.gradient")
        return {
            "activation": BlockQuantizer(rule, E2M1, row, fmt, hadamard_seed=rht, label=NVFP4_LABEL),
            "weight": BlockQuantizer(rule, E2M1, weight_block, fmt, label=NVFP4_LABEL),
            "gradient": BlockQuantizer(rule, E2M1, row, fmt, hadamard_seed=rht, rounding=rounding, label=NVFP4_LABEL),
        }


RECIPES = (DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling, MXBlockScaling, Float8BlockScaling, NVFP4BlockScaling)
BLOCK_RECIPES = (MXFP8BlockScaling, MXBlockScaling, Float8BlockScaling, NVFP4BlockScaling)


def _check_format(fmt: object) -> None:
    if fmt not in FP8_FORMATS:
        raise LowprecValueError(f"fp8_format must be a lowprec.Format ({', '.join(f.name for f in FP8_FORMATS)}), got {fmt!r}")


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise LowprecValueError(f"{name} must be a bool, got {value!r}")


def _check_margin(margin: object) -> None:
    if not is_int(margin) or margin < 0:
        raise LowprecValueError(f"margin must be a non-negative integer, got {margin!r}")
