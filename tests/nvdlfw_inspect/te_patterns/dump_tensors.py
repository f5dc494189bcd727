"""A feature writing files below the session's log directory, found through ``get_logger().root_log_dir``
as Transformer Engine's ``DumpTensors`` finds it; its docstring gets the mapper's through
``append_parent_docstring(parent=...)`` as TE's ``FakeQuant`` does."""

from __future__ import annotations

import os
from typing import Any

import te_stats
import torch
from te_api import PatternsConfigAPIMapper

from nvdlfw_inspect.logging import get_logger
from nvdlfw_inspect.registry import Registry, api_method
from nvdlfw_inspect.utils import append_parent_docstring


def dump_path(root_log_dir: str, layer_name: str, tensor_name: str, iteration: int) -> str:
    return os.path.join(root_log_dir, "tensor_dumps", "rank_0", f"iter_{iteration:06d}", f"{layer_name}_{tensor_name}.pt")


@Registry.register_feature(namespace="transformer_engine")
@append_parent_docstring(parent=PatternsConfigAPIMapper)
class DumpTensors(PatternsConfigAPIMapper):
    """Saves the high-precision tensor (``high_precision_tensor: True``) of each selected call."""

    @api_method
    def inspect_tensor_enabled(self, config: dict, layer_name: str, tensor_name: str, iteration: int) -> tuple[bool, int | None]:
        return te_stats.scheduled(config, iteration)

    @api_method
    def inspect_tensor(
        self, config: dict, layer_name: str, tensor_name: str, iteration: int, tp_group: Any, tensor: torch.Tensor, **kwargs: Any
    ) -> None:
        if not config.get("high_precision_tensor", False):
            return
        path = dump_path(get_logger().root_log_dir, layer_name, tensor_name, iteration)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save({"high_precision": tensor.detach().clone()}, path)
