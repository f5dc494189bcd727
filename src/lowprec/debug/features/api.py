"""The ``transformer_engine`` namespace: config grammar, default answers and routing rules.

Layers call ``debug_api.transformer_engine.<call>(layer_name=..., ...)``. Routing calls
(``*_enabled``) answer ``(enabled, next_iteration)``; a bare bool from a feature means
``(enabled, iteration + 1)``. GEMM-time calls (``modify_tensor``, ``inspect_tensor``,
``inspect_tensor_postquantize``) act on tensors.
"""

from __future__ import annotations

import copy
import functools
import inspect
from typing import Any

import torch

from lowprec.debug.names import GEMMS, TENSORS
from lowprec.errors import LowprecTypeError, LowprecValueError
from lowprec.quant.protocol import QuantizedTensor
from nvdlfw_inspect.base import BaseConfigAPIMapper, BaseNamespaceAPI
from nvdlfw_inspect.debug_features.generic_feature_api import ItemLocation, check_keys, tensor_views
from nvdlfw_inspect.errors import ConfigLocation, ErrorCollector
from nvdlfw_inspect.registry import Registry, api_method

Answer = tuple[bool, int | None]


class EveryIteration(tuple):
    """The routing answer ``(True, iteration + 1)`` of a feature that is also enabled at every later iteration of the
    session (no schedule, or every step with no end): a layer answers the question from memory from then on instead
    of asking each step. Any other reader sees the plain pair."""

    def __new__(cls, iteration: int) -> EveryIteration:
        return super().__new__(cls, (True, iteration + 1))


class TEConfigAPIMapper(BaseConfigAPIMapper):
    """Selects GEMMs and tensors:

    gemms: [fprop, dgrad]          # or gemms_struct: [{gemm: fprop, tensors: [...], <options>}]
    tensors: [activation, weight]  # or tensors_struct: [{tensor: activation, <options>}]

    GEMMs: fprop, dgrad, wgrad. Tensors: activation, weight, gradient, output, wgrad, dgrad.
    Options set in a ``*_struct`` item override the feature-level ones for that GEMM or tensor.
    """

    #: whether the feature selects GEMMs and tensors; features override these
    uses_gemms = True
    uses_tensors = True
    #: tensors this feature accepts
    allowed_tensors: tuple[str, ...] = TENSORS
    #: option keys beyond the selection keys, allowed at the feature level and in ``*_struct`` items
    option_keys: frozenset[str] = frozenset()

    # --- routing ---------------------------------------------------------------------------------
    def parse_config_and_api(self, config: dict, **kwargs: Any) -> tuple[bool, dict | None]:
        cfg = copy.deepcopy(config)
        cfg.pop("enabled", None)
        gemm_parsing, tensor_parsing = kwargs.get("gemm_parsing"), kwargs.get("tensor_parsing")
        if gemm_parsing:
            cfg = self._select_gemm(cfg, kwargs["gemm"])
            if cfg is None:
                return False, None
        if tensor_parsing:
            cfg = self._process_tensor_config(cfg, kwargs["tensor_name"])
            if cfg is None:
                return False, None
        return True, cfg

    def _select_gemm(self, cfg: dict, gemm: str) -> dict | None:
        if "gemms_struct" in cfg:
            items = cfg.pop("gemms_struct")
            for item in items:
                if item["gemm"] == gemm:
                    return merge_gemm_item(cfg, copy.deepcopy(item))
            return None
        if "gemms" in cfg:
            if gemm not in cfg.pop("gemms"):
                return None
            cfg["gemm"] = gemm
            return cfg
        raise LowprecValueError("Provide 'gemms_struct: List[Dict]' or 'gemms: List[str]' in the config yaml")

    # --- validation at initialize ----------------------------------------------------------------
    def validate_config(self, config: dict, location: ConfigLocation) -> None:
        selection = set()
        if self.uses_gemms:
            selection |= {"gemms", "gemms_struct"}
        if self.uses_tensors:
            selection |= {"tensors", "tensors_struct"}
        collector = ErrorCollector()
        with collector.check():
            check_keys(config, frozenset({"enabled"} | selection | self.option_keys), location)
        for view, where in self.resolved_views(config, location, collector):
            with collector.check():
                self.validate_options(view, where)
        collector.raise_errors()

    def resolved_views(
        self, config: dict, location: ConfigLocation, collector: ErrorCollector
    ) -> list[tuple[dict, ConfigLocation]]:
        """Every (GEMM, tensor) selection the config makes, as the options it resolves to and where they are, so
        that each is checked; errors of the selection itself (unknown GEMM or tensor) go to ``collector``."""
        gemm_views = [(config, location)]
        if self.uses_gemms:
            if "gemms_struct" in config:  # a broken list of items: their tensors cannot be checked
                gemm_views = []
            with collector.check():
                gemm_views = self._gemm_views(config, location, collector)
        if not self.uses_tensors:
            return gemm_views
        views = []
        for view, where in gemm_views:
            with collector.check():
                for tensor_view, tensor_where in tensor_views(view, where, collector):
                    with collector.check():
                        self._check_tensor_names(tensor_view, tensor_where)
                    views.append((tensor_view, tensor_where))
        return views

    def _gemm_views(self, config: dict, location: ConfigLocation, collector: ErrorCollector) -> list[tuple[dict, ConfigLocation]]:
        if "gemms_struct" in config:
            items, where = config["gemms_struct"], location.child("gemms_struct")
            if not isinstance(items, list) or not items:
                raise where.error("must be a non-empty list of mappings, each with a 'gemm' key", items)
            shared = {k: v for k, v in config.items() if k not in ("gemms_struct", "gemms", "enabled")}
            views = []
            allowed = frozenset({"gemm"} | self.option_keys | ({"tensors", "tensors_struct"} if self.uses_tensors else set()))
            for i, item in enumerate(items):
                item_loc = where.child(i)
                if not isinstance(item, dict) or "gemm" not in item:
                    collector.add(item_loc.error("each item must be a mapping with a 'gemm' key", item))
                    continue
                if item["gemm"] not in GEMMS:
                    collector.add(item_loc.child("gemm").error("unknown GEMM", item["gemm"], GEMMS))
                with collector.check():
                    check_keys(item, allowed, item_loc)
                views.append((merge_gemm_item(shared, item), ItemLocation(item_loc, location, set(item))))
            return views
        if "gemms" in config:
            gemms = config["gemms"]
            where = location.child("gemms")
            if not isinstance(gemms, list) or not gemms:
                raise where.error("must be a non-empty list of GEMM names", gemms, GEMMS)
            for i, gemm in enumerate(gemms):
                if gemm not in GEMMS:
                    collector.add(where.child(i).error("unknown GEMM", gemm, GEMMS))
            return [(config, location)]
        raise location.error("needs 'gemms: [names]' or 'gemms_struct: [{gemm: name, ...}]'", allowed=GEMMS)

    def _check_tensor_names(self, view: dict, location: ConfigLocation) -> None:
        if "tensor" in view:
            named = [(view["tensor"], location.child("tensor"))]
        elif isinstance(view["tensors"], list):
            named = [(name, location.child("tensors").child(i)) for i, name in enumerate(view["tensors"])]
        else:
            named = [(view["tensors"], location.child("tensors"))]
        collector = ErrorCollector()
        for name, where in named:
            if name not in self.allowed_tensors:
                collector.add(where.error(f"tensor not supported by {type(self).__name__}", name, self.allowed_tensors))
        collector.raise_errors()

    def validate_options(self, view: dict, location: ConfigLocation) -> None:
        """Check the options one (GEMM, tensor) resolves to; features override this."""


class ModifiesSelectedTensors(TEConfigAPIMapper):
    """Base of features that replace the selected operands through ``modify_tensor`` every iteration."""

    @api_method
    def modify_tensor_enabled(self, config: dict, layer_name: str, gemm: str, tensor_name: str, iteration: int) -> Answer:
        return True, iteration + 1


_TENSOR_KEYS = ("tensors", "tensors_struct")


def merge_gemm_item(feature_cfg: dict, item: dict) -> dict:
    """Feature-level options overridden by a ``gemms_struct`` item; the item's tensor selection, if it
    has one, replaces the feature-level one entirely."""
    own_tensors = any(key in item for key in _TENSOR_KEYS)
    merged = {k: v for k, v in feature_cfg.items() if k != "gemms_struct" and not (own_tensors and k in _TENSOR_KEYS)}
    merged.update(item)
    return merged


class TEDefaultFeatures:
    """The answers when no feature handles a call: quantize as the recipe says, inspect nothing."""

    def fp8_gemm_enabled(self, config: dict, layer_name: str, **kwargs: Any) -> Answer:
        return True, None

    def modify_tensor_enabled(self, config: dict, layer_name: str, **kwargs: Any) -> Answer:
        return False, None

    def inspect_tensor_enabled(self, config: dict, layer_name: str, **kwargs: Any) -> Answer:
        return False, None

    def inspect_tensor_postquantize_enabled(self, config: dict, layer_name: str, **kwargs: Any) -> Answer:
        return False, None

    def modify_tensor(self, config: dict, layer_name: str, **kwargs: Any) -> Any:
        raise NotImplementedError(
            "modify_tensor_enabled() returned True, modify_tensor() was invoked, but it is not handled by any API."
        )

    def inspect_tensor(self, config: dict, layer_name: str, **kwargs: Any) -> None:
        return None

    def inspect_tensor_postquantize(self, config: dict, layer_name: str, **kwargs: Any) -> None:
        return None


_REQUIRED = {
    "fp8_gemm_enabled": ("gemm",),
    "modify_tensor_enabled": ("tensor_name", "gemm"),
    "modify_tensor": ("tensor_name", "gemm"),
    "inspect_tensor": ("tensor_name",),
    "inspect_tensor_postquantize": ("tensor_name",),
    "inspect_tensor_enabled": ("tensor_name",),
    "inspect_tensor_postquantize_enabled": ("tensor_name",),
}
_MULTI_FEATURE = frozenset(
    {
        "fp8_gemm_enabled",
        "inspect_tensor",
        "inspect_tensor_postquantize",
        "inspect_tensor_enabled",
        "inspect_tensor_postquantize_enabled",
    }
)


def normalize_answer(answer: Any, iteration: int) -> Answer:
    """A routing answer as ``(enabled, next_iteration)``; a bare bool asks again next iteration."""
    if isinstance(answer, tuple):
        return bool(answer[0]), answer[1]
    return bool(answer), iteration + 1


@Registry.register_namespace_api(namespace="transformer_engine")
class TransformerEngineAPI(BaseNamespaceAPI):
    """Router of the ``transformer_engine`` namespace."""

    def __init__(self) -> None:
        super().__init__()
        self._default_api_impl = TEDefaultFeatures()
        # a call's routing depends on exactly the keyword arguments it requires
        self._cacheable_api_kwargs_map = {api_name: list(keys) for api_name, keys in _REQUIRED.items()}

    def input_assertions_hook(self, api_name: str, **kwargs: Any) -> None:
        for key in _REQUIRED.get(api_name, ("tensor_name", "gemm")):
            if key not in kwargs:
                raise LowprecTypeError(f"debug_api.transformer_engine.{api_name}() needs the keyword argument '{key}'")

    def routing_condition(
        self, api_name: str, config: dict, layer_name: str, feature_obj: Any, **kwargs: Any
    ) -> tuple[bool, dict | None]:
        required = _REQUIRED.get(api_name, ("tensor_name", "gemm"))
        return feature_obj.parse_config_and_api(
            config, gemm_parsing="gemm" in required, tensor_parsing="tensor_name" in required, **kwargs
        )

    def is_multiple_feature_invocation_allowed(self, api_name: str) -> bool:
        return api_name in _MULTI_FEATURE

    def handle_multi_feature_output(
        self, api_name: str, multi_feature_outputs: list, features_to_invoke: dict, **kwargs: Any
    ) -> Any:
        """Routing answers combine: enabled if any feature enables (for ``fp8_gemm_enabled``: FP8 only if no
        feature disables it); the next iteration is the earliest any feature names; one feature's ``EveryIteration``
        (not for ``fp8_gemm_enabled``) is the combined answer."""
        if "enabled" not in api_name:
            return super().handle_multi_feature_output(api_name, multi_feature_outputs, features_to_invoke, **kwargs)
        iteration = kwargs.get("iteration", 0)
        if api_name != "fp8_gemm_enabled" and any(isinstance(out, EveryIteration) for out in multi_feature_outputs):
            return EveryIteration(iteration)  # enabled by one feature at every iteration: by all of them together
        answers = [normalize_answer(out, iteration) for out in multi_feature_outputs]
        flags = [flag for flag, _ in answers]
        enabled = all(flags) if api_name == "fp8_gemm_enabled" else any(flags)
        upcoming = [nxt for _, nxt in answers if nxt is not None]
        return enabled, (min(upcoming) if upcoming else None)

    def output_assertions_hook(self, api_name: str, ret: Any, **kwargs: Any) -> None:
        if "enabled" in api_name:
            if not isinstance(ret, (bool, tuple)) or (isinstance(ret, tuple) and len(ret) != 2):
                raise LowprecTypeError(f"{api_name} must return a bool or (bool, next_iteration), got {ret!r}")
        elif api_name in ("inspect_tensor", "inspect_tensor_postquantize"):
            if ret is not None:
                raise LowprecTypeError(f"{api_name} must return None, got {type(ret).__name__}")
        elif api_name == "modify_tensor":
            if kwargs.get("out") is not None:
                if ret is not None:
                    raise LowprecTypeError("modify_tensor must return None when it is given out= (it updates out in place)")
                return
            if not isinstance(ret, (torch.Tensor, QuantizedTensor)):
                raise LowprecTypeError(
                    f"modify_tensor must return a torch.Tensor or a lowprec quantized tensor (Float8Tensor, BlockScaledTensor), "
                    f"got {type(ret).__name__}"
                )
            dtype = kwargs.get("dtype")
            if dtype is not None and isinstance(ret, torch.Tensor) and ret.dtype != dtype:
                raise LowprecTypeError(f"modify_tensor returned a {ret.dtype} tensor where {dtype} was asked for")

    def call_feature(self, call: Any, feat_config: dict, layer_name: str, **kwargs: Any) -> Any:
        """Pass a feature method only the keyword arguments it accepts, so older signatures keep working."""
        accepted = _accepted_kwargs(call)
        if accepted is not None and not kwargs.keys() <= accepted:
            kwargs = {k: v for k, v in kwargs.items() if k in accepted}
        return call(feat_config, layer_name, **kwargs)


@functools.cache
def _accepted_kwargs_of(func: Any) -> frozenset[str] | None:
    params = inspect.signature(func).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return frozenset(p.name for p in params)


def _accepted_kwargs(call: Any) -> frozenset[str] | None:
    func = getattr(call, "__func__", call)
    return _accepted_kwargs_of(func)
