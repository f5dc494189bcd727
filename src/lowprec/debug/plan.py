"""A layer's debug plan for one iteration: for every tensor and GEMM, what the layer does with it.

The plan comes from the routing calls (``*_enabled``) of the ``transformer_engine`` namespace. Each
answer ``(enabled, next_iteration)`` holds for its iteration; until ``next_iteration`` the question
takes its default answer (the one a layer gets when no feature serves it), and from then on it is
asked again (None: never). An ``EveryIteration`` answer holds at every later iteration: it is never
asked again in the session. So a layer asks, at an iteration, only the questions that are due: with
statistics every few steps, the inspection questions of the inspected tensors, not all 24; with
statistics or the guard every step, none, and its plan stands from one iteration to the next
(``LayerPlan.next_iteration``: when the plan may change). Each input
tensor gets a precision for each of its two GEMMs, each output tensor whether it is modified; any
tensor may be inspected.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum

import nvdlfw_inspect.api as debug_api
from lowprec.debug.features.api import EveryIteration, TEDefaultFeatures, normalize_answer
from lowprec.debug.names import INPUT_TENSORS, ROUTING_ORDER, TENSOR_GEMMS
from lowprec.plan.recipes import spec_of
from lowprec.recipe import Recipe


class Precision(Enum):
    QUANTIZE = "FP8 quantization"
    HIGH_PRECISION = "High precision"
    MODIFY = "modify_tensor()"


@dataclass(frozen=True)
class GemmFormats:
    """The format each GEMM reads each input tensor in under the layer's recipes: the recipe's statistics label
    (``mxfp8``, ``nvfp4``, ``fp8_current_scaling``, ...), ``""`` for a recipe of no label, None for high precision.
    Under one recipe every GEMM has the same; under a precision plan each GEMM its own. ``recipes``: each quantizing
    GEMM's recipe, where known (the routing records carry it as a plan's recipe spec); ``rule``: the precision plan
    rule that selected the layer, if one did."""

    labels: tuple[tuple[str, str, str | None], ...]  # (tensor, GEMM, label), in INPUT_TENSORS and TENSOR_GEMMS order
    recipes: tuple[tuple[str, Recipe], ...] = ()  # (GEMM, its recipe)
    rule: str | None = None
    quantized_gemms: frozenset[str] = field(init=False, repr=False, compare=False)  # asked at every routing round

    def __post_init__(self) -> None:
        object.__setattr__(self, "quantized_gemms", frozenset(g for _, g, label in self.labels if label is not None))

    @classmethod
    def of(
        cls,
        labels: Mapping[tuple[str, str], str | None],
        recipes: Mapping[str, Recipe | None] | None = None,
        rule: str | None = None,
    ) -> GemmFormats:
        ordered = tuple((tensor, gemm, labels[(tensor, gemm)]) for tensor in INPUT_TENSORS for gemm in TENSOR_GEMMS[tensor])
        known = tuple((gemm, recipe) for gemm, recipe in (recipes or {}).items() if recipe is not None)
        return cls(ordered, known, rule)

    def spec(self, gemm: str) -> dict | None:
        """``gemm``'s recipe as a plan's recipe spec, None where not known or not quantized (made when said, never in
        a forward: a compiled graph does not trace it)."""
        recipe = next((recipe for g, recipe in self.recipes if g == gemm), None)
        return None if recipe is None else spec_of(recipe)

    @classmethod
    def uniform(cls, quantized: bool) -> GemmFormats:
        """Every GEMM under one recipe (its label unknown: ``""``), or none."""
        return cls.of({(t, g): "" if quantized else None for t in INPUT_TENSORS for g in TENSOR_GEMMS[t]})

    def label(self, tensor: str, gemm: str) -> str | None:
        return next(label for t, g, label in self.labels if (t, g) == (tensor, gemm))

    def quantizes(self, gemm: str) -> bool:
        """Whether ``gemm`` runs a recipe (both its operands come from it)."""
        return gemm in self.quantized_gemms

    @property
    def any(self) -> bool:
        return bool(self.quantized_gemms)


NO_RECIPE = GemmFormats.uniform(False)
ONE_RECIPE = GemmFormats.uniform(True)


@dataclass
class TensorPlan:
    """What happens to one tensor: per GEMM that consumes (or produces) it, and whether it is inspected."""

    name: str
    gemms: dict[str, Precision]
    inspect: bool = False
    inspect_postquantize: dict[str, bool] = field(default_factory=dict)

    @property
    def quantized_anywhere(self) -> bool:
        return Precision.QUANTIZE in self.gemms.values()

    def active(self, formats: GemmFormats) -> bool:
        """Whether a feature touches this tensor (so the layer must take the debug path)."""
        return self.inspect or any(self.inspect_postquantize.values()) or self.steered(formats)

    def steered(self, formats: GemmFormats) -> bool:
        """Whether a feature changes what this tensor's GEMMs compute (modifies it, or sets its precision)."""
        if Precision.MODIFY in self.gemms.values():
            return True
        # a GEMM that runs a recipe but reads this input in high precision is a feature's doing too
        return self.name in INPUT_TENSORS and any(
            formats.quantizes(gemm) and precision is not Precision.QUANTIZE for gemm, precision in self.gemms.items()
        )


@dataclass
class LayerPlan:
    layer_name: str
    iteration: int
    formats: GemmFormats
    tensors: dict[str, TensorPlan]
    next_iteration: int | None

    @property
    def fp8(self) -> bool:
        """Whether any GEMM of the layer runs a recipe."""
        return self.formats.any

    @property
    def active(self) -> bool:
        return any(plan.active(self.formats) for plan in self.tensors.values())

    @property
    def steered(self) -> bool:
        """Whether a feature changes what the layer computes: inspection paused, it still needs the debug path."""
        return any(plan.steered(self.formats) for plan in self.tensors.values())

    def precision(self, tensor: str, gemm: str) -> Precision:
        return self.tensors[tensor].gemms[gemm]


Question = tuple[str, str | None, str | None]  # (routing call, tensor, GEMM)
Answer = tuple[bool, int | None, int]  # (enabled, iteration to ask again at or None, iteration it was asked at)

_DEFAULTS = TEDefaultFeatures()


def _default(call: str) -> bool:
    """The answer when no feature serves ``call`` (and between a feature's answers)."""
    return normalize_answer(getattr(_DEFAULTS, call)({}, ""), 0)[0]


DEFAULT_ANSWERS = {
    call: _default(call)
    for call in ("inspect_tensor_enabled", "inspect_tensor_postquantize_enabled", "modify_tensor_enabled", "fp8_gemm_enabled")
}


@dataclass
class Memory:
    """What a layer remembers between iterations: each routing question's last answer, the questions answered for
    every iteration (``EveryIteration``), and the plan each combination of answers gave (the plan depends on nothing
    else)."""

    answers: dict[Question, Answer] = field(default_factory=dict)
    every_iteration: set[Question] = field(default_factory=set)
    plans: dict[frozenset, dict[str, TensorPlan]] = field(default_factory=dict)


class _Asker:
    """Answers the routing questions of one layer at one iteration, asking only those that are due
    (``memory`` holds the layer's earlier answers and is updated)."""

    def __init__(self, layer_name: str, iteration: int, memory: Memory):
        self.layer_name = layer_name
        self.iteration = iteration
        self.answers = memory.answers
        self.every_iteration = memory.every_iteration

    def _answer(self, call: str, tensor: str | None = None, gemm: str | None = None) -> bool:
        question = (call, tensor, gemm)
        known = self.answers.get(question)
        if known is not None:
            enabled, upcoming, asked_at = known
            if asked_at == self.iteration:
                return enabled
            if question in self.every_iteration:  # answered for this iteration too, without asking
                self.answers[question] = (enabled, self.iteration + 1, self.iteration)
                return enabled
            if upcoming is None or self.iteration < upcoming:
                return DEFAULT_ANSWERS[call]
        kwargs = {"tensor_name": tensor} if tensor is not None else {}
        if gemm is not None:
            kwargs["gemm"] = gemm
        answer = getattr(debug_api.transformer_engine, call)(layer_name=self.layer_name, iteration=self.iteration, **kwargs)
        if isinstance(answer, EveryIteration):
            self.every_iteration.add(question)
        enabled, upcoming = normalize_answer(answer, self.iteration)
        self.answers[question] = (enabled, upcoming, self.iteration)
        return enabled

    def inspect(self, tensor: str) -> bool:
        return self._answer("inspect_tensor_enabled", tensor)

    def inspect_postquantize(self, tensor: str, gemm: str) -> bool:
        return self._answer("inspect_tensor_postquantize_enabled", tensor, gemm)

    def modify(self, tensor: str, gemm: str) -> bool:
        return self._answer("modify_tensor_enabled", tensor, gemm)

    def fp8(self, gemm: str) -> bool:
        return self._answer("fp8_gemm_enabled", None, gemm)

    def ask_due(self) -> None:
        """Ask every remembered question that is due at this iteration, in the order they were first asked."""
        for question, (_, upcoming, _) in list(self.answers.items()):
            if upcoming is not None and upcoming <= self.iteration:
                self._answer(*question)

    def in_effect(self) -> frozenset:
        """The answers other than the default ones in effect now: together with the defaults they decide the plan."""
        return frozenset(
            (question, enabled)
            for question, (enabled, _, asked_at) in self.answers.items()
            if asked_at == self.iteration and enabled != DEFAULT_ANSWERS[question[0]]
        )

    def next_iteration(self) -> int | None:
        """The first iteration after this one whose plan may differ from this one's (None: none's does): the next
        when an answer in effect holds for this iteration only (the default answer follows), else the first at which
        a question is due. An ``EveryIteration`` answer holds at every later iteration: it changes no plan."""
        if any(question not in self.every_iteration for question, _ in self.in_effect()):
            return self.iteration + 1
        upcoming = [
            nxt
            for question, (_, nxt, _) in self.answers.items()
            if question not in self.every_iteration and nxt is not None and nxt > self.iteration
        ]
        return min(upcoming) if upcoming else None


def build_plan(layer_name: str, iteration: int, fp8: bool | GemmFormats, memory: Memory | None = None) -> LayerPlan:
    """The plan of ``layer_name`` at ``iteration`` (``fp8``: the format of each GEMM's operands, or whether one recipe
    runs them all), asking the routing calls that are due given the layer's ``memory`` (updated; none given: every
    call is asked; it must be of the same GEMMs quantized). When the answers in effect are ones the layer had
    before, their plan is reused without walking every question."""
    formats = fp8 if isinstance(fp8, GemmFormats) else GemmFormats.uniform(fp8)
    memory = Memory() if memory is None else memory
    ask = _Asker(layer_name, iteration, memory)
    if memory.answers:
        ask.ask_due()
        tensors = memory.plans.get(ask.in_effect())
        if tensors is not None:
            return LayerPlan(layer_name, iteration, formats, tensors, ask.next_iteration())
    tensors = {}
    for tensor in ROUTING_ORDER:
        own_gemms = [g for g in TENSOR_GEMMS[tensor] if g is not None]
        plan = TensorPlan(tensor, {}, inspect=ask.inspect(tensor))
        if tensor in INPUT_TENSORS:
            plan.inspect_postquantize = {g: ask.inspect_postquantize(tensor, g) for g in own_gemms}
            for gemm in own_gemms:
                if ask.modify(tensor, gemm):
                    plan.gemms[gemm] = Precision.MODIFY
                elif formats.quantizes(gemm) and ask.fp8(gemm):
                    plan.gemms[gemm] = Precision.QUANTIZE
                else:
                    plan.gemms[gemm] = Precision.HIGH_PRECISION
        else:
            gemm = own_gemms[0]
            plan.gemms[gemm] = Precision.MODIFY if ask.modify(tensor, gemm) else Precision.HIGH_PRECISION
        tensors[tensor] = plan
    memory.plans[ask.in_effect()] = tensors
    return LayerPlan(layer_name, iteration, formats, tensors, ask.next_iteration())


Routing = tuple[str, str | None, bool, str | None, str | None, str | None]
"""A routing record's (decision, feature, recipe, format, recipe spec as JSON, plan rule)."""
_DECISIONS = {Precision.QUANTIZE: "fp8", Precision.HIGH_PRECISION: "high_precision", Precision.MODIFY: "modified"}


def log_plan(plan: LayerPlan, written: dict[tuple[str, str], Routing]) -> None:
    """Say a plan: one debug log line per input tensor and GEMM and per modified output (each line once per run),
    and a routing record (``debug_api.log_routing``, with the format the GEMM's recipe reads the tensor in) for each of
    those whose routing differs from the one last written (``written``, per (tensor, GEMM), updated; an output that
    stops being modified is recorded too).
    Called with a plan other than the last one said, never per forward."""
    for tensor in ROUTING_ORDER:
        for gemm, precision in plan.tensors[tensor].gemms.items():
            said = tensor in INPUT_TENSORS or precision is Precision.MODIFY
            if said:
                debug_api.log_message(f"{plan.layer_name}: Tensor: {tensor}, gemm {gemm} - {precision.value}")
            elif (tensor, gemm) not in written:
                continue
            formats = plan.formats
            label = formats.label(tensor, gemm) if tensor in INPUT_TENSORS else None
            feature = _deciding_feature(plan, tensor, gemm, precision)
            spec = json.dumps(formats.spec(gemm)) if label else None
            routing = (_DECISIONS[precision], feature, formats.quantizes(gemm), label or None, spec, formats.rule)
            if written.get((tensor, gemm)) != routing:
                written[(tensor, gemm)] = routing
                decision, feature, recipe, fmt, spec, rule = routing
                debug_api.log_routing(
                    layer=plan.layer_name,
                    gemm=gemm,
                    tensor=tensor,
                    decision=decision,
                    feature=feature,
                    recipe=recipe,
                    iteration=plan.iteration,
                    format=fmt,
                    recipe_spec=None if spec is None else json.loads(spec),
                    plan_rule=rule,
                )


def _deciding_feature(plan: LayerPlan, tensor: str, gemm: str, precision: Precision) -> str | None:
    """The features ("+" between several) whose routing answer gave ``precision``, or None for a default one
    (quantized under a recipe, or high precision without one)."""
    if precision is Precision.MODIFY:
        call, kwargs = "modify_tensor_enabled", {"tensor_name": tensor, "gemm": gemm}
    elif precision is Precision.HIGH_PRECISION and plan.formats.quantizes(gemm) and tensor in INPUT_TENSORS:
        call, kwargs = "fp8_gemm_enabled", {"gemm": gemm}
    else:
        return None
    names = debug_api.transformer_engine.serving_features(plan.layer_name, call, **kwargs)
    return "+".join(names) or None
