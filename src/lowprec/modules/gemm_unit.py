"""What one linear transformation of a layer needs to run in FP8 and be debugged.

A ``GemmUnit`` belongs to one debug layer name (a ``Linear``, or ``fc1`` of a ``LayerNormMLP``). It
keeps the layer's quantizers for the active recipe (delayed scaling needs their amax history) and its
routing state, and picks the path of each forward: ``torch.nn.functional.linear`` when neither FP8
nor a debug feature is on, otherwise ``LinearFunction`` with plain or debug processing.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from lowprec.autocast import active_recipe
from lowprec.debug.layer_state import DebugLayerState
from lowprec.debug.quantizer import DebugProcessing
from lowprec.modules.linear_function import LinearFunction, PlainProcessing
from lowprec.quantization import CurrentScalingQuantizer, DelayedScalingQuantizer, Quantizer
from lowprec.recipe import DelayedScaling, Recipe
from lowprec.weight_cache import WeightCache


def make_quantizers(recipe: Recipe) -> dict[str, Quantizer]:
    """One quantizer per input tensor: the forward format for activation and weight, the backward
    format for the gradient."""
    fmt = recipe.fp8_format
    formats = {"activation": fmt.forward, "weight": fmt.forward, "gradient": fmt.backward}
    if isinstance(recipe, DelayedScaling):
        return {name: DelayedScalingQuantizer(f, recipe) for name, f in formats.items()}
    return {name: CurrentScalingQuantizer(f) for name, f in formats.items()}


class GemmUnit:
    """Quantizers, routing state and the forward of one debuggable linear transformation."""

    def __init__(self, layer_types: tuple[str, ...]):
        self.layer_types = layer_types
        self.tp_group: Any = None  # set by NamedModule.set_tensor_parallel_group
        self.debug = DebugLayerState()
        self._recipe: Recipe | None = None
        self._quantizers: dict[str, Quantizer] = {}
        self.weight_cache = WeightCache()

    def quantizers(self, recipe: Recipe | None) -> dict[str, Quantizer]:
        if recipe is None:
            return {}
        if recipe != self._recipe:
            self._recipe = recipe
            self._quantizers = make_quantizers(recipe)
        return self._quantizers

    def linear(self, layer_name: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        recipe = active_recipe()
        plan = self.debug.plan_for(layer_name, recipe is not None, self.layer_types)
        if recipe is None and plan is None:
            return F.linear(x, weight, bias)
        quantizers = self.quantizers(recipe)
        if plan is not None:
            processing = DebugProcessing(layer_name, quantizers, plan, self.tp_group)
        else:
            processing = PlainProcessing(quantizers, self.weight_cache)
        return LinearFunction.apply(x, weight, bias, processing)
