"""A precision plan: ordered rules, each selecting layers and saying their recipe per GEMM; the first rule that
selects a layer wins. ``PrecisionPlan.resolve`` answers one layer's ``LayerPrecision``.

Each GEMM's choice is a ``lowprec.Recipe``, None (high precision: the layer's own dtype) or ``FROM_AUTOCAST``
(the recipe of the ``lowprec.autocast`` in force). A layer's evaluation forward (the module not training) has
a recipe of its own, by default its training fprop's.
"""

from __future__ import annotations

import difflib
import enum
import fnmatch
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from lowprec.plan.recipes import describe
from lowprec.recipe import Recipe
from nvdlfw_inspect.config_manager import LayerSpec
from nvdlfw_inspect.logging import say_once


class UnusedPlanRuleWarning(UserWarning):
    """A precision plan's rule chooses no layer's recipe: it selects none, or earlier rules take all it selects."""


GEMMS = ("fprop", "dgrad", "wgrad")


class _Choice(enum.Enum):
    """The named sentinels among the recipe choices, their values what they mean. An enum, so that
    ``torch.compile`` can trace a forward that builds ``GemmRecipes`` from them (torch 2.11's Dynamo cannot wrap
    an instance of a plain class made outside the trace)."""

    FROM_AUTOCAST = "the recipe of the lowprec.autocast in force"
    AS_TRAINING = "the layer's training fprop recipe"

    def __repr__(self) -> str:
        return self.name

    @property
    def meaning(self) -> str:
        return self.value


FROM_AUTOCAST = _Choice.FROM_AUTOCAST
AS_TRAINING = _Choice.AS_TRAINING

Choice = Recipe | None | _Choice


def describe_choice(choice: Choice) -> str:
    return choice.meaning if isinstance(choice, _Choice) else describe(choice)


@dataclass(frozen=True)
class GemmRecipes:
    """One choice per GEMM of a layer: ``fprop`` (y = x W^T), ``dgrad`` (dx = dy W), ``wgrad`` (dW = dy^T x)."""

    fprop: Choice = FROM_AUTOCAST
    dgrad: Choice = FROM_AUTOCAST
    wgrad: Choice = FROM_AUTOCAST

    @classmethod
    def every(cls, choice: Choice) -> GemmRecipes:
        return cls(choice, choice, choice)

    def of(self, gemm: str) -> Choice:
        return getattr(self, gemm)

    def filled(self, autocast_recipe: Recipe | None) -> GemmRecipes:
        """``FROM_AUTOCAST`` replaced by ``autocast_recipe``."""
        return GemmRecipes(*(autocast_recipe if self.of(g) is FROM_AUTOCAST else self.of(g) for g in GEMMS))


@dataclass(frozen=True)
class Override:
    """Whether a rule's choice replaces the autocast's recipe when the autocast quantizes (``quantized``) and when
    it does not (``high_precision``). Ours replace both; Megatron's default is the first only."""

    quantized: bool = True
    high_precision: bool = True


ALWAYS = Override()


@dataclass(frozen=True)
class LayerPrecision:
    """What a plan says for one layer: its training GEMMs' recipes, its evaluation forward's recipe, when they
    replace the autocast's (``training_override``, ``eval_override``), and the rule that chose them (``rule``:
    its index, ``rule_name``: its name or description; both None when no rule selected the layer)."""

    layer_name: str
    training: GemmRecipes
    eval: Choice
    rule: int | None = None
    rule_name: str | None = None
    training_override: Override = ALWAYS
    eval_override: Override = ALWAYS

    def gemm_recipes(self, training: bool, autocast_recipe: Recipe | None) -> GemmRecipes:
        """The recipe of each GEMM (None: high precision) of a forward (and its backward) in training or evaluation
        mode, under an autocast of ``autocast_recipe`` (None: none, or disabled)."""
        chosen, override = (
            (self.training, self.training_override) if training else (GemmRecipes.every(self.eval), self.eval_override)
        )
        applies = override.quantized if autocast_recipe is not None else override.high_precision
        return chosen.filled(autocast_recipe) if applies else GemmRecipes.every(autocast_recipe)


class Selector(Protocol):
    def matches(self, layer_name: str, layer_types: tuple[str, ...] = ()) -> bool: ...


@dataclass(frozen=True)
class GlobSelector:
    """Megatron's matcher: the layer name matches a shell-style ``pattern`` (``fnmatch``, case-sensitive)."""

    pattern: str

    def matches(self, layer_name: str, layer_types: tuple[str, ...] = ()) -> bool:
        return fnmatch.fnmatchcase(layer_name, self.pattern)


@dataclass(frozen=True)
class Rule:
    """One rule: its ``name`` (or a description), the ``selector`` of its layers, and its recipes."""

    name: str
    selector: Selector
    training: GemmRecipes
    eval: Choice = AS_TRAINING
    training_override: Override = ALWAYS
    eval_override: Override = ALWAYS

    def hints(self) -> list[str]:
        """Strings a layer this rule meant to select should look like (for the closest names of an unused rule)."""
        if isinstance(self.selector, GlobSelector):
            return [self.selector.pattern.replace("*", "").replace("?", "")]
        if isinstance(self.selector, LayerSpec):
            if self.selector.exact_layer_names is not None:
                return sorted(self.selector.exact_layer_names)
            if self.selector.name_regex is not None:
                return [self.selector.name_regex.pattern]
            return [str(value) for value in self.selector.raw.values()]
        return [self.name]


@dataclass(frozen=True)
class UnusedRule:
    """A rule that chooses no layer's recipe: it selects none (``shadowed_by`` empty), or every layer it selects is
    taken by earlier rules (their indices). ``closest``: the layer names most like what it selects."""

    index: int
    name: str
    shadowed_by: tuple[int, ...] = ()
    closest: tuple[str, ...] = ()

    def __str__(self) -> str:
        if self.shadowed_by:
            earlier = ", ".join(f"#{i}" for i in self.shadowed_by)
            return f"precision plan rule #{self.index} ({self.name}): every layer it selects is taken by earlier rule {earlier}"
        near = f"; closest layer names: {', '.join(self.closest)}" if self.closest else ""
        return f"precision plan rule #{self.index} ({self.name}) selects no layer{near}"


@dataclass(frozen=True)
class PrecisionPlan:
    """Rules in order, the first that selects a layer wins; ``default``: the recipes of layers no rule selects;
    ``eval``: the evaluation recipe of layers whose rule gives none (``AS_TRAINING``: their training fprop's).
    ``source`` names where the plan came from, ``dialect`` its format (``lowprec`` or ``megatron``)."""

    rules: tuple[Rule, ...] = ()
    default: GemmRecipes = GemmRecipes()
    eval: Choice = AS_TRAINING
    source: str = "precision plan"
    dialect: str = "lowprec"
    _cache: dict = field(default_factory=dict, compare=False, repr=False, hash=False)
    _said: set = field(default_factory=set, compare=False, repr=False, hash=False)

    def rule_for(self, layer_name: str, layer_types: tuple[str, ...] = ()) -> int | None:
        """The index of the first rule that selects the layer, None when none does."""
        for index, rule in enumerate(self.rules):
            if rule.selector.matches(layer_name, tuple(layer_types)):
                return index
        return None

    def resolve(self, layer_name: str, layer_types: Sequence[str] = ()) -> LayerPrecision:
        """The layer's precision: from the first rule that selects it, else the plan's default."""
        key = (layer_name, tuple(layer_types))
        if key not in self._cache:
            self._cache[key] = self._resolve(layer_name, key[1])
        return self._cache[key]

    def _resolve(self, layer_name: str, layer_types: tuple[str, ...]) -> LayerPrecision:
        index = self.rule_for(layer_name, layer_types)
        if index is None:
            eval_choice = self.default.fprop if self.eval is AS_TRAINING else self.eval
            return LayerPrecision(layer_name, self.default, eval_choice)
        rule = self.rules[index]
        eval_choice, eval_override = rule.eval, rule.eval_override
        if eval_choice is AS_TRAINING:
            eval_choice = rule.training.fprop if self.eval is AS_TRAINING else self.eval
            if self.eval is AS_TRAINING:
                eval_override = rule.training_override
        return LayerPrecision(layer_name, rule.training, eval_choice, index, rule.name, rule.training_override, eval_override)

    def unused_rules(self, names: Iterable[str], layer_types: Mapping[str, Sequence[str]] | None = None) -> list[UnusedRule]:
        """The rules that choose no layer among ``names`` (with each layer's types from ``layer_types``)."""
        names = list(names)
        types = layer_types or {}
        won: dict[int, list[str]] = {}
        selected: dict[int, list[str]] = {}
        for name in names:
            first = None
            for index, rule in enumerate(self.rules):
                if rule.selector.matches(name, tuple(types.get(name, ()))):
                    selected.setdefault(index, []).append(name)
                    if first is None:
                        first = index
            if first is not None:
                won.setdefault(first, []).append(name)
        unused = []
        for index, rule in enumerate(self.rules):
            if index in won:
                continue
            if index in selected:
                shadows = sorted({self.rule_for(name, tuple(types.get(name, ()))) for name in selected[index]})
                unused.append(UnusedRule(index, rule.name, tuple(shadows)))
            else:
                near: list[str] = []
                for hint in rule.hints():
                    near += [n for n in difflib.get_close_matches(hint, names, n=3, cutoff=0.4) if n not in near]
                unused.append(UnusedRule(index, rule.name, closest=tuple(near[:3])))
        return unused

    def resolved(self) -> dict[str, tuple[str, ...]]:
        """The layers resolved so far (each with its type names): those that ran under the plan."""
        return {name: types for name, types in self._cache}

    def say_unused_rules(self) -> list[UnusedRule]:
        """Say once per plan (debug log and ``UnusedPlanRuleWarning``) each rule that chooses no layer among those
        resolved so far, with the closest names; nothing before a layer has run under the plan."""
        if "unused rules" in self._said or not self._cache:
            return []
        self._said.add("unused rules")
        seen = self.resolved()
        unused = self.unused_rules(seen, seen)
        for rule in unused:
            say_once(
                f"{rule} (in {self.source}; {len(seen)} layers ran under it): fix the rule's selector, or remove it",
                warning=UnusedPlanRuleWarning,
                call_site=__name__,
            )
        return unused

    def describe(self) -> str:
        """The plan in lines: each rule, its selector and recipes, and the default."""
        lines = [f"{self.source} ({self.dialect} format), first matching rule wins:"]
        for index, rule in enumerate(self.rules):
            gemms = ", ".join(f"{g}: {describe_choice(rule.training.of(g))}" for g in GEMMS)
            eval_choice = self.eval if rule.eval is AS_TRAINING else rule.eval
            lines.append(f"  #{index} {rule.name}: {gemms}; eval: {describe_choice(eval_choice)}")
        gemms = ", ".join(f"{g}: {describe_choice(self.default.of(g))}" for g in GEMMS)
        lines.append(f"  otherwise: {gemms}; eval: {describe_choice(self.eval)}")
        return "\n".join(lines)
