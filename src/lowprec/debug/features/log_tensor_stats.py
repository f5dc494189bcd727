"""``LogTensorStats`` of the ``transformer_engine`` namespace: statistics of a layer's GEMM tensors.

Statistics accumulate over the micro-batches of a step (weights count once per step) and are
reduced and logged by ``debug_api.step()`` as ``{layer}_{tensor}_{stat}``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

import nvdlfw_inspect.api as debug_api
from lowprec.debug.features.api import TEConfigAPIMapper
from lowprec.debug.schedule import next_enabled_iter
from lowprec.quantization import Float8Tensor
from nvdlfw_inspect.debug_features.log_tensor_stats import WINDOW_KEYS, validate_stats, validate_window
from nvdlfw_inspect.errors import ConfigLocation
from nvdlfw_inspect.registry import Registry, api_method
from nvdlfw_inspect.stats.buffers import STATS_BUFFERS

STATS = ("min", "max", "mean", "std", "l1_norm", "l2_norm", "cur_amax", "dynamic_range")


def schedule(config: dict, iteration: int) -> tuple[bool, int | None]:
    """The feature's window keys applied at ``iteration`` (see ``next_enabled_iter``)."""
    return next_enabled_iter(
        config.get("start_step"), config.get("end_step"), config.get("start_end_list"), config.get("freq", 1), iteration
    )


def window_key(config: dict) -> tuple:
    """The window keys as a hashable value: requests with different windows get different buffers."""
    pairs = tuple(tuple(pair) for pair in config.get("start_end_list") or ())
    return config.get("start_step"), config.get("end_step"), pairs, config.get("freq", 1)


@Registry.register_feature(namespace="transformer_engine")
class LogTensorStats(TEConfigAPIMapper):
    """Logs statistics of high-precision tensors of the selected layers.

    Keys: ``tensors``/``tensors_struct`` (activation, gradient, weight, output, wgrad, dgrad), ``stats``
    (min, max, mean, std, l1_norm, l2_norm, cur_amax, dynamic_range), ``freq`` (default 1),
    ``start_step``, ``end_step`` and ``start_end_list`` (closed windows ``[start, end]``; -1: no end).
    """

    uses_gemms = False
    option_keys = frozenset({"stats"}) | WINDOW_KEYS

    def validate_options(self, view: dict, location: ConfigLocation) -> None:
        validate_stats(view, location, list(STATS))
        validate_window(view, location, closed=True)

    @api_method
    def inspect_tensor_enabled(self, config: dict, layer_name: str, tensor_name: str, iteration: int) -> tuple[bool, int | None]:
        return schedule(config, iteration)

    @api_method
    def inspect_tensor(
        self, config: dict, layer_name: str, tensor_name: str, tensor: torch.Tensor | None, iteration: int, **kwargs: Any
    ) -> None:
        if not schedule(config, iteration)[0]:
            return  # another feature asked for this inspection, not this one
        debug_api.log_message(
            f"Feature=LogTensorStats, API=look_at_tensor_before_process: {tensor_name}",
            layer_name,
            extra_cachable_args=(tensor_name,),
        )
        if tensor is None or isinstance(tensor, Float8Tensor):
            debug_api.log_message(
                f"LogTensorStats needs the high-precision {tensor_name}; none was given, nothing is logged",
                layer_name,
                level=logging.WARNING,
            )
            return
        weight = tensor_name == "weight"
        STATS_BUFFERS.feed(
            (layer_name, tensor_name, "LogTensorStats", window_key(config)),
            layer_name=layer_name,
            tensor_name=tensor_name,
            tensor=tensor,
            stats=list(config["stats"]),
            iteration=iteration,
            accumulate=not weight,
            reduction_group=None if weight else debug_api.get_tensor_reduction_group(),
            skip_reduction=weight,
        )
