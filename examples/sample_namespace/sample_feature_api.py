"""The ``sample_namespace`` of seed 000: a namespace whose one API, ``process_tensor``, sees a GEMM's tensors.

Calls look like ``debug_api.sample_namespace.process_tensor(layer_name, tensor_name="tensor1", tensor=t,
[gemm="gemm1"])`` and return ``{"tensor": t_or_processed}``. ``gemm`` is optional: a call without it
is matched on the tensor alone, by configs that select no GEMM. A layer or tensor no
feature is configured for gets the tensor back unchanged from ``SampleDefaultFeatures``.
"""

from __future__ import annotations

import copy
from typing import Any

from nvdlfw_inspect.base import BaseConfigAPIMapper, BaseNamespaceAPI
from nvdlfw_inspect.debug_features.generic_feature_api import tensor_views
from nvdlfw_inspect.errors import ConfigLocation
from nvdlfw_inspect.registry import Registry


class SampleConfigAPIMapper(BaseConfigAPIMapper):
    """Selects GEMMs and their tensors, in either shape:

    tensors: [tensor1]              # tensors only: any GEMM, or calls that name none
    gemms: [gemm1]                  # the same tensors and options for every listed GEMM
    tensors: [tensor1]
    gemms_struct:                   # per-GEMM tensors and options
      - gemm: gemm1
        tensors: [tensor1]          # or tensors_struct: [{tensor: tensor1, ...}]
    """

    gemm_and_tensor_config_docstring = __doc__

    def parse_config_and_api(self, config: dict, **kwargs: Any) -> tuple[bool, dict | None]:
        if not (kwargs.get("gemm_parsing") and kwargs.get("tensor_parsing")):
            return False, None
        processed = self._process_gemm_config(copy.deepcopy(config), kwargs.get("gemm"))
        if processed is None:
            return False, None
        processed = self._process_tensor_config(processed, kwargs["tensor_name"])
        if processed is None:
            return False, None
        processed.pop("enabled", None)
        return True, processed

    def validate_config(self, config: dict, location: ConfigLocation) -> None:
        """Check the GEMM and tensor selection at ``initialize``."""
        if "gemms_struct" in config:
            items = config["gemms_struct"]
            where = location.child("gemms_struct")
            if not isinstance(items, list) or not items:
                raise where.error("must be a non-empty list of mappings, each with a 'gemm' key", items)
            for i, item in enumerate(items):
                if not isinstance(item, dict) or not isinstance(item.get("gemm"), str):
                    raise where.child(i).error("each item must be a mapping with a string 'gemm' key", item)
                tensor_views({**config, **item}, where.child(i))
            return
        if "gemms" in config:
            gemms = config["gemms"]
            if not isinstance(gemms, list) or not gemms or not all(isinstance(g, str) for g in gemms):
                raise location.child("gemms").error("must be a non-empty list of GEMM names", gemms)
        tensor_views(config, location)

    def _process_gemm_config(self, cfg: dict, gemm: str | None) -> dict | None:
        """Resolve ``gemms``/``gemms_struct`` for one GEMM; a matched item's keys override the feature's."""
        if "gemms" not in cfg and "gemms_struct" not in cfg:
            return cfg
        if gemm is None:
            return None
        if "gemms_struct" in cfg:
            for item in cfg.pop("gemms_struct"):
                if item.get("gemm") == gemm:
                    cfg.update(copy.deepcopy(item))
                    return cfg
            return None
        if gemm not in cfg.pop("gemms"):
            return None
        cfg["gemm"] = gemm
        return cfg


class SampleDefaultFeatures:
    """What ``sample_namespace`` answers when no feature is configured: the tensor, untouched."""

    def process_tensor(self, config: dict, layer_name: str, **kwargs: Any) -> dict:
        return {"tensor": kwargs["tensor"]}


@Registry.register_namespace_api(namespace="sample_namespace")
class SampleFrameworkAPI(BaseNamespaceAPI):
    """Router of ``sample_namespace``: one feature per call, results must carry a ``tensor``."""

    def __init__(self) -> None:
        super().__init__()
        self._default_api_impl = SampleDefaultFeatures()
        self._cacheable_api_kwargs_map = {"process_tensor": ["tensor_name", "gemm"]}

    def input_assertions_hook(self, api_name: str, **kwargs: Any) -> None:
        if api_name == "process_tensor":
            missing = [key for key in ("tensor", "tensor_name") if key not in kwargs]
            if missing:
                raise TypeError(f"sample_namespace.process_tensor needs the keyword arguments {missing}")

    def call_feature(self, call: Any, feat_config: dict, layer_name: str, **kwargs: Any) -> Any:
        """Features read ``kwargs['gemm']`` (seed 000's FakeQuant does); a call without one passes None."""
        kwargs.setdefault("gemm", None)
        return call(feat_config, layer_name, **kwargs)

    def routing_condition(
        self, api_name: str, config: dict, layer_name: str, feature_obj: Any, **kwargs: Any
    ) -> tuple[bool, dict | None]:
        return feature_obj.parse_config_and_api(config, gemm_parsing=True, tensor_parsing=True, **kwargs)

    def output_assertions_hook(self, api_name: str, ret: Any, **kwargs: Any) -> None:
        if api_name == "process_tensor" and not (isinstance(ret, dict) and "tensor" in ret):
            raise TypeError(f"sample_namespace.process_tensor must return a dict with the key 'tensor', got {ret!r}")

    def is_multiple_feature_invocation_allowed(self, api_name: str) -> bool:
        return False
