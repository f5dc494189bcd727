"""``LogNvfp4TensorStats``: how well a tensor survives NVFP4 (E2M1 values, E4M3 scales per 16 values, an fp32
scale per tensor), for the layers that run ``NVFP4BlockScaling``; with ``what_if: true`` also for the others, as if
they used it.

Logged as Transformer Engine names them: ``{layer}_{tensor}_nvfp4_{stat}``. As in Transformer Engine, a tensor whose
layer runs another format (a model whose precision plan mixes FP8 and NVFP4 layers) or none is skipped, said once
per layer and tensor, so one config serves the whole model.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

import nvdlfw_inspect.api as debug_api
from lowprec.debug.block_scale_stats import SCALE_STATS, feed_scale_stats
from lowprec.debug.features.log_fp8_tensor_stats import own_quantization, recipe_of
from lowprec.debug.features.log_tensor_stats import ScheduledStats, parse_each, stats_reduction
from lowprec.debug.per_block_stats import BLOCK_STATS, THRESHOLD_KEY, feed_block_stats, parse_threshold
from lowprec.debug.quantized_stats import Quantized, from_block, quantization_fields
from lowprec.quant.block import NVFP4_LABEL, BlockQuantizer
from lowprec.quant.protocol import QuantizedTensor
from lowprec.recipe import NVFP4BlockScaling
from nvdlfw_inspect.debug_features.log_tensor_stats import stats_list, window_key
from nvdlfw_inspect.errors import ConfigLocation, ErrorCollector
from nvdlfw_inspect.registry import Registry, api_method
from nvdlfw_inspect.stats.buffers import STATS_BUFFERS
from nvdlfw_inspect.stats.catalog import stats_of
from nvdlfw_inspect.stats.fields import empty_partials, set_fields

# E2M1 saturates, never overflows (saturated_blocks% counts the blocks where it did)
STATS = (*(stat for stat in stats_of("quantization") if stat != "overflows%"), *SCALE_STATS, *BLOCK_STATS)
PREFIX = "nvfp4_"
# What-if casts: NVFP4BlockScaling's quantizers (16 x 16 weight blocks) rounding to nearest, so that the
# statistics repeat; the rowwise copy never goes through the Hadamard transform.
WHAT_IF = NVFP4BlockScaling(disable_stochastic_rounding=True)


def parse_nvfp4_stat(entry: Any, location: ConfigLocation) -> str:
    if not isinstance(entry, str) or entry.lower() not in STATS:
        raise location.error("unsupported statistic", entry, list(STATS))
    return entry.lower()


def parse_nvfp4_stats(config: dict, location: ConfigLocation) -> list[str]:
    return parse_each(stats_list(config, location, list(STATS)), location.child("stats"), parse_nvfp4_stat)


def nvfp4_quantization(tensor: torch.Tensor, tensor_name: str, layer_name: str, own: dict[str, Any]) -> Quantized:
    """The layer's own NVFP4 cast (rowwise) when it runs NVFP4BlockScaling, else the what-if cast."""
    if runs_nvfp4(own):
        return own_quantization(tensor, False, own)
    quantizer: BlockQuantizer = WHAT_IF.quantizers(layer_name)[tensor_name]
    return from_block(quantizer.quantize(tensor).rowwise, False)


def runs_nvfp4(kwargs: dict[str, Any]) -> bool:
    """Whether the tensor's layer casts it with NVFP4BlockScaling (the quantizer ``inspect_tensor`` was given)."""
    return recipe_of(kwargs.get("quantizer")) == NVFP4_LABEL


def parse_what_if(config: dict, location: ConfigLocation) -> bool:
    value = config.get("what_if", False)
    if not isinstance(value, bool):
        raise location.child("what_if").error("must be true or false", value, [True, False])
    return value


@Registry.register_feature(namespace="transformer_engine")
class LogNvfp4TensorStats(ScheduledStats):
    """Logs NVFP4 quantization statistics of activation, gradient and weight.

    ``stats``: ``underflows%`` (non-zero values whose E2M1 code is +0 or -0), ``mse`` (mean squared
    quantization error), ``scale_inv_min`` (smallest non-zero E4M3 block scale), ``scale_inv_max``,
    ``scale_inv_std`` and ``scale_exp_hist`` (see ``block_scale_stats``), and per 16-value block (see
    ``per_block_stats``) ``underflow_blocks%`` (blocks in which more than ``block_underflow_threshold`` %, default
    50, of the non-zero values flush to zero), ``saturated_blocks%``, ``worst_block_rel_err``, ``worst_block_row``,
    ``worst_block_col``, ``worst_block_flushed%`` (the largest share of a block's non-zero values that flush),
    ``worst_flushed_row`` and ``worst_flushed_col`` (where that block is: an outlier channel's column). Layers
    under ``NVFP4BlockScaling`` report their own operands. The others are skipped (said once per layer and tensor),
    unless ``what_if: true``: then they report the cast NVFP4BlockScaling would make, rounding to nearest. Other
    keys: ``tensors``/``tensors_struct``, ``freq``, ``start_step``, ``end_step``, ``start_end_list``.
    """

    allowed_tensors = ("activation", "gradient", "weight")
    parse_stats = staticmethod(parse_nvfp4_stats)
    option_keys = ScheduledStats.option_keys | {"what_if", THRESHOLD_KEY}

    def validate_options(self, view: dict, location: ConfigLocation) -> None:
        collector = ErrorCollector()
        with collector.check():
            super().validate_options(view, location)
        with collector.check():
            parse_what_if(view, location)
        with collector.check():
            parse_threshold(view, location)
        collector.raise_errors()

    @api_method
    def inspect_tensor(
        self, config: dict, layer_name: str, tensor_name: str, tensor: torch.Tensor | None, iteration: int, **kwargs: Any
    ) -> None:
        if not self.due(config, layer_name, tensor_name, iteration):
            return
        if tensor is None or isinstance(tensor, QuantizedTensor) or tensor.numel() == 0:
            return
        if not runs_nvfp4(kwargs) and not parse_what_if(config, ConfigLocation("config")):
            quantizer = kwargs.get("quantizer")
            runs = f"runs {quantizer.label or 'another format'}" if quantizer is not None else "runs in high precision"
            debug_api.log_message(
                f"LogNvfp4TensorStats: {tensor_name} of {layer_name} skipped: the layer {runs}, not NVFP4BlockScaling; "
                "what_if: true in the feature's config logs the cast NVFP4 would make of it",
                layer_name,
                level=logging.WARNING,
                extra_cachable_args=(tensor_name,),
            )
            return
        stats = self.parsed_stats(config)
        q = nvfp4_quantization(tensor, tensor_name, layer_name, kwargs)
        key = (layer_name, tensor_name, "LogNvfp4TensorStats", tuple(stats), window_key(config))
        request = dict(layer_name=layer_name, tensor_name=tensor_name, iteration=iteration)
        request |= stats_reduction(tensor_name, kwargs.get("tp_group"), kwargs.get("tp_size", 1))
        plain = [(PREFIX + stat, stat) for stat in stats if stat not in SCALE_STATS and stat not in BLOCK_STATS]
        if plain:
            partials = set_fields(empty_partials(tensor.device), quantization_fields(tensor, q, overflows=False))
            STATS_BUFFERS.feed(key, stats=plain, partials=partials, **request)
        scale_stats = [(PREFIX + stat, stat) for stat in stats if stat in SCALE_STATS]
        if scale_stats:
            feed_scale_stats(key, q.scale_inv, q.block_scales, scale_stats, **request)
        block_stats = [(PREFIX + stat, stat) for stat in stats if stat in BLOCK_STATS]
        if block_stats:
            threshold = parse_threshold(config, ConfigLocation("config"))
            feed_block_stats(key, tensor, q, block_stats, threshold, **request)
