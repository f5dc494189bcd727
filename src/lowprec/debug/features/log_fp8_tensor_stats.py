"""``LogFp8TensorStats``: how well a tensor survives quantization, under the run's recipe or any other.

A stat is ``[recipe_]name[_columnwise]``: ``underflows%`` (non-zero values that become zero, in % of ALL the
elements, zeros included, as Transformer Engine counts),
``overflows%`` (values beyond the FP8 range under delayed scaling, which then saturate),
``scale_inv_min``, ``scale_inv_max``, ``mse`` (mean squared quantization error), and for block recipes
``scale_inv_std`` and ``scale_exp_hist`` (``block_scale_stats``) and the per-block ``underflow_blocks%``,
``saturated_blocks%``, ``worst_block_rel_err``, ``worst_block_row``, ``worst_block_col``, ``worst_block_flushed%``,
``worst_flushed_row`` and ``worst_flushed_col`` (``per_block_stats``; option ``block_underflow_threshold``). Without a recipe
prefix the stat describes the layer's own recipe (any of lowprec's, NVFP4 and the block recipes
included: their own operands, blockwise scales and, with ``_columnwise``, the transposed copy); with ``fp8_current_scaling_``,
``fp8_delayed_scaling_``, an MX prefix or ``fp8_block_scaling_`` it is computed as if that recipe were
in use ("what-if"), whatever the run uses and whatever the layer's plan (FP8 or high precision).
The MX prefixes (``quant/block.py``'s ``MX_WHAT_IF``) name the element and, when it is not the element's
default, the E8M0 scale rule: ``mxfp8_`` (the layer's FP8 format, NVIDIA's rule), ``mxfp8_ocp_``,
``mxfp6_e3m2_``, ``mxfp6_e2m3_``, ``mxfp4_`` (OCP rule), ``mxfp6_e3m2_nvidia_``, ``mxfp6_e2m3_nvidia_``,
``mxfp4_nvidia_``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

import nvdlfw_inspect.api as debug_api
from lowprec.debug.block_scale_stats import COLUMNWISE, SCALE_STATS, feed_scale_stats
from lowprec.debug.features.log_tensor_stats import ScheduledStats, parse_each, stats_reduction
from lowprec.debug.per_block_stats import BLOCK_STATS, THRESHOLD_KEY, feed_block_stats, parse_threshold
from lowprec.debug.quantized_stats import Quantized, from_block, per_tensor, quantization_fields
from lowprec.formats.elements import E4M3, E5M2, FP8Format
from lowprec.quant.block import FLOAT8_BLOCK_LABEL, MX_WHAT_IF, block_scaling_quantizer, mx_what_if_quantizer
from lowprec.quant.per_tensor import CURRENT_LABEL, DELAYED_LABEL, CurrentScalingQuantizer, DelayedScalingQuantizer
from lowprec.quant.protocol import BlockScaledTensor, Float8Tensor, QuantizedTensor, Quantizer
from lowprec.recipe import DelayedScaling
from nvdlfw_inspect.debug_features.log_tensor_stats import stats_list, window_key
from nvdlfw_inspect.errors import ConfigLocation, ErrorCollector
from nvdlfw_inspect.logging import say_once
from nvdlfw_inspect.registry import Registry, api_method
from nvdlfw_inspect.stats.buffers import STATS_BUFFERS
from nvdlfw_inspect.stats.catalog import stats_of
from nvdlfw_inspect.stats.fields import empty_partials, set_fields

DELAYED, CURRENT, BLOCK = DELAYED_LABEL, CURRENT_LABEL, FLOAT8_BLOCK_LABEL
RECIPES = (DELAYED, CURRENT, *MX_WHAT_IF, BLOCK)  # what-if recipes (what-if NVFP4 is LogNvfp4TensorStats)
PER_TENSOR = (DELAYED, CURRENT)
NAMES = (*stats_of("quantization"), *SCALE_STATS, *BLOCK_STATS)
BLOCK_ONLY = (*SCALE_STATS, *BLOCK_STATS)  # statistics of block scales or of blocks: none per tensor


@dataclass(frozen=True)
class Fp8Stat:
    """One parsed stat: ``recipe`` None means the layer's own recipe."""

    written: str
    recipe: str | None
    name: str
    columnwise: bool


def _problem(recipe: str | None, name: str, columnwise: bool) -> str | None:
    """Why no recipe defines this combination, or None when it is a statistic."""
    if name == "overflows%" and recipe not in (None, DELAYED):
        return "overflows% exists only under delayed scaling (fp8_delayed_scaling_ or no prefix)"
    if name in SCALE_STATS and recipe in PER_TENSOR:
        return f"{name} describes block scales: per-tensor recipes have one scale"
    if name in BLOCK_STATS and recipe in PER_TENSOR:
        return f"{name} describes the blocks of a block-scaled cast: per-tensor recipes have none"
    if columnwise and recipe in PER_TENSOR:
        return "per-tensor recipes have one scale: columnwise statistics equal the rowwise ones"
    return None


def _spelled(recipe: str | None, name: str, columnwise: bool) -> str:
    return f"{recipe + '_' if recipe else ''}{name}{COLUMNWISE if columnwise else ''}"


# Every statistic name the feature takes, for "did you mean" (``underflow%`` -> ``underflows%``).
ALL_STATS = tuple(
    _spelled(recipe, name, columnwise)
    for recipe in (None, *RECIPES)
    for name in NAMES
    for columnwise in (False, True)
    if _problem(recipe, name, columnwise) is None
)


def parse_fp8_stat(written: Any, location: ConfigLocation) -> Fp8Stat:
    """Split ``[recipe_]name[_columnwise]`` and reject combinations no recipe defines."""
    allowed = f"[{'|'.join(RECIPES)}_]{{{'|'.join(NAMES)}}}[{COLUMNWISE}]"
    if not isinstance(written, str):
        raise location.error("must be a statistic name", written, allowed)
    stat = written.lower()
    # the longest prefix first: ``mxfp8_ocp_mse`` is MXFP8 under the OCP rule, not an ``ocp_mse`` of ``mxfp8``
    recipe = next((r for r in sorted(RECIPES, key=len, reverse=True) if stat.startswith(r + "_")), None)
    rest = stat[len(recipe) + 1 :] if recipe else stat
    columnwise = rest.endswith(COLUMNWISE)
    name = rest.removesuffix(COLUMNWISE)
    if name not in NAMES:
        raise location.error("unsupported statistic", written, allowed, suggestions=ALL_STATS)
    problem = _problem(recipe, name, columnwise)
    if problem is not None:
        raise location.error(problem, written)
    return Fp8Stat(stat, recipe, name, columnwise)


def parse_fp8_stats(config: dict, location: ConfigLocation) -> list[Fp8Stat]:
    stats = stats_list(config, location, list(NAMES))
    return parse_each(stats, location.child("stats"), parse_fp8_stat)


def recipe_of(quantizer: Quantizer | None) -> str | None:
    """The statistics name of the recipe a layer's quantizer belongs to (None: the layer runs without a recipe,
    or its quantizer came from no recipe)."""
    if quantizer is None or not quantizer.label:
        return None
    return quantizer.label


@dataclass(frozen=True)
class Variant:
    """Stats of one feature config that share one cast: its recipe, orientation, and buffer key."""

    recipe: str
    columnwise: bool
    stats: list[tuple[str, str]]
    key: tuple


@Registry.register_feature(namespace="transformer_engine")
class LogFp8TensorStats(ScheduledStats):
    """Logs quantization statistics of activation, gradient and weight.

    ``stats``: ``[recipe_]name[_columnwise]`` with name ``underflows%``, ``overflows%`` (delayed scaling
    only), ``scale_inv_min``, ``scale_inv_max``, ``mse``, ``scale_inv_std`` or ``scale_exp_hist`` (block recipes
    only: a count per power of two, see ``block_scale_stats``), ``underflow_blocks%``, ``saturated_blocks%``,
    ``worst_block_rel_err``, ``worst_block_row``, ``worst_block_col``, ``worst_block_flushed%``,
    ``worst_flushed_row`` or ``worst_flushed_col`` (block recipes only: per block, see ``per_block_stats``), and
    recipe ``fp8_current_scaling``,
    ``fp8_delayed_scaling``, an MX one (``mxfp8``, ``mxfp8_ocp``, ``mxfp6_e3m2``, ``mxfp6_e2m3``, ``mxfp4``, or
    the last three with ``_nvidia``) or ``fp8_block_scaling`` (none: the layer's own recipe, also
    MXFP8BlockScaling, MXBlockScaling, Float8BlockScaling and NVFP4BlockScaling, where ``_columnwise`` reads the
    transposed copy).
    Other keys: ``tensors``/``tensors_struct``, ``freq``, ``start_step``, ``end_step``,
    ``start_end_list``, ``block_underflow_threshold`` (``underflow_blocks%`` counts the blocks in which more than
    this % of the non-zero values flush to zero; default 50). What-if casts use the layer's FP8 format, or E4M3
    (E5M2 for gradients) when the layer runs without one (what-if MXFP6 and MXFP4 their own element); what-if
    delayed scaling keeps its own amax history per layer and tensor.
    """

    allowed_tensors = ("activation", "gradient", "weight")
    parse_stats = staticmethod(parse_fp8_stats)
    option_keys = ScheduledStats.option_keys | {THRESHOLD_KEY}

    def validate_options(self, view: dict, location: ConfigLocation) -> None:
        collector = ErrorCollector()
        with collector.check():
            super().validate_options(view, location)
        with collector.check():
            parse_threshold(view, location)
        collector.raise_errors()

    def __init__(self) -> None:
        super().__init__()
        self._shadow_delayed: dict[tuple[str, str, FP8Format], DelayedScalingQuantizer] = {}
        self._pending_amax: dict[tuple[str, str, FP8Format], torch.Tensor] = {}
        self._plans: dict[tuple, tuple[dict, list[Variant]]] = {}

    @api_method
    def inspect_tensor(
        self, config: dict, layer_name: str, tensor_name: str, tensor: torch.Tensor | None, iteration: int, **kwargs: Any
    ) -> None:
        if not self.due(config, layer_name, tensor_name, iteration):
            return
        if tensor is None or isinstance(tensor, QuantizedTensor) or tensor.numel() == 0:
            return
        quantizer = kwargs.get("quantizer")
        own_recipe = recipe_of(quantizer)
        fmt = quantizer.format if quantizer is not None else (E5M2 if tensor_name == "gradient" else E4M3)
        reduction = stats_reduction(tensor_name, kwargs.get("tp_group"), kwargs.get("tp_size", 1))
        unquantized = unquantized_operand(tensor, kwargs)
        for variant in self._plan(config, layer_name, tensor_name, own_recipe):
            request = dict(layer_name=layer_name, tensor_name=tensor_name, stats=variant.stats, iteration=iteration, **reduction)
            own = kwargs if variant.recipe == own_recipe else None
            if own is not None and unquantized is not None:
                self._feed_unquantized(variant, tensor, unquantized, request)
                continue
            if variant.recipe in PER_TENSOR:
                scale, amax_out = self._per_tensor_scale(variant.recipe, tensor, fmt, layer_name, tensor_name, own)
                if scale is not None:
                    quantization = (scale, fmt.grid)
                    taken = STATS_BUFFERS.feed(
                        variant.key, tensor=tensor, quantization=quantization, amax_out=amax_out, **request
                    )
                    if amax_out is not None and taken:  # the shadow history records it at its next cast
                        self._pending_amax[(layer_name, tensor_name, fmt)] = amax_out
                    continue
            q = self._quantize(variant.recipe, variant.columnwise, tensor, fmt, own)
            plain = [stat for stat in variant.stats if stat[1] not in BLOCK_ONLY]
            if plain:
                fields = quantization_fields(tensor, q, overflows=variant.recipe == DELAYED)
                request["stats"] = plain
                STATS_BUFFERS.feed(variant.key, partials=set_fields(empty_partials(tensor.device), fields), **request)
            scale_stats = [stat for stat in variant.stats if stat[1] in SCALE_STATS]
            if scale_stats:
                request.pop("stats")
                feed_scale_stats(variant.key, q.scale_inv, q.block_scales, scale_stats, **request)
            block_stats = [stat for stat in variant.stats if stat[1] in BLOCK_STATS]
            if block_stats:
                request.pop("stats", None)
                threshold = parse_threshold(config, ConfigLocation("config"))
                feed_block_stats(variant.key, tensor, q, block_stats, threshold, **request)

    @staticmethod
    def _feed_unquantized(variant: Variant, tensor: torch.Tensor, operand: torch.Tensor, request: dict) -> None:
        """The layer's own statistics when no GEMM reads the recipe's cast (``unquantized_operand``): what the GEMMs
        read instead loses what ``operand`` lost against ``tensor``, nothing at all for the tensor itself; its scale_inv
        is 1 (no scale), so a remedy in place shows in the statistics it was chosen from."""
        plain = [stat for stat in variant.stats if stat[1] not in BLOCK_ONLY]
        skipped = [written for written, name in variant.stats if name in BLOCK_ONLY]
        if skipped:
            debug_api.log_message(
                f"LogFp8TensorStats: {', '.join(skipped)} of {request['tensor_name']} not logged: its GEMMs read it "
                "without the recipe's block scales (a feature keeps them in high precision or modifies the operand)",
                request["layer_name"],
                level=logging.WARNING,
                extra_cachable_args=(request["tensor_name"], tuple(skipped)),
            )
        if not plain:
            return
        fields = unquantized_fields(tensor, operand)
        request["stats"] = plain
        STATS_BUFFERS.feed(variant.key, partials=set_fields(empty_partials(tensor.device), fields), **request)

    def _plan(self, config: dict, layer_name: str, tensor_name: str, own_recipe: str | None) -> list[Variant]:
        """The stats grouped by the cast they need, worked out once per config and layer recipe."""
        key = (id(config), layer_name, tensor_name, own_recipe)
        cached = self._plans.get(key)
        if cached is not None and cached[0] is config:
            return cached[1]
        groups: dict[tuple[str, bool], list[Fp8Stat]] = {}
        for stat in self.parsed_stats(config):
            recipe = stat.recipe or self._own_recipe(stat, own_recipe, layer_name, tensor_name)
            if recipe is not None:
                groups.setdefault((recipe, stat.columnwise), []).append(stat)
        variants = []
        for (recipe, columnwise), group in groups.items():
            written = tuple(s.written for s in group)
            buffer_key = (layer_name, tensor_name, "LogFp8TensorStats", recipe, columnwise, written, window_key(config))
            variants.append(Variant(recipe, columnwise, [(s.written, s.name) for s in group], buffer_key))
        self._plans[key] = (config, variants)  # keeping ``config`` alive keeps its id unique
        return variants

    def _per_tensor_scale(
        self, recipe: str, tensor: torch.Tensor, fmt: FP8Format, layer_name: str, tensor_name: str, own: dict | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(scale, amax_out)`` of a per-tensor cast whose statistics the statistics kernel computes:
        the layer's own cast (its scale), current scaling (the tensor's own amax) or delayed scaling
        (a shadow amax history per layer and tensor, which records the amax the kernel writes to
        ``amax_out`` before its next cast; a weight fed again in a later micro-batch records nothing).
        No scale when the layer's operand came without one (then the operand's bytes are used)."""
        if own is not None:
            for operand in (own.get("rowwise_quantized_tensor"), own.get("columnwise_quantized_tensor")):
                if isinstance(operand, Float8Tensor):
                    return operand.scale, None
            return own["quantizer"].scale_for(tensor), None  # the tensor runs in high precision: cast it as the layer would
        if recipe == CURRENT:
            return CurrentScalingQuantizer(fmt).scale_for(tensor), None
        key = (layer_name, tensor_name, fmt)
        shadow = self._shadow_delayed.setdefault(key, DelayedScalingQuantizer(fmt, DelayedScaling()))
        scale = shadow.scale_for(tensor)
        pending = self._pending_amax.pop(key, None)
        if pending is not None:  # the previous call's amax, written by its kernel: record it before this cast
            shadow.record_amax(pending)
            scale = shadow.scale
        return scale, torch.empty((), dtype=torch.float32, device=tensor.device)

    def _quantize(
        self, recipe: str, columnwise: bool, tensor: torch.Tensor, fmt: FP8Format, own: dict[str, Any] | None
    ) -> Quantized:
        """The tensor as ``recipe`` quantizes it (block recipes, and own operands without a scale)."""
        if own is not None:
            return own_quantization(tensor, columnwise, own)
        quantizer = mx_what_if_quantizer(recipe, fmt) if recipe in MX_WHAT_IF else block_scaling_quantizer(fmt)
        quantized = quantizer.quantize(tensor, transpose=columnwise)
        return from_block(quantized.columnwise if columnwise else quantized.rowwise, columnwise)

    @staticmethod
    def _own_recipe(stat: Fp8Stat, own_recipe: str | None, layer_name: str, tensor_name: str) -> str | None:
        """The layer's recipe for a stat without a prefix, or None where the stat means nothing for this layer's
        format (a layer in high precision, a block statistic of a per-tensor recipe, ...): then it is skipped for
        this layer and tensor, said once, as one config serves a model whose layers run different formats."""
        if own_recipe is None:
            why = (
                "runs in high precision (outside lowprec.autocast, or by its precision plan), so it has no cast of its "
                f"own to describe; a recipe prefix ({', '.join(RECIPES)}) logs the cast of that recipe"
            )
        elif stat.name == "overflows%" and own_recipe != DELAYED:
            why = f"runs {own_recipe}: overflows% exists only under delayed scaling"
        elif stat.name in BLOCK_ONLY and own_recipe in PER_TENSOR:
            why = f"runs {own_recipe}, which has one scale per tensor: {stat.name} describes block scales or blocks"
        elif stat.columnwise and own_recipe in PER_TENSOR:
            why = f"runs {own_recipe}, which has one scale per tensor: its columnwise statistics equal the rowwise ones"
        else:
            return own_recipe
        say_once(
            f"LogFp8TensorStats: {stat.written} of {tensor_name} of {layer_name} not logged: the layer {why}",
            layer_name,
            call_site=__name__,
        )
        return None


def unquantized_operand(tensor: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor | None:
    """What the layer's GEMMs read of ``tensor`` when none reads the recipe's cast, else None (a GEMM reads a
    quantized operand, whose cast the statistics then describe; or the caller passed no operands). A feature's
    modified operand (FakeQuant's rounded values) comes before the tensor itself: the statistics describe the
    lossiest operand the GEMMs read."""
    operands = [kwargs.get("rowwise_quantized_tensor"), kwargs.get("columnwise_quantized_tensor")]
    given = [operand for operand in operands if operand is not None]
    if not given or any(isinstance(operand, QuantizedTensor) for operand in given):
        return None
    modified = [operand for operand in given if operand is not tensor]
    return modified[0] if modified else tensor


def unquantized_fields(tensor: torch.Tensor, operand: torch.Tensor) -> dict[str, Any]:
    """Quantization fields of a GEMM operand read in high precision: the non-zero values ``operand`` lost against
    ``tensor`` and its squared error (both 0 for the tensor itself), no overflow, scale_inv 1."""
    fields: dict[str, Any] = {"count": tensor.numel(), "overflows": 0.0, "scale_inv_min": 1.0, "scale_inv_max": 1.0}
    if operand is tensor:
        return {**fields, "underflows": 0.0, "sq_err": 0.0}
    x, y = tensor.detach().float(), operand.detach().float().reshape(tensor.shape)
    flushed = (x != 0) & (y == 0) & ~x.isnan()
    return {**fields, "underflows": flushed.sum(), "sq_err": (y - x).square().sum()}


def own_quantization(tensor: torch.Tensor, columnwise: bool, own: dict[str, Any]) -> Quantized:
    """The layer's own cast of ``tensor``: its operand when a GEMM reads it quantized (per-tensor FP8, or the
    block orientation asked for), otherwise the cast its block quantizer would make (per-tensor recipes
    without an FP8 operand go through the statistics kernel instead). A stochastically rounding quantizer
    replays the noise of its next cast without taking it, so inspecting changes no training number."""
    for operand in (own.get("rowwise_quantized_tensor"), own.get("columnwise_quantized_tensor")):
        if isinstance(operand, Float8Tensor):
            return per_tensor(operand)
        if isinstance(operand, BlockScaledTensor):
            part = operand.columnwise if columnwise else operand.rowwise
            if part is not None:
                return from_block(part, columnwise)
    quantized = own["quantizer"].replaying(None).quantize(tensor, transpose=columnwise)
    return from_block(quantized.columnwise if columnwise else quantized.rowwise, columnwise)
