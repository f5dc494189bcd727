"""A user-written feature for the ``transformer_engine`` namespace: try a number format that has no
hardware yet by rounding chosen GEMM operands to ``mantissa_bits`` bits of mantissa (fp32 exponent range).

Config (next to the built-in features; pass this directory in ``feature_dirs``):

    try_a_narrow_format:
      enabled: True
      layers: {layer_types: [fc1]}
      transformer_engine:
        UserProvidedPrecision:
          enabled: True
          mantissa_bits: 4
          gemms: [fprop, wgrad]
          tensors: [activation, weight]
"""

from __future__ import annotations

import torch

import nvdlfw_inspect.api as debug_api
from lowprec.debug.features.api import ModifiesSelectedTensors
from nvdlfw_inspect.errors import ConfigLocation
from nvdlfw_inspect.registry import Registry, api_method


def round_mantissa(tensor: torch.Tensor, mantissa_bits: int) -> torch.Tensor:
    """Round to nearest (ties to even) keeping ``mantissa_bits`` explicit mantissa bits; 7 gives bfloat16."""
    drop = 23 - mantissa_bits
    if drop == 0:
        return tensor
    bits = tensor.float().contiguous().view(torch.int32)
    lsb = (bits >> drop) & 1
    rounded = (bits + lsb + ((1 << (drop - 1)) - 1)) & ~((1 << drop) - 1)
    return rounded.view(torch.float32).to(tensor.dtype)


@Registry.register_feature(namespace="transformer_engine")
class UserProvidedPrecision(ModifiesSelectedTensors):
    """Rounds the selected operands to ``mantissa_bits`` (1 to 23) and runs their GEMMs in high precision."""

    option_keys = frozenset({"mantissa_bits"})
    allowed_tensors = ("activation", "weight", "gradient")

    def validate_options(self, view: dict, location: ConfigLocation) -> None:
        bits = view.get("mantissa_bits")
        if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 23:
            raise location.child("mantissa_bits").error("must be an integer from 1 to 23", bits)

    @api_method
    def fp8_gemm_enabled(self, config, layer_name, gemm, iteration):
        return False, iteration + 1

    @api_method
    def modify_tensor(self, config, layer_name, gemm, tensor_name, tensor, iteration, dtype=None, **kwargs):
        debug_api.log_message(
            f"UserProvidedPrecision: {tensor_name} of {gemm} rounded to {config['mantissa_bits']} mantissa bits",
            layer_name,
            extra_cachable_args=(gemm, tensor_name),
        )
        return round_mantissa(tensor, config["mantissa_bits"])
