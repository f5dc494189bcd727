"""Features that keep chosen GEMMs, or every GEMM of a layer, in high precision under FP8 autocast.

Each comes under three names: the current one, the reference's older one, and the seeds' spelling.
"""

from __future__ import annotations

from typing import Any

import nvdlfw_inspect.api as debug_api
from lowprec.debug.features.api import TEConfigAPIMapper
from nvdlfw_inspect.errors import ConfigLocation, ErrorCollector
from nvdlfw_inspect.registry import Registry, api_method


@Registry.register_feature(namespace="transformer_engine")
class DisableQuantizationGEMM(TEConfigAPIMapper):
    """Runs the listed GEMMs (``gemms`` or ``gemms_struct``: fprop, dgrad, wgrad) in high precision;
    both operands of each stay unquantized."""

    uses_tensors = False

    @api_method
    def fp8_gemm_enabled(self, config: dict, layer_name: str, gemm: str, iteration: int) -> tuple[bool, int]:
        return False, iteration + 1


@Registry.register_feature(namespace="transformer_engine")
class DisableFP8GEMM(DisableQuantizationGEMM):
    """The reference's older name of ``DisableQuantizationGEMM``."""


@Registry.register_feature(namespace="transformer_engine")
class DisableFp8Gemm(DisableQuantizationGEMM):
    """The seeds' spelling of ``DisableQuantizationGEMM``."""


@Registry.register_feature(namespace="transformer_engine")
class DisableQuantizationLayer(TEConfigAPIMapper):
    """Runs every GEMM of the selected layers in high precision. Its only key is ``enabled``."""

    def parse_config_and_api(self, config: dict, **kwargs: Any) -> tuple[bool, dict | None]:
        return True, {}

    def validate_config(self, config: dict, location: ConfigLocation) -> None:
        collector = ErrorCollector()
        for key in config:
            if key != "enabled":
                collector.add(location.child(key).error(f"{type(self).__name__} takes no keys besides 'enabled'", key))
        collector.raise_errors()

    @api_method
    def fp8_gemm_enabled(self, config: dict, layer_name: str, gemm: str, iteration: int) -> tuple[bool, int]:
        debug_api.log_message("Quantization Disabled", layer_name)
        return False, iteration + 1


@Registry.register_feature(namespace="transformer_engine")
class DisableFP8Layer(DisableQuantizationLayer):
    """The reference's older name of ``DisableQuantizationLayer``."""


@Registry.register_feature(namespace="transformer_engine")
class DisableFp8Layer(DisableQuantizationLayer):
    """The seeds' spelling of ``DisableQuantizationLayer``."""
