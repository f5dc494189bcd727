"""A ``transformer_engine`` namespace written the way Transformer Engine writes its own (its
``debug/features/api.py``): the API class sets ``_default_api_impl`` and ``_cacheable_api_kwargs_map`` in
``__init__``, filters kwargs in ``call_feature`` by the called method's ``__code__``, combines routing answers
in ``handle_multi_feature_output`` (else ``super()``), and flushes its own statistics in ``step``."""

from __future__ import annotations

import copy
from typing import Any

import te_stats

from nvdlfw_inspect.base import BaseConfigAPIMapper, BaseNamespaceAPI
from nvdlfw_inspect.registry import Registry

#: the hooks the framework called on the namespace API, for the tests to read
EVENTS: list[str] = []
#: kwargs a feature method may lack; ``call_feature`` drops them for older signatures
OPTIONAL_KWARGS = ("quantizer", "rowwise_quantized_tensor", "columnwise_quantized_tensor", "tp_size")
REQUIRED = {
    "fp8_gemm_enabled": ("gemm",),
    "inspect_tensor": ("tensor_name",),
    "inspect_tensor_enabled": ("tensor_name",),
    "inspect_tensor_postquantize": ("tensor_name",),
    "inspect_tensor_postquantize_enabled": ("tensor_name",),
}


class PatternsConfigAPIMapper(BaseConfigAPIMapper):
    """Tensor selection: ``tensors: [names]`` or ``tensors_struct: [{tensor: name, <options>}]``."""

    def parse_config_and_api(self, config: dict, **kwargs: Any) -> tuple[bool, dict | None]:
        processed = None
        if kwargs.get("tensor_parsing"):
            processed = self._process_tensor_config(copy.deepcopy(config), kwargs["tensor_name"])
        if not processed:
            return False, None
        processed.pop("enabled", None)
        return True, processed


class PatternsDefaults:
    """The answers when no feature serves a call: quantize as the recipe says, inspect nothing."""

    def fp8_gemm_enabled(self, config: dict, layer_name: str, gemm: str, iteration: int) -> tuple[bool, None]:
        return True, None

    def modify_tensor_enabled(self, config: dict, layer_name: str, **kwargs: Any) -> tuple[bool, None]:
        return False, None

    def inspect_tensor_enabled(self, config: dict, layer_name: str, tensor_name: str, iteration: int) -> tuple[bool, None]:
        return False, None

    def inspect_tensor_postquantize_enabled(self, config: dict, layer_name: str, **kwargs: Any) -> tuple[bool, None]:
        return False, None

    def inspect_tensor(self, config: dict, layer_name: str, tensor_name: str, **kwargs: Any) -> None:
        return None

    def inspect_tensor_postquantize(self, config: dict, layer_name: str, tensor_name: str, **kwargs: Any) -> None:
        return None


@Registry.register_namespace_api(namespace="transformer_engine")
class PatternsAPI(BaseNamespaceAPI):
    """Routes ``debug_api.transformer_engine.<call>`` to the features of this directory."""

    def __init__(self) -> None:
        BaseNamespaceAPI.__init__(self)
        self._default_api_impl = PatternsDefaults()
        self._cacheable_api_kwargs_map = {
            "inspect_tensor": ["tensor_name"],
            "inspect_tensor_enabled": ["tensor_name", "iteration"],
            "fp8_gemm_enabled": ["gemm"],
        }

    def input_assertions_hook(self, api_name: str, **kwargs: Any) -> None:
        for key in REQUIRED.get(api_name, ("tensor_name", "gemm")):
            assert key in kwargs, f"provide {key} in {api_name}"

    def routing_condition(self, api_name: str, config: dict, _: str, feature_obj: Any, **kwargs: Any) -> tuple[bool, dict | None]:
        return feature_obj.parse_config_and_api(config, tensor_parsing="tensor_name" in kwargs, **kwargs)

    def output_assertions_hook(self, api_name: str, ret: Any, **kwargs: Any) -> None:
        if "enabled" in api_name:
            assert isinstance(ret, (bool, tuple))
        if api_name == "inspect_tensor":
            assert ret is None

    def is_multiple_feature_invocation_allowed(self, api_name: str) -> bool:
        return api_name in {"inspect_tensor", "inspect_tensor_enabled", "fp8_gemm_enabled"}

    def call_feature(self, call: Any, feat_config: dict, layer_name: str, **kwargs: Any) -> Any:
        if call.__name__ == "inspect_tensor":
            kwargs = {k: v for k, v in kwargs.items() if k not in OPTIONAL_KWARGS or k in call.__code__.co_varnames}
        return call(feat_config, layer_name, **kwargs)

    def handle_multi_feature_output(
        self, api_name: str, multi_feature_outputs: list, features_to_invoke: dict, **kwargs: Any
    ) -> Any:
        if "enabled" in api_name:
            upcoming = [nxt for _, nxt in multi_feature_outputs if nxt is not None]
            return any(run for run, _ in multi_feature_outputs), min(upcoming, default=None)
        return super().handle_multi_feature_output(api_name, multi_feature_outputs, features_to_invoke, **kwargs)

    def step(self) -> None:
        EVENTS.append("step")
        te_stats.log_recorded()

    def end_debug(self) -> None:
        EVENTS.append("end_debug")
        te_stats.RECORDED.clear()
