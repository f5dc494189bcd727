"""A subclass of the base ``LogTensorStats`` adding statistics, one of them given as a mapping of options
(``{max_blockwise_dynamic_range: {block_size: 4, dims: 1}}``), judged by ``_is_supported_stat`` as in
Transformer Engine's ``LogTensorStats``."""

from __future__ import annotations

from typing import Any

import te_stats
import torch

from nvdlfw_inspect.debug_features.log_tensor_stats import LogTensorStats as BaseLogTensorStats
from nvdlfw_inspect.registry import Registry, api_method

BLOCKWISE = "max_blockwise_dynamic_range"


def dynamic_range(x: torch.Tensor) -> torch.Tensor:
    """log2 of max |x| over the smallest nonzero |x|."""
    magnitudes = x.abs().float()
    return torch.log2(magnitudes.max()) - torch.log2(magnitudes[magnitudes > 0].min())


def max_blockwise_dynamic_range(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """The largest dynamic range of ``block_size`` consecutive elements of a row (dims 1)."""
    blocks = x.reshape(-1, block_size)
    return torch.stack([dynamic_range(block) for block in blocks]).max()


NAMED = {
    "min": torch.min,
    "max": torch.max,
    "mean": torch.mean,
    "std": torch.std,
    "l1_norm": lambda x: torch.norm(x, p=1),
    "l2_norm": lambda x: torch.norm(x, p=2),
    "cur_amax": lambda x: x.abs().max(),
    "dynamic_range": dynamic_range,
}


def value_of(stat: str | dict, x: torch.Tensor) -> tuple[str, torch.Tensor]:
    """The logged name of ``stat`` and its value on ``x``."""
    if isinstance(stat, dict):
        options = stat[BLOCKWISE]
        size, dims = options.get("block_size", 32), options.get("dims", 1)
        return f"{BLOCKWISE}_block_size_{size}_dims_{dims}", max_blockwise_dynamic_range(x, size)
    return stat, NAMED[stat](x)


@Registry.register_feature(namespace="transformer_engine")
class LogExtraStats(BaseLogTensorStats):
    """Logs the base statistics, cur_amax, dynamic_range and the blockwise dynamic range of a tensor."""

    def _get_supported_stats_list(self) -> set[str]:
        return BaseLogTensorStats._get_supported_stats_list(None) | {"cur_amax", "dynamic_range"}

    def _is_supported_stat(self, stat: str | dict) -> bool:
        if isinstance(stat, dict):
            name = next(iter(stat))
            options = stat[name]
            if name != BLOCKWISE or not isinstance(options, dict) or set(options) - {"block_size", "dims"}:
                return False
            size, dims = options.get("block_size", 32), options.get("dims", 1)
            return isinstance(size, int) and size > 0 and dims == 1
        return stat in self._get_supported_stats_list()

    @api_method
    def inspect_tensor_enabled(self, config: dict, layer_name: str, tensor_name: str, iteration: int) -> tuple[bool, int | None]:
        return te_stats.scheduled(config, iteration)

    @api_method
    def inspect_tensor(
        self,
        config: dict,
        layer_name: str,
        tensor_name: str,
        iteration: int,
        tp_group: Any,
        tensor: torch.Tensor,
        rowwise_quantized_tensor: Any = None,
        columnwise_quantized_tensor: Any = None,
        quantizer: Any = None,
        tp_size: int = 1,
    ) -> None:
        if not te_stats.scheduled(config, iteration)[0]:
            return
        for stat in config["stats"]:
            assert self._is_supported_stat(stat), f"statistic {stat} is not supported"
            name, value = value_of(stat, tensor)
            te_stats.record(layer_name, tensor_name, name, value, iteration)
