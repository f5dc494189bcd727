"""``LogTensorStats`` of the ``transformer_engine`` namespace: statistics of a layer's GEMM tensors.

Statistics accumulate over the micro-batches of a step (weights count once per step) and are
reduced and logged by ``debug_api.step()`` as ``{layer}_{tensor}_{stat}``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

import nvdlfw_inspect.api as debug_api
from lowprec.debug.features.api import EveryIteration, TEConfigAPIMapper
from lowprec.debug.schedule import every_iteration_from, next_enabled_iter
from lowprec.quant.protocol import QuantizedTensor
from nvdlfw_inspect.debug_features.generic_feature_api import PerConfig
from nvdlfw_inspect.debug_features.log_tensor_stats import WINDOW_KEYS, stats_list, validate_window, window_key
from nvdlfw_inspect.errors import ConfigLocation, ErrorCollector, is_int
from nvdlfw_inspect.registry import Registry, api_method
from nvdlfw_inspect.stats import zeros
from nvdlfw_inspect.stats.blockwise import max_blockwise_dynamic_range
from nvdlfw_inspect.stats.buffers import STATS_BUFFERS
from nvdlfw_inspect.stats.catalog import BASE_STATS, EARLY_STATS
from nvdlfw_inspect.stats.fields import empty_partials, set_fields
from nvdlfw_inspect.stats.zeros import ZerosStat

T = TypeVar("T")
STATS = (*BASE_STATS, *EARLY_STATS)
BLOCKWISE = "max_blockwise_dynamic_range"
BLOCKWISE_KEYS = {"block_size": "a positive integer (default 32)", "dims": "1 or 2 (default 1)"}


def schedule(config: dict, iteration: int) -> tuple[bool, int | None]:
    """The feature's window keys applied at ``iteration`` (see ``next_enabled_iter``); an ``EveryIteration`` when
    they run at every iteration from this one on."""
    window = (config.get("start_step"), config.get("end_step"), config.get("start_end_list"), config.get("freq", 1))
    if every_iteration_from(*window, iteration):
        return EveryIteration(iteration)
    return next_enabled_iter(*window, iteration)


def stats_reduction(tensor_name: str, tp_group: Any, tp_size: int) -> dict[str, Any]:
    """Where a tensor's statistics are reduced: weights over the layer's tensor-parallel group (per rank
    when it has none) and once per step; every other tensor over the reduction group, accumulated."""
    if tensor_name != "weight":
        return {"reduction_group": debug_api.get_tensor_reduction_group(), "accumulate": True}
    sharded = tp_group is not None and tp_size > 1
    return {"reduction_group": tp_group, "skip_reduction": not sharded, "accumulate": False}


@dataclass(frozen=True)
class BlockwiseRange:
    """``{max_blockwise_dynamic_range: {block_size: b, dims: d}}`` in a ``stats`` list."""

    block_size: int = 32
    dims: int = 1

    def logged_name(self, both_orientations: bool) -> str:
        name = f"{BLOCKWISE}_block_size_{self.block_size}_dims_{self.dims}"
        return name + "_max_over_orientations" if both_orientations else name


def parse_stat(entry: Any, location: ConfigLocation) -> str | BlockwiseRange | ZerosStat:
    """A ``stats`` entry: a statistic name (any case), one of the ``num_zeros`` family or the blockwise mapping;
    anything else raises."""
    allowed = [*STATS, *zeros.FORMS, f"{{{BLOCKWISE}: {{block_size: int, dims: 1|2}}}}"]
    if isinstance(entry, str) and entry.lower() in STATS:
        return entry.lower()
    if isinstance(entry, str):
        try:
            family = zeros.parse_zeros(entry.lower())
        except ValueError as error:
            raise location.error(f"unsupported statistic: {error}", entry, allowed) from None
        if family is not None:
            return family
    if not (isinstance(entry, dict) and list(entry) == [BLOCKWISE]):
        raise location.error("unsupported statistic", entry, allowed)
    options = entry[BLOCKWISE] or {}
    if not isinstance(options, dict):
        raise location.child(BLOCKWISE).error("must be a mapping of block_size and dims", options)
    for key, value in options.items():
        if key not in BLOCKWISE_KEYS:
            raise location.child(BLOCKWISE).child(key).error("unknown option", key, list(BLOCKWISE_KEYS))
        valid = is_int(value) and (value > 0 if key == "block_size" else value in (1, 2))
        if not valid:
            raise location.child(BLOCKWISE).child(key).error(f"must be {BLOCKWISE_KEYS[key]}", value)
    return BlockwiseRange(**options)


def parse_stats(config: dict, location: ConfigLocation) -> list[str | BlockwiseRange]:
    stats = stats_list(config, location, list(STATS))
    return parse_each(stats, location.child("stats"), parse_stat)


def parse_each(entries: list, location: ConfigLocation, parse: Callable[[Any, ConfigLocation], T]) -> list[T]:
    """``parse`` of every entry of a ``stats`` list, raising the errors of all the bad ones together."""
    collector = ErrorCollector()
    parsed = []
    for i, entry in enumerate(entries):
        with collector.check():
            parsed.append(parse(entry, location.child(i)))
    collector.raise_errors()
    return parsed


class ScheduledStats(TEConfigAPIMapper):
    """What the statistics features share: tensor selection, ``stats`` and the window keys, validated
    at ``initialize``, and ``inspect_tensor_enabled`` answering with the schedule."""

    uses_gemms = False
    option_keys = frozenset({"stats"}) | WINDOW_KEYS

    def __init__(self) -> None:
        super().__init__()
        self._parsed = PerConfig()
        self._announced: set[tuple[str, str, str]] = set()  # (layer, tensor, API) noted in the debug log
        self._request_parts = PerConfig()

    def parse_stats(self, config: dict, location: ConfigLocation) -> list:
        raise NotImplementedError

    def parsed_stats(self, config: dict) -> list:
        """``parse_stats`` of a config the router hands over again and again, parsed once."""
        return self._parsed.get(config, lambda config: self.parse_stats(config, ConfigLocation("config")))

    def validate_options(self, view: dict, location: ConfigLocation) -> None:
        collector = ErrorCollector()
        with collector.check():
            self.parse_stats(view, location)
        with collector.check():
            validate_window(view, location, closed=True)
        collector.raise_errors()

    @api_method
    def inspect_tensor_enabled(self, config: dict, layer_name: str, tensor_name: str, iteration: int) -> tuple[bool, int | None]:
        return schedule(config, iteration)

    def due(self, config: dict, layer_name: str, tensor_name: str, iteration: int, api: str = "inspect_tensor") -> bool:
        """Whether this feature's own schedule is due (another feature may have asked for the inspection);
        if so, the call is noted once per layer and tensor in the debug log."""
        if not schedule(config, iteration)[0]:
            return False
        if (layer_name, tensor_name, api) not in self._announced:  # checked here: this runs for every inspected tensor
            self._announced.add((layer_name, tensor_name, api))
            message = f"Feature={type(self).__name__}, API={api}: {tensor_name}"
            debug_api.log_message(message, layer_name, extra_cachable_args=(tensor_name,))
        return True


@Registry.register_feature(namespace="transformer_engine")
class LogTensorStats(ScheduledStats):
    """Logs statistics of high-precision tensors of the selected layers.

    Keys: ``tensors``/``tensors_struct`` (activation, gradient, weight, output, wgrad, dgrad), ``stats``
    (min, max, mean, std, l1_norm, l2_norm, cur_amax, dynamic_range, kurtosis, rms, outlier_channel_ratio,
    max_channel, the ``num_zeros`` family (``num_zeros``,
    ``num_zeros%``, ``num_zeros[1e-10]``, ``num_zeros[1e-10]%``: values of magnitude at most the threshold, 0 when
    none is given), and
    ``{max_blockwise_dynamic_range: {block_size: 32, dims: 1}}``), ``freq`` (default 1),
    ``start_step``, ``end_step`` and ``start_end_list`` (closed windows ``[start, end]``; -1: no end).
    Weights are reduced over the layer's tensor-parallel group (``set_tensor_parallel_group``).
    """

    parse_stats = staticmethod(parse_stats)

    def _requests(self, config: dict) -> tuple[tuple[str, ...], list[BlockwiseRange], list[ZerosStat], tuple]:
        """The config's plain statistics, its blockwise ones, those of the ``num_zeros`` family and its window key,
        worked out once per config."""

        def parts(config: dict) -> tuple[tuple[str, ...], list[BlockwiseRange], list[ZerosStat], tuple]:
            stats = self.parsed_stats(config)
            plain = tuple(stat for stat in stats if isinstance(stat, str))
            blockwise = [stat for stat in stats if isinstance(stat, BlockwiseRange)]
            return plain, blockwise, [stat for stat in stats if isinstance(stat, ZerosStat)], window_key(config)

        return self._request_parts.get(config, parts)

    @api_method
    def inspect_tensor(
        self, config: dict, layer_name: str, tensor_name: str, tensor: torch.Tensor | None, iteration: int, **kwargs: Any
    ) -> None:
        if not self.due(config, layer_name, tensor_name, iteration, api="look_at_tensor_before_process"):
            return
        if tensor is None or isinstance(tensor, QuantizedTensor):
            debug_api.log_message(
                f"LogTensorStats needs the high-precision {tensor_name}; none was given, nothing is logged",
                layer_name,
                level=logging.WARNING,
            )
            return
        plain, blockwise, zeros_stats, window = self._requests(config)
        reduction = stats_reduction(tensor_name, kwargs.get("tp_group"), kwargs.get("tp_size", 1))
        if plain:
            key = (layer_name, tensor_name, "LogTensorStats", plain, window)
            STATS_BUFFERS.feed(
                key, layer_name=layer_name, tensor_name=tensor_name, stats=plain, iteration=iteration, tensor=tensor, **reduction
            )
        if zeros_stats:
            key = (layer_name, tensor_name, "LogTensorStats", window)
            zeros.feed_zeros(
                zeros_stats, key, tensor, layer_name=layer_name, tensor_name=tensor_name, iteration=iteration, **reduction
            )
        both = tensor_name in ("activation", "weight")  # these are read row- and columnwise by the GEMMs
        for stat in blockwise if tensor.numel() > 0 else ():
            value = max_blockwise_dynamic_range(tensor, stat.block_size, stat.dims, both)
            partials = set_fields(empty_partials(tensor.device), {"count": tensor.numel(), "blockwise_dr": value})
            STATS_BUFFERS.feed(
                (layer_name, tensor_name, "LogTensorStats", stat, window),
                layer_name=layer_name,
                tensor_name=tensor_name,
                stats=[(stat.logged_name(both), BLOCKWISE)],
                iteration=iteration,
                partials=partials,
                **reduction,
            )
