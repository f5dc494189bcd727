"""The cheapest precision plan whose predicted damage stays within a budget, from calibration statistics.

Each GEMM of each layer (a ``Unit``) takes one format from its ``Option``s, each with a cost (``plan.cost``: what
the GEMM reads, or its time on a named GPU) and a predicted damage (the loss a calibration run measured for that
GEMM in that format, all others in high precision). Damages are taken to add up over units, so the plan's
predicted damage is their sum, and the search is a multiple-choice knapsack: least total cost such that the total
damage is at most ``budget``.

It is solved by the greedy of its linear relaxation, which is exact at every point it visits: each unit starts at
its cheapest option, and the upgrade (a unit moved to its next option on the lower convex hull of its own (cost,
damage) points) that removes the most damage per unit of cost is taken next, until the damage fits the budget.
Every point visited is on the Pareto front of cost against damage among the plans the hulls allow; the last one
taken may overshoot the cost by at most one upgrade (a plan between two front points would need a fractional
choice). Ties are broken by layer and GEMM name, so the search is deterministic for a given calibration.
O(options log options): milliseconds for hundreds of layers.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from lowprec.plan.rules import GEMMS


@dataclass(frozen=True, order=True)
class Unit:
    """One GEMM of one layer, the thing a plan gives a format."""

    layer: str
    gemm: str


@dataclass(frozen=True)
class Option:
    """A format for a unit (a plan's recipe name: ``nvfp4``, ``mxfp8``, ``bf16``...), its cost and predicted damage."""

    format: str
    cost: float
    damage: float


@dataclass(frozen=True)
class FrontPoint:
    """A plan on the way: its total cost and predicted damage, after ``upgrades`` upgrades from the cheapest plan."""

    cost: float
    damage: float
    upgrades: int


@dataclass
class SearchResult:
    """The chosen format of every unit, its total cost and damage, whether the damage fits the budget (it cannot
    when even the most expensive plan's does not), and the Pareto front visited, cheapest first."""

    chosen: dict[Unit, Option]
    cost: float
    damage: float
    budget: float
    within_budget: bool
    front: list[FrontPoint] = field(default_factory=list)

    def formats(self) -> dict[str, dict[str, str]]:
        """``{layer: {gemm: format}}`` of the chosen plan, layers and GEMMs in order."""
        by_layer: dict[str, dict[str, str]] = {}
        for unit in sorted(self.chosen, key=lambda u: (u.layer, GEMMS.index(u.gemm) if u.gemm in GEMMS else 99, u.gemm)):
            by_layer.setdefault(unit.layer, {})[unit.gemm] = self.chosen[unit].format
        return by_layer


def hull(options: Sequence[Option]) -> list[Option]:
    """The options on the lower convex hull of (cost, damage) from the cheapest: each costs more and damages less
    than the one before, at a falling rate of damage removed per cost (dominated and non-convex options left out;
    of equal costs the least damage, of equal points the first given)."""
    if not options:
        raise ValueError("a unit needs at least one option")
    for option in options:
        if not (option.cost >= 0 and option.damage >= 0):
            raise ValueError(f"option {option}: cost and damage must be non-negative numbers")
    ordered = sorted(options, key=lambda o: (o.cost, o.damage))
    kept: list[Option] = []
    for option in ordered:
        if kept and option.damage >= kept[-1].damage:
            continue  # costs as much or more and damages no less
        while len(kept) >= 2 and _rate(kept[-2], kept[-1]) <= _rate(kept[-1], option):
            kept.pop()  # the middle one removes damage more slowly than going straight on: not convex
        kept.append(option)
    return kept


def _rate(cheap: Option, dear: Option) -> float:
    """Damage removed per unit of cost going from ``cheap`` to ``dear``."""
    extra = dear.cost - cheap.cost
    return float("inf") if extra == 0 else (cheap.damage - dear.damage) / extra


def search(units: Mapping[Unit, Sequence[Option]], budget: float) -> SearchResult:
    """The cheapest plan (see the module's docstring) whose total damage is at most ``budget``."""
    if not budget >= 0:
        raise ValueError(f"budget must be a non-negative number, got {budget!r}")
    if not units:
        raise ValueError("no units to search: the model has no GEMM layer to give a format")
    hulls = {unit: hull(units[unit]) for unit in sorted(units)}  # in one order: the same sums whatever the order given
    position = dict.fromkeys(hulls, 0)
    cost = sum(h[0].cost for h in hulls.values())
    damage = sum(h[0].damage for h in hulls.values())
    front = [FrontPoint(cost, damage, 0)]
    queue: list[tuple[float, Unit]] = []
    for unit, points in hulls.items():
        if len(points) > 1:
            heapq.heappush(queue, (-_rate(points[0], points[1]), unit))
    upgrades = 0
    while damage > budget and queue:
        _, unit = heapq.heappop(queue)
        points, at = hulls[unit], position[unit]
        cost += points[at + 1].cost - points[at].cost
        damage += points[at + 1].damage - points[at].damage
        position[unit] = at + 1
        upgrades += 1
        front.append(FrontPoint(cost, damage, upgrades))
        if at + 2 < len(points):
            heapq.heappush(queue, (-_rate(points[at + 1], points[at + 2]), unit))
    chosen = {unit: hulls[unit][position[unit]] for unit in sorted(hulls)}
    total_cost = sum(option.cost for option in chosen.values())
    total_damage = sum(option.damage for option in chosen.values())
    return SearchResult(chosen, total_cost, total_damage, budget, total_damage <= budget, front)


def full_front(units: Mapping[Unit, Sequence[Option]]) -> list[FrontPoint]:
    """Every point of the front, from the cheapest plan to the least damaging one (a search with budget 0)."""
    return search(units, 0.0).front


def plan_of(formats: Mapping[str, Mapping[str, str]], name: str = "search") -> dict:
    """A precision plan (lowprec's format) giving each layer's GEMMs their formats: the format most layers take on
    every GEMM as the ``default`` (ties: the first in name order), a rule per other layer (``recipe`` when its GEMMs
    agree, else one per GEMM), in layer order."""
    whole = [next(iter(set(gemms.values()))) for gemms in formats.values() if len(set(gemms.values())) == 1]
    counts = {fmt: whole.count(fmt) for fmt in sorted(set(whole))}
    default = max(counts, key=lambda fmt: counts[fmt]) if counts else None
    rules = []
    for layer, gemms in formats.items():
        values = set(gemms.values())
        if values == {default}:
            continue
        rule: dict = {"name": f"{name}: {layer}", "layers": {"exact_layer_names": [layer]}}
        if len(values) == 1:
            rule["recipe"] = next(iter(values))
        else:
            rule.update({gemm: gemms[gemm] for gemm in GEMMS if gemm in gemms})
        rules.append(rule)
    plan: dict = {"rules": rules}
    if default is not None:
        plan = {"default": default, **plan}
    return plan
