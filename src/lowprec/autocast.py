"""``lowprec.fp8_autocast`` / ``lowprec.autocast``: which recipe the layers run under, if any.

``plan`` (a precision plan, ``lowprec.plan``) gives chosen layers, and chosen GEMMs of them, recipes of their own; the
layers no rule selects run the autocast's recipe.

The recipe in force is per thread, as ``torch.autocast``'s dtype is: a thread that enters no autocast runs its
layers in high precision whatever other threads do, and a new thread starts outside any autocast. A backward
casts with the recipe its forward ran under (the autograd function keeps the forward's quantizers), on whichever
thread autograd runs it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

from lowprec.errors import LowprecTypeError
from lowprec.plan import PrecisionPlan, load_plan
from lowprec.recipe import RECIPES, DelayedScaling, Recipe


@dataclass(frozen=True)
class AutocastState:
    enabled: bool = False
    recipe: Recipe | None = None
    plan: PrecisionPlan | None = None

    @property
    def autocast_recipe(self) -> Recipe | None:
        """The recipe of layers no plan rule selects (None: high precision)."""
        return self.recipe if self.enabled else None


class _ThreadState(threading.local):
    """The autocast in force on each thread: outside any, until the thread enters one."""

    current = AutocastState()


_thread = _ThreadState()

EntryWatch = Callable[[], Callable[[], None] | None]
_entry_watch: EntryWatch | None = None


def set_entry_watch(watch: EntryWatch) -> None:
    """Call ``watch`` at the entry of each enabled autocast; what it returns (None: nothing) is called at the exit.
    ``lowprec.modules.high_precision_gemms`` (which imports this module) looks there, once, for GEMMs left in
    high precision outside lowprec layers."""
    global _entry_watch
    _entry_watch = watch


def active_recipe() -> Recipe | None:
    """The recipe this thread's layers should quantize with now (those no plan rule selects), or None for high
    precision."""
    return _thread.current.autocast_recipe


def current_state() -> AutocastState:
    """This thread's autocast: its recipe and precision plan."""
    return _thread.current


def checked_recipe(recipe: Recipe | None, what: str = "autocast recipe") -> Recipe:
    """``recipe``, or the default (delayed scaling, HYBRID) for None; anything else is a ``LowprecTypeError``
    naming ``what`` (the argument) and the recipes allowed."""
    if recipe is None:
        return DelayedScaling()
    if not isinstance(recipe, RECIPES):
        allowed = ", ".join(f"lowprec.{cls.__name__}" for cls in RECIPES)
        raise LowprecTypeError(f"{what} must be one of {allowed}; got {type(recipe).__name__}")
    return recipe


@contextmanager
def autocast(
    enabled: bool = True, recipe: Recipe | None = None, plan: str | os.PathLike | Mapping | PrecisionPlan | None = None
) -> Iterator[None]:
    """Run ``lowprec`` layers inside the block in FP8 with ``recipe`` (default: delayed scaling, HYBRID).

    ``plan``: a precision plan (a YAML file's path, read again only when the file changes; a mapping, read at every
    entry; or a ``lowprec.plan.PrecisionPlan`` from ``lowprec.plan.load_plan``, see ``lowprec.plan.format``): the
    layers its rules select run the recipes it gives them, per GEMM and for evaluation
    forwards (a module not training); the others run ``recipe``. ``enabled=False`` runs the layers no rule selects in
    high precision, also inside an enclosing autocast (without a plan: every layer). It holds on this thread only
    (as ``torch.autocast``): other threads keep their own. Rules that select no layer in the block are said once.
    """
    if not isinstance(enabled, bool):
        raise LowprecTypeError(f"autocast(enabled=...) must be a bool, got {enabled!r}")
    precision_plan = None if plan is None else _plan_of(plan)
    outer, _thread.current = _thread.current, AutocastState(enabled, checked_recipe(recipe), precision_plan)
    at_exit = _entry_watch() if enabled and _entry_watch is not None else None
    try:
        yield
    finally:
        _thread.current = outer
        if at_exit is not None:
            at_exit()
        if precision_plan is not None:
            precision_plan.say_unused_rules()


_plans_read: dict[tuple[str, int, int], PrecisionPlan] = {}


def _plan_of(plan: str | os.PathLike | Mapping | PrecisionPlan) -> PrecisionPlan:
    """``load_plan(plan)``, a file read once while it is unchanged (an autocast entered every step with the same path
    neither parses it again nor makes every layer resolve its rules again)."""
    if not isinstance(plan, (str, os.PathLike)):
        return load_plan(plan)
    path = os.path.realpath(plan)
    try:
        stat = os.stat(path)
    except OSError:
        return load_plan(plan)  # its error names the file
    key = (path, stat.st_mtime_ns, stat.st_size)
    if key not in _plans_read:
        if len(_plans_read) >= 8:  # a few files (a training and an evaluation plan, say) stay read
            _plans_read.pop(next(iter(_plans_read)))
        _plans_read[key] = load_plan(plan)
    return _plans_read[key]


@contextmanager
def fp8_autocast(enabled: bool = True, fp8_recipe: Recipe | None = None) -> Iterator[None]:
    """The seeds' spelling of :func:`autocast`."""
    with autocast(enabled=enabled, recipe=fp8_recipe):
        yield
