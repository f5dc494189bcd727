"""``lowprec.fp8_autocast`` / ``lowprec.autocast``: which recipe the layers run under, if any.

The recipe in force is per thread, as ``torch.autocast``'s dtype is: a thread that enters no autocast runs its
layers in high precision whatever other threads do, and a new thread starts outside any autocast. A backward
casts with the recipe its forward ran under (the autograd function keeps the forward's quantizers), on whichever
thread autograd runs it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from lowprec.errors import LowprecTypeError
from lowprec.recipe import RECIPES, DelayedScaling, Recipe


@dataclass(frozen=True)
class AutocastState:
    enabled: bool = False
    recipe: Recipe | None = None


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
    """The recipe this thread's layers should quantize with now, or None for high precision."""
    state = _thread.current
    return state.recipe if state.enabled else None


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
def autocast(enabled: bool = True, recipe: Recipe | None = None) -> Iterator[None]:
    """Run ``lowprec`` layers inside the block in FP8 with ``recipe`` (default: delayed scaling, HYBRID).

    ``enabled=False`` runs them in high precision, also inside an enclosing autocast. It holds on this thread only
    (as ``torch.autocast``): other threads keep their own.
    """
    if not isinstance(enabled, bool):
        raise LowprecTypeError(f"autocast(enabled=...) must be a bool, got {enabled!r}")
    outer, _thread.current = _thread.current, AutocastState(enabled, checked_recipe(recipe))
    at_exit = _entry_watch() if enabled and _entry_watch is not None else None
    try:
        yield
    finally:
        _thread.current = outer
        if at_exit is not None:
            at_exit()


@contextmanager
def fp8_autocast(enabled: bool = True, fp8_recipe: Recipe | None = None) -> Iterator[None]:
    """The seeds' spelling of :func:`autocast`."""
    with autocast(enabled=enabled, recipe=fp8_recipe):
        yield
