"""What one linear transformation of a layer needs to run in FP8 and be debugged.

A ``GemmUnit`` belongs to one debug layer name (a ``Linear``, or ``fc1`` of a ``LayerNormMLP``). It
keeps the layer's quantizers per recipe it runs (delayed scaling needs their amax history; a precision plan may give
each GEMM, and evaluation forwards, a recipe of its own) and its routing state, and picks the path of each
forward: ``torch.nn.functional.linear`` when neither FP8 nor a debug feature is on, otherwise ``LinearFunction`` with
plain or debug processing.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F

import nvdlfw_inspect.api as debug_api
from lowprec.autocast import current_state
from lowprec.debug.layer_state import DebugLayerState
from lowprec.debug.names import BACKWARD_TENSORS, GEMMS, TENSORS
from lowprec.debug.quantizer import DebugProcessing
from lowprec.modules.gemm_quantizers import GemmQuantizers
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
)
from lowprec.plan.recipes import describe
from lowprec.plan.rules import GemmRecipes, LayerPrecision, PrecisionPlan
from lowprec.quant.protocol import Quantizer
from lowprec.quant.weight_cache import WeightCache
from lowprec.recipe import BLOCK_RECIPES, DelayedScaling, Recipe
from nvdlfw_inspect.logging import say_once

logger = logging.getLogger("lowprec")


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

    #: what a process holds only while it runs the layer: the weight's casts, the forwards whose backward is due, the
    #: routing memory of the debug session (which holds the session)
    _TRANSIENT = frozenset({"debug", "weight_cache", "second_weight_cache", "forwards", "reentrant_forwards", "_last"})

    def __init__(self, layer_types: tuple[str, ...]):
        self.layer_types = layer_types
        self.tp_group: Any = None  # set by NamedModule.set_tensor_parallel_group
        self.debug = DebugLayerState()
        self._by_recipe: dict[Recipe, dict[str, Quantizer]] = {}  # each recipe's quantizers (their amax histories)
        self._by_recipes: dict[tuple[GemmRecipes, str | None], GemmQuantizers] = {}
        self._training: GemmRecipes | None = None  # the recipes of the last training forward
        self._said: tuple | None = None  # the last precision-plan resolution said
        self._last: tuple | None = None  # (autocast recipe, plan, training, quantizers) of the last forward
        self.weight_cache = WeightCache()  # the weight's cast for its first GEMM (fprop), or for both under one recipe
        self.second_weight_cache = WeightCache()  # its cast for dgrad, when another recipe runs dgrad
        self.forwards = ForwardHistory()
        self.reentrant_forwards = ReentrantForwards()

    def __getstate__(self) -> dict[str, Any]:
        """What a pickled layer keeps (``torch.save(model)``, a model handed to a spawned process): the recipes'
        quantizers with their state (delayed scaling's amax history and scales, a stochastic-rounding stream's
        position), so the copy computes what the layer would; not the transient state, rebuilt empty."""
        return {name: value for name, value in vars(self).items() if name not in self._TRANSIENT}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["layer_types"])
        vars(self).update(state)

    def quantizers(self, recipe: Recipe, layer_name: str) -> dict[str, Quantizer]:
        """The layer's quantizers of ``recipe``, made at its first use and kept (with their state) while the layer
        runs it."""
        made = self._by_recipe.get(recipe)
        if made is None:
            made = self._by_recipe[recipe] = recipe.quantizers(layer_name)
        return made

    def gemm_quantizers(self, layer_name: str, training: bool = True) -> GemmQuantizers:
        """The quantizers of this forward's GEMMs under the thread's autocast: its recipe, or what its precision plan
        says for this layer (``training``: the module is training; otherwise the plan's evaluation recipe)."""
        state = current_state()
        last = self._last
        if last is not None and last[0] is state.autocast_recipe and last[1] is state.plan and last[2] == training:
            return last[3]  # the same autocast recipe and plan objects as the last forward: the same resolution
        rule = None
        if state.plan is None:
            recipes = GemmRecipes.every(state.autocast_recipe)
        else:
            precision = state.plan.resolve(layer_name, self.layer_types)
            recipes = precision.gemm_recipes(training, state.autocast_recipe)
            rule = precision.rule_name if precision.rule is not None else None
            self._say_resolution(layer_name, state.plan, precision, training, recipes)
        if training and recipes != self._training:
            self._start_fresh(layer_name, recipes)
        found = self._by_recipes.get((recipes, rule))
        if found is None:
            made = GemmQuantizers.of(recipes, lambda recipe: self.quantizers(recipe, layer_name), rule)
            found = self._by_recipes[(recipes, rule)] = made
        self._last = (state.autocast_recipe, state.plan, training, found)
        return found

    def _start_fresh(self, layer_name: str, recipes: GemmRecipes) -> None:
        """A training forward whose recipes differ from the last one's. A GEMM that moves from one recipe to another
        changes format: the quantizers of the training recipes the layer no longer runs are dropped (a later return
        starts a fresh amax history; evaluation-only recipes keep theirs), and that is said once. A GEMM that only
        leaves or resumes quantizing (an autocast turned off and on) keeps its quantizers."""
        before, self._training = self._training, recipes
        self._by_recipes.clear()
        if before is None:
            return
        changes = [
            f"{gemm} {describe(before.of(gemm))} -> {describe(recipes.of(gemm))}"
            for gemm in GEMMS
            if None not in (before.of(gemm), recipes.of(gemm)) and before.of(gemm) != recipes.of(gemm)
        ]
        if not changes:
            return
        left = {before.of(gemm) for gemm in GEMMS} - {recipes.of(gemm) for gemm in GEMMS}
        for recipe in left:  # an evaluation-only recipe keeps its quantizers
            self._by_recipe.pop(recipe, None)
        if torch.compiler.is_compiling():  # a graph being traced cannot log (only eager runs, and a plan's layers, say it)
            return
        message = (
            f"{layer_name}: its training GEMMs changed format ({'; '.join(changes)}): each new recipe starts with fresh "
            "quantizers (an empty amax history under delayed scaling)"
        )
        say_once(message, layer_name, level=logging.INFO, warning=None, call_site=__name__)
        logger.info(message)

    def _say_resolution(
        self, layer_name: str, plan: PrecisionPlan, precision: LayerPrecision, training: bool, recipes: GemmRecipes
    ) -> None:
        """Say once (debug log, ``lowprec`` logger) what the plan gives the layer, per GEMM, and which rule chose it."""
        key = (id(plan), precision, training, recipes)
        if key == self._said:
            return
        self._said = key
        rule = (
            "no rule selects it (the plan's default)"
            if precision.rule is None
            else f"rule #{precision.rule} ({precision.rule_name})"
        )
        mode = "training" if training else "evaluation"
        gemms = ", ".join(f"{gemm} {describe(recipes.of(gemm))}" for gemm in GEMMS)
        message = f"{layer_name}: precision plan {plan.source}, {rule}: {mode} GEMMs {gemms}"
        say_once(message, layer_name, level=logging.INFO, warning=None, call_site=__name__)
        logger.info(message)

    def linear(
        self, layer_name: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, training: bool = True
    ) -> torch.Tensor:
        """``x W^T + b`` through the layer's GEMMs; ``training``: the module's mode (a precision plan may give an
        evaluation forward another recipe)."""
        if torch.compiler.is_compiling():
            state = current_state()
            if debug_api.DEBUG_MANAGER is not None or state.plan is not None or runs_eagerly(state.autocast_recipe):
                return run_eagerly(self.linear, layer_name, x, weight, bias, training)
            return self._forward(layer_name, x, weight, bias, training, traced=True)
        if in_backward():
            return self._recompute(layer_name, x, weight, bias)
        return self._forward(layer_name, x, weight, bias, training, traced=False)

    def _forward(
        self, layer_name: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, training: bool, traced: bool
    ):
        """``traced``: torch.compile is tracing this forward into a graph, which can neither consult the
        weight cache (it keys on storage) nor hold the autograd node for a recomputation."""
        quantizers = self.gemm_quantizers(layer_name, training)
        plan = self.debug.plan_for(layer_name, quantizers.formats, self.layer_types)
        manager = debug_api.DEBUG_MANAGER
        inspect = manager is not None and not manager.paused
        if plan is not None and not inspect and not plan.steered:
            plan = None  # debug_api.paused() and the features only look: the plain path, no per-tensor work
        if not quantizers.quantizes and plan is None:
            return F.linear(x, weight, bias)
        if plan is not None:
            processing = DebugProcessing(
                layer_name, quantizers, plan, self.debug.routes, self.tp_group, inspected=TENSORS if inspect else ()
            )
        else:
            # an evaluation forward under another fprop recipe than training's casts past the caches, which keep the
            # training casts for the step's next micro-batch
            foreign = not training and self._training is not None and quantizers.recipes.fprop != self._training.fprop
            caches = None if traced or foreign else (self.weight_cache, self.second_weight_cache)
            processing = PlainProcessing(quantizers, caches)
        checkpoint = None if traced or torch.is_grad_enabled() else reentrant_checkpoint()
        if checkpoint is not None:
            processing = recorder = CastRecorder(processing, quantizers)
        out = apply_linear(x, weight, bias, processing)
        if checkpoint is not None:
            self.reentrant_forwards.record(checkpoint, Replay(quantizers, recorder.cast_states(), plan))
        elif not traced and out.grad_fn is not None:
            self.forwards.remember(out.grad_fn, quantizers, plan)
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
            quantizers = original.quantizers.replaying(getattr(original.node, "cast_states", {}))
            if original.plan is not None:
                processing = DebugProcessing(
                    layer_name, quantizers, original.plan, self.debug.routes, self.tp_group, inspected=()
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
        quantizers = replay.quantizers.replaying(replay.cast_states, names=("activation", "weight"))
        if replay.plan is not None:
            processing = DebugProcessing(
                layer_name, quantizers, replay.plan, self.debug.routes, self.tp_group, inspected=BACKWARD_TENSORS
            )
        else:
            processing = PlainProcessing(quantizers)
        out = apply_linear(x, weight, bias, processing)
        if out.grad_fn is not None:  # a non-reentrant checkpoint inside the region recomputes this forward
            self.forwards.remember(out.grad_fn, replay.quantizers, replay.plan)
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
