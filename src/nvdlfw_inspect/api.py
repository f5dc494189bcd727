"""The user-facing debug API, imported as ``import nvdlfw_inspect.api as debug_api``.

Besides the functions below, attribute access dispatches to namespaces: ``debug_api.<namespace>.<api>(...)``
and, for APIs of the base namespace, ``debug_api.<api>(layer_name, ...)``.

The calls a training step makes (``step``, ``log_tensor_stats``, ``log_message``, ``log_routing``, and a framework's
layers inside ``held``) may race an ``end_debug()`` on another thread: each reads the session once, and either
completes against it (``end_debug`` waits for it) or behaves as before ``initialize``.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import sys
from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch

from nvdlfw_inspect.config_manager import ConfigManager
from nvdlfw_inspect.debug_manager import DebugManager, held
from nvdlfw_inspect.distributed import get_distributed_world_size
from nvdlfw_inspect.errors import AlreadyInitializedError, NotInitializedError, is_int
from nvdlfw_inspect.explain import feature_matches, plain_text, suggestion
from nvdlfw_inspect.logging import (
    MetricLogger,
    close_logger,
    get_logger,
    initialize_logger,
    print_rank_0,
    print_warning,
    routing_record,
    say_once,
)
from nvdlfw_inspect.registry import Registry
from nvdlfw_inspect.section_coverage import warn_sections_selecting_none_of
from nvdlfw_inspect.stats.buffers import STATS_BUFFERS
from nvdlfw_inspect.utils import APICacheIdentifier, SingleMessageLogger

DEBUG_MANAGER: DebugManager | None = None

_NOT_INITIALIZED = "[NVDLFW INSPECT ERROR] Debug manager not initialized. Call initialize first."
_EXPLAIN_HELP = (
    "Can pass a list of features or feature string to this method. use list_features() method to get the "
    'feature names or pass "all" string to this method for all features'
)
# Built-in APIs a training step calls besides step(): before initialize they do nothing (one warning), as step() does
_STEP_APIS = frozenset({"log_tensor_stats"})
_ACCEPTED_KWARGS = ("tb_writer", "default_logging_enabled", "extensions", "strict_logging", "collective_timeout")


def initialize(
    config_file: Any = "",
    feature_dirs: Any = None,
    statistics_logger: Any = None,
    log_dir: Any = ".",
    init_training_step: int = 0,
    **kwargs: Any,
) -> None:
    """Load features and config and open the logs; call once per rank before building debuggable layers.

    Keyword arguments: ``tb_writer`` (a TensorBoard SummaryWriter for statistics) and
    ``default_logging_enabled`` (also write statistics to the file log when another logger is given),
    ``strict_logging`` (a log write error such as a full disk raises ``OSError`` instead of being counted),
    ``collective_timeout`` (seconds each collective of ``step()`` waits for the other ranks before raising
    ``DistributedDesyncError`` naming those that did not answer; default None: torch's default process group timeout,
    30 minutes; the statistics are reduced on a gloo group of the tool's own, see ``docs/statistics.md``).
    Other keywords are ignored with one warning naming them. A failure leaves the process as if ``initialize``
    had never been called.
    """
    global DEBUG_MANAGER
    if DEBUG_MANAGER is not None:
        raise AlreadyInitializedError("[NVDLFW INSPECT ERROR] Already initialized. Call end_debug() before initializing again.")
    try:
        initialize_logger(log_dir, strict=kwargs.get("strict_logging", False))
        _warn_unknown_kwargs(kwargs)
        if "extensions" in kwargs:
            get_logger().log_message(
                "initialize(extensions=...) is accepted for compatibility and has no effect.", logging.WARNING
            )
        manager = DebugManager(
            config_file,
            feature_dirs=feature_dirs,
            statistics_logger=statistics_logger,
            init_training_step=init_training_step,
            tb_writer=kwargs.get("tb_writer"),
            default_logging_enabled=bool(kwargs.get("default_logging_enabled", False)),
            collective_timeout=kwargs.get("collective_timeout"),
        )
        manager.load_config()
        manager.start()
    except BaseException as error:
        if not isinstance(error, KeyboardInterrupt):
            _log_failure(error)
        _reset_process_state()
        raise
    DEBUG_MANAGER = manager
    atexit.register(_end_debug_at_exit)


def _warn_unknown_kwargs(kwargs: dict[str, Any]) -> None:
    """One warning naming the keywords this implementation does not know. Callers written for other versions
    (NeMo passes ``multi_tensor_stat_collection=``) must still start; a typo shows up in the warning."""
    unknown = sorted(set(kwargs) - set(_ACCEPTED_KWARGS))
    if unknown:
        get_logger().log_message(
            f"initialize() ignores unknown keyword arguments {unknown}; known: {list(_ACCEPTED_KWARGS)}", logging.WARNING
        )


def _log_failure(error: BaseException) -> None:
    """The error in the debug log, with its notes (the other errors of an invalid config)."""
    notes = "".join(f"\n{note}" for note in getattr(error, "__notes__", ()))
    try:
        get_logger().log_message(f"initialize failed: {type(error).__name__}: {error}{notes}", logging.ERROR)
    except (RuntimeError, OSError):  # no log, or it cannot be written (strict_logging): the error is raised anyway
        pass


def _reset_process_state() -> None:
    """Everything is reset even when a statistics logger's flush raises (``strict_logging``); its error comes after."""
    try:
        MetricLogger.reset()
    finally:
        Registry.reset()
        ConfigManager.reset()
        SingleMessageLogger.reset()
        APICacheIdentifier.reset()
        close_logger()


def step() -> None:
    """Advance the iteration counter by one, log the finished iteration's statistics (reduced over ranks)
    and let every namespace flush its per-step work. Raises ``DistributedDesyncError`` when the ranks of a
    reduction group are at different iterations or do not answer within ``collective_timeout``."""
    manager = DEBUG_MANAGER
    if manager is not None:
        manager.step()


def initialize_training_step(train_step: int) -> None:
    """Set the iteration counter, e.g. when resuming from a checkpoint (does not replace ``step``)."""
    manager = DEBUG_MANAGER
    if manager is not None:
        if not is_int(train_step) or train_step < 0:
            raise ValueError(f"train_step must be a non-negative integer, got {train_step!r}")
        manager.set_iteration(train_step)


def end_debug() -> None:
    """Close the run: namespace hooks, logs, registry, config, caches; ``initialize`` may then run again."""
    global DEBUG_MANAGER
    manager = DEBUG_MANAGER
    if manager is None:
        return
    try:
        manager.close()  # first waits for the calls of other threads under way, and refuses new ones
    finally:
        try:
            DEBUG_MANAGER = None
            atexit.unregister(_end_debug_at_exit)
            _reset_process_state()
        finally:
            manager.calls.end()


def run_poisoned() -> str | None:
    """The first non-finite tensor this run computed (``NonfiniteGuard``), as its message; None if none was, or
    before ``initialize``. A checkpoint saved after it keeps the poisoned state."""
    manager = DEBUG_MANAGER
    if manager is None or manager.poisoned is None:
        return None
    return str(manager.poisoned)


def guard_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Wrap ``optimizer.step`` so that it first reads ``NonfiniteGuard``'s flags of the step (the step's one host
    read; ``debug_api.step()`` then reuses it): when a GEMM tensor was NaN or inf, the update is skipped, the weights
    stay as they were, and ``NonFiniteError`` is raised (``on_nonfinite: raise``) or a warning given (``warn``).
    Returns the optimizer itself."""
    original = optimizer.step

    @functools.wraps(original)
    def step(*args: Any, **kwargs: Any) -> Any:
        manager = DEBUG_MANAGER
        verdict = manager.nonfinite() if manager is not None else None
        if verdict is None:
            return original(*args, **kwargs)
        get_logger().log_message(f"guard_optimizer: skipped the optimizer step of step {verdict[0].step}", logging.WARNING)
        manager.raise_nonfinite(verdict, verdict[0].step)
        return None

    optimizer.step = step
    return optimizer


@contextmanager
def paused() -> Iterator[None]:
    """Pause inspection for the block, e.g. around an evaluation run between training steps, whose forwards would
    otherwise be merged into the next step's statistics.

    Inside, no statistic is recorded, no tensor is dumped and nothing is added to the step (``log_tensor_stats``
    returns ``{}``); features that steer precision or modify tensors keep applying, so the model computes as in
    training. The iteration counter is untouched. Blocks nest; the pause ends with the outermost, also when it
    raises. It holds in every thread (a backward runs in autograd's threads); a ``lowprec`` layer decides at its
    forward, so the backward of a forward run paused is not inspected either. Before ``initialize`` it does nothing.
    """
    manager = DEBUG_MANAGER
    if manager is None:
        yield
        return
    manager.pause()
    try:
        yield
    finally:
        manager.resume()  # the manager it paused, even if end_debug() and initialize() ran inside the block


def _end_debug_at_exit() -> None:
    """``end_debug`` for a program that exits without it (``sys.exit``, an uncaught exception), so the unfinished
    step reaches the log. A multi-rank run drops that step: logging it reduces over the ranks, and a rank that
    failed alone would wait at exit for ranks that never join instead of exiting. A child of ``os.fork()`` leaves
    the run to its parent. Never raises at exit."""
    if DEBUG_MANAGER is not None and DEBUG_MANAGER.owner_pid != os.getpid():
        return  # a child of os.fork() exiting: the run, its loggers and its unfinished step are the parent's
    try:
        if DEBUG_MANAGER is not None and get_distributed_world_size() > 1:
            STATS_BUFFERS.reset()
            get_logger().log_message(
                "Exit without end_debug(): the unfinished step is not logged in a multi-rank run (call end_debug() on "
                "every rank to log it).",
                logging.WARNING,
            )
        end_debug()
    except Exception as error:
        print_warning(f"could not close the debug run at exit: {type(error).__name__}: {error}")


def _require_manager() -> DebugManager:
    manager = DEBUG_MANAGER
    if manager is None:
        raise NotInitializedError(_NOT_INITIALIZED)
    return manager


def log_message(
    msg: str,
    layer_name: str | None = None,
    level: int = logging.INFO,
    extra_cachable_args: Hashable = None,
) -> None:
    """Write ``msg`` to the debug log once per call site, layer, ``extra_cachable_args`` and message text."""
    with held(DEBUG_MANAGER) as open_:
        if not open_:
            raise NotInitializedError(_NOT_INITIALIZED)
        frame = sys._getframe(1)
        site = f"{frame.f_code.co_filename}.{frame.f_lineno}"
        del frame
        SingleMessageLogger.log_message_once(msg, layer_name, level, extra_cachable_args, call_site=site)


def log_routing(
    *,
    layer: str,
    gemm: str,
    tensor: str,
    decision: str,
    feature: str | None,
    recipe: bool,
    iteration: int,
    reason: str | None = None,
    format: str | None = None,
    recipe_spec: dict[str, Any] | None = None,
    plan_rule: str | None = None,
) -> None:
    """Record a routing decision: from ``iteration`` on, ``gemm`` (fprop, dgrad, wgrad) of ``layer`` reads
    ``tensor`` as ``decision`` says (``fp8``: the recipe's quantized operand, ``high_precision``: unquantized,
    ``modified``: a feature's ``modify_tensor`` output); ``feature`` names the feature that decided (None: the
    default), ``recipe`` whether a recipe was active, ``reason`` why a GEMM the framework does not run (a module
    left unconverted) is in that precision, ``format`` the format the GEMM's recipe reads the tensor in (a recipe's
    statistics name: ``mxfp8``, ``nvfp4``, ...; layers under a precision plan differ in it), ``recipe_spec`` that recipe
    with its options (a precision plan's recipe spec: ``{"name": "NVFP4BlockScaling", "disable_rht": true}``) and
    ``plan_rule`` the name of the precision plan rule that chose it (``diagnose`` judges its own rules by it). One JSON line in
    ``{log_dir}/nvdlfw_inspect_routing_jsonl/routing_globalrank-{rank}.jsonl``, written where the statistics records
    are; a framework calls this when a decision changes. Arguments are checked (``ValueError``, ``TypeError``);
    before ``initialize`` nothing is written."""
    record = routing_record(layer, gemm, tensor, decision, feature, recipe, iteration, reason, format, recipe_spec, plan_rule)
    with held(DEBUG_MANAGER) as open_:
        if open_:
            get_logger().log_routing(record)


def list_features() -> list[str]:
    """Print and return every loaded feature as ``namespace.Feature``."""
    names = list(_require_manager()._features_explainer)
    print_rank_0(names)
    return names


def explain_features(features: Any = None) -> None:
    """Print the documentation of one feature, a list of them, or ``"all"``. A feature is ``"ns.Feature"``
    or a bare ``"Feature"``, which explains the feature of that name of every namespace that has one."""
    explainer = _require_manager()._features_explainer
    if features is None:
        print_rank_0("No feature provided.", _EXPLAIN_HELP)
        return
    if isinstance(features, str):
        features = [features]
    elif not isinstance(features, list):
        print_rank_0("Invalid type is provided to the features argument.", _EXPLAIN_HELP)
        return
    for name in features:
        matches = feature_matches(name, explainer) if isinstance(name, str) else []
        if not matches:
            hint = suggestion(str(name), explainer)
            print_rank_0(
                f"feature: {name} is not supported in this tool.", _EXPLAIN_HELP + (f". Did you mean '{hint}'?" if hint else "")
            )
        for match in matches:
            print_rank_0("-----")
            print_rank_0(f"feature: {match}")
            print_rank_0(plain_text(explainer[match].__doc__))
            print_rank_0("*****")


def infer_and_assign_layer_names(model: torch.nn.Module | list) -> None:
    """Set ``module.name`` on every module: ``model``, ``model.<child>``, list items by ``layer_number`` or index.

    Then warn about each config section that selects none of the names. A module that calls the debug API
    under other names (``lowprec.LayerNormMLP``: ``<name>.fc1``, ``<name>.fc2``), or has types that
    ``layer_types`` selectors match, says so with a method ``debug_layers()`` returning ``(name, types)`` pairs;
    the types are declared with ``ConfigManager.set_layer_types``.
    """
    models = model if isinstance(model, list) else [model]
    named: list[torch.nn.Module] = []
    for item in models:
        _assign_names(item, "model", named)
    layers = _debug_layers(named)
    for name, types in layers.items():
        if types:
            ConfigManager.set_layer_types(name, *types)
    if DEBUG_MANAGER is not None:
        warn_sections_selecting_none_of(layers)


def _assign_names(obj: Any, prefix: str, named: list[torch.nn.Module]) -> None:
    if isinstance(obj, torch.nn.ModuleList):
        for index, child in enumerate(obj):
            _assign_names(child, f"{prefix}.{getattr(child, 'layer_number', index)}", named)
        return
    if isinstance(obj, torch.nn.Module):
        obj.name = prefix
        named.append(obj)
        if DEBUG_MANAGER is not None:
            get_logger().log_message(f"Assigned layer name: {prefix}")
        for child_name, child in obj.named_children():
            _assign_names(child, f"{prefix}.{child_name}", named)
        return
    inner = getattr(obj, "module", None)
    if inner is None:
        raise TypeError(f"cannot name layers of {type(obj).__name__}: it is not an nn.Module and has no .module")
    _assign_names(inner, prefix, named)


def _debug_layers(modules: list[torch.nn.Module]) -> dict[str, tuple[str, ...]]:
    """Every name the named modules may call the debug API with, and the types each declares."""
    layers: dict[str, tuple[str, ...]] = {}
    for module in modules:
        layers.setdefault(module.name, ())
        debug_layers = getattr(module, "debug_layers", None)
        if callable(debug_layers):
            layers.update((name, tuple(types)) for name, types in debug_layers())
    return layers


def set_tensor_reduction_group(group: Any, layer_name: str | None = None) -> None:
    """Reduce statistics over ``group`` before logging (override per call with ``reduction_group=``)."""
    _require_manager()._tensor_reduction_group = group
    log_message(
        "Reduction group initialized for tensor reduction before logging statistics. If per-rank statistics are "
        "required, pass `skip_reduction=True` when invoking the API. To pass another reduction group, use "
        "`reduction_group` kwarg when invoking the API.",
        level=logging.WARNING,
    )


def get_tensor_reduction_group() -> Any:
    return _require_manager()._tensor_reduction_group


def _before_initialize(name: str) -> dict:
    """A statistics call of a training step before ``initialize``: a script whose debugging is optional makes it
    unconditionally, as it calls ``step()``; it logs nothing, and says so once per API (a forgotten
    ``initialize`` is not silent)."""
    say_once(
        f"debug_api.{name}() before debug_api.initialize() logs nothing and returns {{}} (a run without debugging "
        "may make these calls); call debug_api.initialize(...) first to log statistics",
        call_site=__name__,
    )
    return {}


def _step_api(manager: DebugManager | None, name: str, *args: Any, **kwargs: Any) -> Any:
    """A statistics call of a training step against ``manager``'s session, or as before ``initialize`` without one
    (none, or ``end_debug()`` begun on another thread meanwhile)."""
    with held(manager) as open_:
        if open_:
            return manager.get_extension_api(name)(*args, **kwargs)
    if manager is not None:
        manager.calls.wait_ended()  # refused by an end_debug() under way: as after it
    return _before_initialize(name)


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    manager = DEBUG_MANAGER
    if name in _STEP_APIS:
        if manager is not None:
            APICacheIdentifier.save_call_details()
        return partial(_step_api, manager, name)
    if manager is None:
        raise NotInitializedError(_NOT_INITIALIZED)
    APICacheIdentifier.save_call_details()
    return manager.get_extension_api(name)
