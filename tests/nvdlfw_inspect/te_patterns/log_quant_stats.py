"""Subclasses of the base ``LogTensorStats`` whose statistics the base list does not know, checked as
Transformer Engine's quantized-statistics features check them:

* ``LogQuantStats`` (as ``LogFp8TensorStats``): ``check_if_stat_is_supported(stat, current_recipe, ...)``
  needs the call's recipe, so only the call can judge a statistic; names may carry a recipe prefix
  (``mxfp8_underflows%``) and a ``_columnwise`` suffix.
* ``LogFp4Stats`` (as ``LogNvfp4TensorStats``): ``check_if_stat_is_supported(stat)`` alone.
* ``LogListedStats`` (as TE's first ``LogFp8TensorStats``): its own ``_get_supported_stats_list``, and an
  ``inspect_tensor`` of the older signature (no quantizer, quantized tensors or tp_size).

The "quantizer" of a call is any object with ``recipe`` and ``step``: casting rounds to multiples of ``step``.
"""

from __future__ import annotations

from typing import Any

import te_stats
import torch

from nvdlfw_inspect.debug_features.log_tensor_stats import LogTensorStats as BaseLogTensorStats
from nvdlfw_inspect.registry import Registry, api_method

RECIPE_STEPS = {"fp8_delayed_scaling": 0.5, "fp8_current_scaling": 0.5, "mxfp8": 0.25, "fp8_block_scaling": 0.125}
QUANT_STATS = ("underflows%", "overflows%", "scale_inv_min", "scale_inv_max", "mse")


def cast(x: torch.Tensor, step: float) -> torch.Tensor:
    return torch.round(x / step) * step


def quant_stat(stat: str, x: torch.Tensor, step: float) -> float:
    """One statistic of casting ``x`` to multiples of ``step``."""
    q = cast(x, step)
    if stat == "underflows%":
        return (((x != 0) & (q == 0)).sum() / x.numel() * 100).item()
    if stat == "overflows%":
        return 0.0
    if stat == "mse":
        return ((q - x) ** 2).mean().item()
    return step  # scale_inv_min, scale_inv_max: one scale for the whole tensor


class _QuantStatsBase(BaseLogTensorStats):
    @api_method
    def inspect_tensor_enabled(self, config: dict, layer_name: str, tensor_name: str, iteration: int) -> tuple[bool, int | None]:
        return te_stats.scheduled(config, iteration)


@Registry.register_feature(namespace="transformer_engine")
class LogQuantStats(_QuantStatsBase):
    """Logs statistics of casting a tensor with the call's recipe, or with another recipe named as prefix."""

    def get_recipe_from_stat(self, stat: str, default_recipe: str = "") -> str:
        return next((recipe for recipe in RECIPE_STEPS if stat.startswith(recipe + "_")), default_recipe)

    def check_if_stat_is_supported(self, stat: str, current_recipe: str, high_precision_tensor_provided: bool) -> bool:
        recipe = self.get_recipe_from_stat(stat, default_recipe=current_recipe)
        bare = stat.removesuffix("_columnwise").removeprefix(recipe + "_")
        if recipe not in RECIPE_STEPS:
            raise ValueError(f"Stat {stat} names no recipe and the layer runs none")
        if bare not in QUANT_STATS:
            raise ValueError(f"Stat {stat} contains an unsupported stat name: {bare}")
        if bare != "scale_inv_min" and bare != "scale_inv_max" and not high_precision_tensor_provided:
            raise ValueError(f"Stat {stat} needs the high-precision tensor")
        return True

    @api_method
    def inspect_tensor(
        self,
        config: dict,
        layer_name: str,
        tensor_name: str,
        iteration: int,
        tp_group: Any,
        tensor: torch.Tensor | None,
        rowwise_quantized_tensor: Any = None,
        columnwise_quantized_tensor: Any = None,
        quantizer: Any = None,
        tp_size: int = 1,
    ) -> None:
        if quantizer is None or not te_stats.scheduled(config, iteration)[0]:
            return
        for stat in config["stats"]:
            self.check_if_stat_is_supported(stat, quantizer.recipe, tensor is not None)
        for stat in config["stats"]:
            recipe = self.get_recipe_from_stat(stat, default_recipe=quantizer.recipe)
            bare = stat.removesuffix("_columnwise").removeprefix(recipe + "_")
            step = quantizer.step if recipe == quantizer.recipe else RECIPE_STEPS[recipe]
            te_stats.record(layer_name, tensor_name, stat, quant_stat(bare, tensor, step), iteration)


@Registry.register_feature(namespace="transformer_engine")
class LogFp4Stats(_QuantStatsBase):
    """Logs ``underflows%`` and ``mse`` of casting to a coarse grid, named with an ``fp4_`` prefix."""

    def check_if_stat_is_supported(self, stat: str) -> bool:
        if stat not in ("underflows%", "mse"):
            raise ValueError(f"Stat {stat} is not supported for FP4. Supported stats: ['underflows%', 'mse']")
        return True

    @api_method
    def inspect_tensor(
        self, config: dict, layer_name: str, tensor_name: str, iteration: int, tp_group: Any, tensor: torch.Tensor, **kwargs: Any
    ) -> None:
        for stat in config["stats"]:
            self.check_if_stat_is_supported(stat)
            te_stats.record(layer_name, tensor_name, f"fp4_{stat}", quant_stat(stat, tensor, 1.0), iteration)


@Registry.register_feature(namespace="transformer_engine")
class LogListedStats(_QuantStatsBase):
    """Logs ``underflows%`` of casting with the step of fp8_current_scaling."""

    def _get_supported_stats_list(self) -> set[str]:
        return {"underflows%"}

    @api_method
    def inspect_tensor(
        self, config: dict, layer_name: str, tensor_name: str, tensor: torch.Tensor, iteration: int, tp_group: Any
    ) -> None:
        for stat in config["stats"]:
            assert stat in self._get_supported_stats_list()
            te_stats.record(layer_name, tensor_name, f"listed_{stat}", quant_stat(stat, tensor, 0.5))  # at the trainer's step
