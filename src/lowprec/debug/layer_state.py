"""When a layer asks its routing questions, and what it remembers of the answers.

A layer asks at its first forward of an iteration whose plan may differ from the last one's, and only the
questions that previous answers said are due by now (their ``next_iteration``, see ``plan.py``); other forwards
(later micro-batches, iterations under standing answers such as the guard's) reuse the plan. Turning FP8 on or
off, or a new debug session, makes the layer ask everything again at once.
Its calls of the features themselves (inspect, modify) are routed once per session (``SessionRoutes``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import nvdlfw_inspect.api as debug_api
from lowprec.debug.plan import GemmFormats, LayerPlan, Memory, Routing, TensorPlan, build_plan, log_plan
from nvdlfw_inspect.config_manager import ConfigManager
from nvdlfw_inspect.debug_manager import DebugManager, held


class SessionRoutes:
    """A layer's feature calls in one debug session (``inspect_tensor``, ``modify_tensor``, ...), each routed once
    (``BaseNamespaceAPI.bind``): the session's config never changes, and a layer makes the same calls at every
    step."""

    def __init__(self, session: DebugManager) -> None:
        self.session = session
        self._bound: dict[tuple[str, str, str, str | None], Callable[..., Any]] = {}

    def call(self, api_name: str, layer_name: str, tensor_name: str, gemm: str | None = None) -> Callable[..., Any]:
        """``debug_api.transformer_engine.<api_name>`` for this layer, tensor (and GEMM, where the API's routing
        depends on it), to be called with the other keyword arguments."""
        key = (api_name, layer_name, tensor_name, gemm)
        bound = self._bound.get(key)
        if bound is None:
            routing = {"tensor_name": tensor_name} if gemm is None else {"tensor_name": tensor_name, "gemm": gemm}
            namespace = self.session.get_extension_api("transformer_engine")
            bound = self._bound[key] = namespace.bind(layer_name, api_name, **routing)
        return bound


class DebugLayerState:
    """Per-layer routing memory; ``plan_for`` answers None when the layer can take its plain path."""

    def __init__(self) -> None:
        self.routes: SessionRoutes | None = None  # the session the plans are of, and its feature calls
        self._plan: LayerPlan | None = None
        self._next_iteration: int | None = 0  # when the plan may change next (None: never, in this session)
        self._formats: GemmFormats | None = None
        self._memory = Memory()
        self._said: tuple[dict[str, TensorPlan], GemmFormats] | None = None  # the plan last said (log_plan)
        self._written: dict[tuple[str, str], Routing] = {}  # the routing records written, per (tensor, GEMM)

    @property
    def session(self) -> DebugManager | None:
        """The debug session the plans are of (None before the first)."""
        return None if self.routes is None else self.routes.session

    def plan_for(self, layer_name: str, formats: GemmFormats | bool, layer_types: tuple[str, ...] = ()) -> LayerPlan | None:
        """The plan of this forward, or None for the plain path (also when ``end_debug()`` runs meanwhile on another
        thread). ``formats``: the format of each GEMM's operands under the layer's recipes (or whether one recipe runs
        them all). ``layer_types`` are the type names that config ``layer_types`` selectors match besides substrings
        of the name."""
        manager = debug_api.DEBUG_MANAGER
        if manager is None:
            return None
        if not isinstance(formats, GemmFormats):
            formats = GemmFormats.uniform(formats)
        if manager is self.session and (formats is self._formats or formats == self._formats):
            upcoming = self._next_iteration
            if upcoming is None or manager._trainer_iteration_count < upcoming:
                return self._plan  # the plan holds: asking nothing of the session, it does not hold it
        with held(manager) as open_:
            return self._plan_in(manager, layer_name, formats, layer_types) if open_ else None

    def _plan_in(
        self, manager: DebugManager, layer_name: str, formats: GemmFormats, layer_types: tuple[str, ...]
    ) -> LayerPlan | None:
        if manager is not self.session:
            self.__init__()
            self.routes = SessionRoutes(manager)
        if layer_types:
            ConfigManager.set_layer_types(layer_name, *layer_types)
        if self._formats is None or formats.quantized_gemms != self._formats.quantized_gemms:
            self._memory = Memory()  # other questions are asked with FP8 on
        plan = build_plan(layer_name, manager._trainer_iteration_count, formats, self._memory)
        if (plan.tensors, formats) != self._said:  # a new plan, or one reused that differs from the last said
            self._said = (plan.tensors, formats)
            log_plan(plan, self._written)
        self._formats = formats
        self._next_iteration = plan.next_iteration
        self._plan = plan if plan.active else None
        return self._plan
