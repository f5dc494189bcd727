"""What every training-loop integration does, in the order a training needs it.

``start``: ``debug_api.initialize`` from the config, optionally ``lowprec.convert``, names for the layers of the
user's own model (wrappers removed), and the model's training entry wrapped so that training forwards run under
``lowprec.autocast`` (its recipe and precision plan) and evaluation forwards (the module in eval mode) under the same
autocast inside ``debug_api.paused()``. ``step``: ``debug_api.step()``, called by the integration once per optimizer
step. ``end``: the wrapping undone and ``debug_api.end_debug()``, also after a failed training; calling it twice is
harmless.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from typing import Any

import torch

import nvdlfw_inspect.api as debug_api
from lowprec.autocast import autocast, checked_recipe
from lowprec.errors import LowprecTypeError, LowprecValueError
from lowprec.modules.convert import convert_with_report
from lowprec.plan import PrecisionPlan, load_plan
from lowprec.recipe import Recipe
from nvdlfw_inspect.errors import PoisonedCheckpointError
from nvdlfw_inspect.logging import say_once

# Wrappers that keep the user's model in ``.module``; matched by class name where importing the library would
# cost (DeepSpeed) or where torch has several (FSDP's).
_MODULE_WRAPPERS = frozenset({"DistributedDataParallel", "DataParallel", "FullyShardedDataParallel", "DeepSpeedEngine"})


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's own model inside ``model``: without DDP, DataParallel, FSDP (1) or DeepSpeed (``.module``),
    ``torch.compile`` (``._orig_mod``) and PEFT (``get_base_model()``), however they are nested. Its layer names
    are then those a plain training loop gets from ``debug_api.infer_and_assign_layer_names(model)``."""
    while True:
        if type(model).__name__ in _MODULE_WRAPPERS and isinstance(getattr(model, "module", None), torch.nn.Module):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):
            model = model._orig_mod
        elif callable(getattr(model, "get_base_model", None)) and type(model).__module__.startswith("peft."):
            model = model.get_base_model()
        else:
            return model


class DebugSession:
    """One debug run over one training (see the module docstring); the integrations hold one each.

    ``config_file``: the YAML config (a path, or a dict); ``feature_dirs``, ``log_dir`` and ``initialize_kwargs``
    (``statistics_logger``, ``tb_writer``, ...) go to ``debug_api.initialize``. ``recipe``: the ``lowprec`` recipe
    of the training forwards (None: ``lowprec.autocast``'s default, delayed scaling); ``fp8=False`` trains in high
    precision and still collects statistics. ``plan``: a precision plan (a YAML file's path, a mapping or a
    ``lowprec.plan.PrecisionPlan``; a debug config holding a ``precision_plan:`` key serves too) that gives the layers
    its rules select their own recipes, per GEMM and for evaluation forwards (``lowprec.autocast(plan=...)``); the
    others run ``recipe`` (with ``fp8=False``, high precision). It is read here, so that a bad plan fails before any
    training, with the ``ConfigError`` naming its key and value. ``convert=True`` converts the model's ``nn.Linear``
    layers with ``lowprec.convert`` at start (they share their Parameters, so the optimizer keeps training them); by
    default the model is used as given. ``allow_poisoned_checkpoint=True`` lets the integrations save checkpoints after
    a step computed NaN or inf (``NonfiniteGuard``, ``debug_api.run_poisoned()``); by default they refuse
    (``check_checkpoint``).
    """

    def __init__(
        self,
        config_file: str | os.PathLike | dict,
        *,
        feature_dirs: Any = None,
        log_dir: str | os.PathLike = ".",
        recipe: Recipe | None = None,
        fp8: bool = True,
        plan: str | os.PathLike | Mapping | PrecisionPlan | None = None,
        convert: bool = False,
        allow_poisoned_checkpoint: bool = False,
        **initialize_kwargs: Any,
    ):
        if not isinstance(config_file, (str, os.PathLike, dict)):
            raise LowprecTypeError(f"config_file must be the path of a YAML config (or a dict), got {config_file!r}")
        if config_file == "":
            raise LowprecValueError("config_file is empty: give the path of a YAML config (or a dict) saying what to inspect")
        if "init_training_step" in initialize_kwargs:
            raise LowprecTypeError(
                "init_training_step is set by the integration: the Trainer callbacks count iterations from the training's "
                "own global step (a resumed training logs at its own steps); accelerate's DebugRun takes it as an argument"
            )
        for name, value in (("fp8", fp8), ("convert", convert), ("allow_poisoned_checkpoint", allow_poisoned_checkpoint)):
            if not isinstance(value, bool):
                raise LowprecTypeError(f"{name} must be a bool, got {value!r}")
        self.recipe = checked_recipe(recipe, "recipe")
        self.fp8 = fp8
        self.plan = None if plan is None else load_plan(plan)
        self.convert = convert
        self.allow_poisoned_checkpoint = allow_poisoned_checkpoint
        self.poisoned: str | None = None  # the run's first non-finite tensor, kept after end() for a final save
        self._initialize_args = {"config_file": config_file, "feature_dirs": feature_dirs, "log_dir": log_dir}
        self._initialize_kwargs = initialize_kwargs
        self._restore: list[Callable[[], None]] = []
        self.active = False

    def start(
        self,
        model: torch.nn.Module,
        entries: tuple[str, ...] = ("forward",),
        named: torch.nn.Module | None = None,
        init_training_step: int = 0,
    ) -> None:
        """Open the run for ``model`` (as the training loop holds it, wrappers included): initialize, convert if
        asked, name the layers of ``unwrap(named)`` (default: of ``model``) and wrap ``model``'s methods ``entries``
        (see ``wrap``). A run this session left open (a training that raised without ``end``) is ended first."""
        if not isinstance(model, torch.nn.Module):
            raise LowprecTypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if self.active:
            say_once("the previous training's debug run was not ended (it raised?): ended it before starting this one")
            self.end()
        debug_api.initialize(init_training_step=init_training_step, **self._initialize_args, **self._initialize_kwargs)
        self.active = True
        try:
            named = unwrap(model if named is None else named)
            if self.convert:
                report = convert_with_report(named)
                if report.model is not named:
                    raise LowprecValueError(
                        f"convert=True cannot convert a bare {type(named).__name__} in place: convert it with "
                        "lowprec.convert(model) before training, and pass the model it returns"
                    )
            debug_api.infer_and_assign_layer_names(named)
            for entry in entries:
                self.wrap(model, entry)
        except BaseException:
            self.end()
            raise

    def wrap(self, module: torch.nn.Module, entry: str) -> None:
        """Run ``module.<entry>`` inside ``context(module.training)`` until ``end``: its own method (or what another
        library set on the instance, such as accelerate's mixed-precision forward) is called inside."""
        original = getattr(module, entry)
        previous = vars(module).get(entry)

        @functools.wraps(original)  # the signature stays visible (the Trainer reads forward's to pick dataset columns)
        def in_context(*args: Any, **kwargs: Any) -> Any:
            with self.context(module.training):
                return original(*args, **kwargs)

        setattr(module, entry, in_context)

        def restore() -> None:
            if vars(module).get(entry) is not in_context:
                return  # replaced since by someone else, who owns it now
            if previous is None:
                delattr(module, entry)
            else:
                setattr(module, entry, previous)

        self._restore.append(restore)

    @contextmanager
    def context(self, training: bool) -> Iterator[None]:
        """The recipe and precision plan of the run; outside training (an evaluation) also ``debug_api.paused()``, so
        that evaluation computes as training does (or as the plan says evaluation forwards do) and adds nothing to the
        statistics."""
        with ExitStack() as stack:
            stack.enter_context(autocast(enabled=self.fp8, recipe=self.recipe, plan=self.plan))
            if not training:
                stack.enter_context(debug_api.paused())
            yield

    def step(self) -> None:
        """One optimizer step done: log its statistics (``debug_api.step()``)."""
        if self.active:
            try:
                debug_api.step()
            finally:
                self.poisoned = self.poisoned or debug_api.run_poisoned()

    def check_checkpoint(self) -> None:
        """Before a checkpoint is saved: refuse (``PoisonedCheckpointError``) when a step of this run computed NaN or
        inf, unless ``allow_poisoned_checkpoint``; the saved state would carry the poison."""
        poisoned = self.poisoned or debug_api.run_poisoned()
        if poisoned is not None and not self.allow_poisoned_checkpoint:
            raise PoisonedCheckpointError(
                f"refusing to save a checkpoint of a poisoned run: {poisoned}. Pass allow_poisoned_checkpoint=True to "
                "the integration to save it anyway"
            )

    def end(self) -> None:
        """Undo the wrapping and close the run (``debug_api.end_debug()``); nothing when no run is open."""
        if not self.active:
            return
        try:
            while self._restore:
                self._restore.pop()()
        finally:
            self.active = False
            debug_api.end_debug()
