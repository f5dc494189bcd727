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

import nvdlfw_inspect.api as debug_api
from lowprec.autocast import active_recipe
from lowprec.debug.layer_state import DebugLayerState
from lowprec.debug.names import BACKWARD_TENSORS, TENSORS
from lowprec.debug.quantizer import DebugProcessing
from lowprec.modules.linear_function import LinearFunction, PlainProcessing, Processing
from lowprec.modules.recompute import (
    CastRecorder,
    ForwardHistory,
    ReentrantForwards,
    Replay,
    check_not_in_reentrant_checkpoint,
    in_backward,
    in_reentrant_recomputation,
    reentrant_checkpoint,
    refuse_backpropagation,
    replay_quantizers,
)
from lowprec.quant.protocol import Quantizer
from lowprec.quant.weight_cache import WeightCache
from lowprec.recipe import BLOCK_RECIPES, DelayedScaling, Recipe


@torch._disable_dynamo  # torch.compiler.disable, but importing torch._dynamo (1.3 s) only when first called
def run_eagerly(function: Any, *args: Any) -> Any:
    """A graph break under ``torch.compile``: what the compiler cannot trace runs as in eager mode.
    Debug features (host-side routing, logging), delayed scaling (its amax history is state that the
    autograd function would have to update from inside a graph) and the block recipes (emulated, some
    with a stochastic-rounding stream that advances on the host) take this path."""
    return function(*args)


def runs_eagerly(recipe: Recipe | None) -> bool:
    """Whether a layer under ``recipe`` breaks a ``torch.compile`` graph (see ``run_eagerly``)."""
    return isinstance(recipe, (DelayedScaling, *BLOCK_RECIPES))


class GemmUnit:
    """Quantizers, routing state and the forward of one debuggable linear transformation."""

    #: what a process holds only while it runs the layer: the weight's cast, the forwards whose backward is due, the
    #: routing memory of the debug session (which holds the session)
    _TRANSIENT = frozenset({"debug", "weight_cache", "forwards", "reentrant_forwards"})

    def __init__(self, layer_types: tuple[str, ...]):
        self.layer_types = layer_types
        self.tp_group: Any = None  # set by NamedModule.set_tensor_parallel_group
        self.debug = DebugLayerState()
        self._recipe: Recipe | None = None
        self._quantizers: dict[str, Quantizer] = {}
        self.weight_cache = WeightCache()
        self.forwards = ForwardHistory()
        self.reentrant_forwards = ReentrantForwards()

    def __getstate__(self) -> dict[str, Any]:
        """What a pickled layer keeps (``torch.save(model)``, a model handed to a spawned process): the recipe's
        quantizers with their state (delayed scaling's amax history and scales, a stochastic-rounding stream's
        position), so the copy computes what the layer would; not the transient state, rebuilt empty."""
        return {name: value for name, value in vars(self).items() if name not in self._TRANSIENT}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["layer_types"])
        vars(self).update(state)

    def quantizers(self, recipe: Recipe | None, layer_name: str) -> dict[str, Quantizer]:
        if recipe is None:
            return {}
        if recipe != self._recipe:
            self._recipe = recipe
            self._quantizers = recipe.quantizers(layer_name)
        return self._quantizers

    def linear(self, layer_name: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if torch.compiler.is_compiling():
            if debug_api.DEBUG_MANAGER is not None or runs_eagerly(active_recipe()):
                return run_eagerly(self.linear, layer_name, x, weight, bias)
            return self._forward(layer_name, x, weight, bias, traced=True)
        if in_backward():
            return self._recompute(layer_name, x, weight, bias)
        return self._forward(layer_name, x, weight, bias, traced=False)

    def _forward(self, layer_name: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, traced: bool):
        """``traced``: torch.compile is tracing this forward into a graph, which can neither consult the
        weight cache (it keys on storage) nor hold the autograd node for a recomputation."""
        recipe = active_recipe()
        plan = self.debug.plan_for(layer_name, recipe is not None, self.layer_types)
        manager = debug_api.DEBUG_MANAGER
        inspect = manager is not None and not manager.paused
        if plan is not None and not inspect and not plan.steered:
            plan = None  # debug_api.paused() and the features only look: the plain path, no per-tensor work
        if recipe is None and plan is None:
            return F.linear(x, weight, bias)
        quantizers = self.quantizers(recipe, layer_name)
        if plan is not None:
            processing = DebugProcessing(
                layer_name, quantizers, plan, self.debug.session, self.tp_group, inspected=TENSORS if inspect else ()
            )
        else:
            processing = PlainProcessing(quantizers, None if traced else self.weight_cache)
        checkpoint = None if traced or torch.is_grad_enabled() else reentrant_checkpoint()
        if checkpoint is not None:
            processing = recorder = CastRecorder(processing)
        out = apply_linear(x, weight, bias, processing)
        if checkpoint is not None:
            self.reentrant_forwards.record(checkpoint, Replay(quantizers, recorder.cast_states(), recipe, plan))
        elif not traced and out.grad_fn is not None:
            self.forwards.remember(out.grad_fn, recipe, plan)
        return out

    def _recompute(self, layer_name: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """This forward runs inside a backward: activation checkpointing recomputing an earlier forward.
        Repeat it (see ``recompute.py``)."""
        check_not_in_reentrant_checkpoint()
        if in_reentrant_recomputation():
            replay = self.reentrant_forwards.take()
            return F.linear(x, weight, bias) if replay is None else self._replay_reentrant(layer_name, x, weight, bias, replay)
        original = self.forwards.oldest()
        if original is None:
            out = F.linear(x, weight, bias)
        else:
            quantizers = replay_quantizers(
                self.quantizers(original.recipe, layer_name), getattr(original.node, "cast_states", {})
            )
            if original.plan is not None:
                processing = DebugProcessing(
                    layer_name, quantizers, original.plan, self.debug.session, self.tp_group, inspected=()
                )
            else:
                processing = PlainProcessing(quantizers)
            out = apply_linear(x, weight, bias, processing)
        if out.grad_fn is not None:  # a non-reentrant checkpoint only takes this graph's saved tensors
            out.grad_fn.register_prehook(refuse_backpropagation)
        return out

    def _replay_reentrant(
        self, layer_name: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, replay: Replay
    ) -> torch.Tensor:
        """A reentrant checkpoint's recomputation: its graph's backward is the one that runs, so the
        activation and weight repeat the original casts while the gradient casts live, and the backward
        tensors are inspected here (the original forward inspected the forward ones)."""
        quantizers = replay_quantizers(replay.quantizers, replay.cast_states, names=("activation", "weight"))
        if replay.plan is not None:
            processing = DebugProcessing(
                layer_name, quantizers, replay.plan, self.debug.session, self.tp_group, inspected=BACKWARD_TENSORS
            )
        else:
            processing = PlainProcessing(quantizers)
        out = apply_linear(x, weight, bias, processing)
        if out.grad_fn is not None:  # a non-reentrant checkpoint inside the region recomputes this forward
            self.forwards.remember(out.grad_fn, replay.recipe, replay.plan)
        return out


def apply_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, processing: Processing) -> torch.Tensor:
    """``LinearFunction`` as ``F.linear`` runs under the user's ``torch.autocast``: the activation cast to the
    autocast dtype (high-precision GEMMs cast the weight to it too, and gradients come out in it), while
    the function itself runs outside autocast, which would otherwise lower the emulated GEMMs' fp32
    accumulation. So a layer's numbers do not depend on whether a debug feature is active on it."""
    dtype = autocast_dtype(x)
    if dtype is None:
        return LinearFunction.apply(x, weight, bias, processing)
    with torch.autocast(x.device.type, enabled=False):
        return LinearFunction.apply(x.to(dtype), weight, bias, processing)


def autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype ``torch.autocast`` gives the floating-point input ``x`` of a linear layer, or None where it is off
    (or unavailable on ``x``'s device, as on meta)."""
    device_type = x.device.type
    if x.is_floating_point() and torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None
