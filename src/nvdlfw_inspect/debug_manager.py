"""The one object that owns a debug run: loaded namespaces, config, statistics loggers and step counter."""

from __future__ import annotations

import logging
import math
import os
import threading
import warnings
from functools import partial
from typing import Any

from nvdlfw_inspect.config_manager import BASE_NAMESPACE, ConfigManager
from nvdlfw_inspect.errors import NonFiniteError, UnknownAPIError, closest, is_int, is_number
from nvdlfw_inspect.feature_loading import load_feature_dirs, normalize_feature_dirs
from nvdlfw_inspect.logging import (
    ENV_OVERWRITE,
    BaseLogger,
    MetricLogger,
    get_logger,
    make_default_statistics_logger,
    say_once,
    wrap_tensorboard_writer,
)
from nvdlfw_inspect.registry import Registry
from nvdlfw_inspect.section_coverage import warn_features_in_namespaces_not_called, warn_sections_never_matched
from nvdlfw_inspect.stats.buffers import STATS_BUFFERS
from nvdlfw_inspect.step_watch import StepWatch

CALLS_DRAIN_S = 60.0
"""How long ``end_debug()`` waits for the calls of other threads still under way in the session it closes."""


class SessionCalls:
    """The calls into one debug session under way, per thread: ``with held(manager) as open_:`` around each. ``close``
    refuses new ones from then on and waits for those of other threads, so that each call either completes against
    the session or sees none, as before ``initialize``. A thread already inside a call may call again (a feature
    logging a message).

    A call takes no lock: each thread writes only its own entry of ``_depth``, before it reads ``_closing``, and
    ``close`` sets ``_closing`` before it reads ``_depth``; under the GIL one of the two sees the other (a call is
    either waited for or refused). Only a call ending while the session closes takes the lock, to wake ``close``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._drained = threading.Condition(self._lock)
        self._depth: dict[int, int] = {}  # thread -> calls under way on it (none: no entry)
        self._closing = False
        self._closer: int | None = None  # the thread running end_debug()
        self._ended = threading.Event()  # end_debug() has returned the process to its state before initialize

    def __enter__(self) -> bool:
        """Start a call on this thread; False (nothing started) once the session is closing."""
        thread = threading.get_ident()
        depth = self._depth.get(thread, 0)
        self._depth[thread] = depth + 1  # first: a close that has not seen it yet sees _closing set below
        if self._closing and depth == 0:
            self._leave(thread, 0)
            return False
        return True

    def __exit__(self, *exc_info: object) -> None:
        thread = threading.get_ident()
        depth = self._depth.get(thread)
        if depth is not None:  # else refused: nothing started
            self._leave(thread, depth - 1)

    def _leave(self, thread: int, depth: int) -> None:
        if depth:
            self._depth[thread] = depth
            return
        del self._depth[thread]
        if self._closing:
            with self._lock:
                self._drained.notify_all()

    def close(self, timeout: float) -> int:
        """Refuse new calls, wait up to ``timeout`` seconds for other threads' calls to end; how many threads are
        still inside one (this thread's own calls, as in a signal handler, cannot be waited for)."""
        me = threading.get_ident()
        with self._lock:
            self._closing, self._closer = True, me
            self._drained.wait_for(lambda: self._depth.keys() <= {me}, timeout)
            return len(self._depth.keys() - {me})

    def end(self) -> None:
        """``end_debug()`` has finished: the calls that ``wait_ended`` go on, as after it."""
        self._ended.set()

    def wait_ended(self) -> None:
        """A call refused while ``end_debug()`` runs on another thread waits (at most ``CALLS_DRAIN_S``) until it has
        finished, so that what the call then does before ``initialize`` (say so once) meets no half-closed log."""
        if threading.get_ident() != self._closer:
            self._ended.wait(CALLS_DRAIN_S)


class _NoSession:
    """``held(None)``: no session to run the block in."""

    def __enter__(self) -> bool:
        return False

    def __exit__(self, *exc_info: object) -> None:
        pass


_NO_SESSION = _NoSession()


def held(manager: DebugManager | None) -> SessionCalls | _NoSession:
    """``with held(manager) as open_:`` runs the block inside ``manager``'s session: an ``end_debug()`` on another
    thread waits for it to end. ``open_`` is False without a session (``manager`` None, or its ``end_debug()`` has
    begun): the block then does what it does before ``initialize``."""
    return _NO_SESSION if manager is None else manager.calls


class DebugManager:
    """Built by ``debug_api.initialize``; ``close`` undoes everything it set up."""

    def __init__(
        self,
        config_file: Any,
        feature_dirs: Any = None,
        statistics_logger: BaseLogger | None = None,
        init_training_step: int = 0,
        tb_writer: Any = None,
        default_logging_enabled: bool = False,
        collective_timeout: float | None = None,
    ):
        if not is_int(init_training_step) or init_training_step < 0:
            raise ValueError(f"init_training_step must be a non-negative integer, got {init_training_step!r}")
        self.collective_timeout = _checked_timeout(collective_timeout)
        self.log_dir = get_logger().log_dir  # absolute, fixed at initialize
        self.config_file = config_file
        self._trainer_iteration_count = init_training_step
        # step, close and set_iteration: the counter and the flush in one piece. Reentrant, for a signal handler
        # (preemption) that calls end_debug while its thread is inside step(); _stepping names that thread.
        self._step_lock = threading.RLock()
        self._stepping: int | None = None
        self._closed = False
        self.owner_pid = os.getpid()  # a fork's child inherits the run, but its steps are the parent's to log
        self._tensor_reduction_group: Any = None
        self._first_step_done = False
        self._pauses = 0  # debug_api.paused() blocks open now, in any thread
        self._pause_lock = threading.Lock()
        self.calls = SessionCalls()  # held by each call that must complete against the session (``held``)
        self._initialize_loggers(statistics_logger, tb_writer, default_logging_enabled)
        self._load_namespace_apis_and_features(normalize_feature_dirs(feature_dirs))
        self._step_watch: StepWatch | None = None  # from ``start``: a failed initialize leaves no hook behind
        # NonfiniteGuard where the config enables it (``start``): verdict(step, group) -> (NonFiniteError, mode) or None;
        # reset()
        self.guard: Any = None
        self._verdict: tuple[int, tuple[NonFiniteError, str] | None] | None = None  # (step, verdict) read this step
        self._raised_at: int | None = None  # the step whose NonFiniteError was raised already
        self.poisoned: NonFiniteError | None = None  # the run's first non-finite step

    def _initialize_loggers(self, statistics_logger: Any, tb_writer: Any, default_logging_enabled: bool) -> None:
        logger = get_logger()
        if statistics_logger is not None:
            if not isinstance(statistics_logger, BaseLogger):
                raise TypeError(
                    "statistics_logger must be an instance of nvdlfw_inspect.logging.BaseLogger (implement "
                    f"log_scalar(name, value, iteration)), got {type(statistics_logger).__name__}"
                )
            logger.log_message("Using the provided logger for logging tensor statistics.")
            MetricLogger.add_logger(statistics_logger)
            if tb_writer is not None:
                logger.log_message("Both statistics_logger and tb_writer given: logging statistics to both.")
        if tb_writer is not None:
            if not callable(getattr(tb_writer, "add_scalar", None)):
                raise TypeError(f"tb_writer must have an add_scalar method (a SummaryWriter), got {type(tb_writer).__name__}")
            logger.log_message("TB Writer found. Logging to Tensorboard..")
            MetricLogger.add_logger(wrap_tensorboard_writer(tb_writer))
        if default_logging_enabled or not MetricLogger.enabled_loggers:
            logger.log_message(f"Default logging to file enabled at {self.log_dir}")
            MetricLogger.add_logger(make_default_statistics_logger())
        overwritten = ", ".join(os.path.relpath(path, self.log_dir) for path in logger.overwritten_logs())
        if overwritten:
            say_once(
                f"overwrote the logs of an earlier run in {self.log_dir}: {overwritten}. To keep them, set "
                f"{ENV_OVERWRITE}=0 (append to them) or give each run its own log_dir.",
                call_site=__name__,
            )

    def _load_namespace_apis_and_features(self, feature_dirs: list) -> None:
        Registry.add_tagged(load_feature_dirs(feature_dirs))
        Registry.validate_and_init()
        self._features_explainer = {
            f"{ns}.{name}": feature for ns, data in Registry.data.items() for name, feature in data.features.items()
        }
        self._namespace_features_api_map = {ns: data.feat_api_to_features for ns, data in Registry.data.items()}
        self._namespace_apis = {ns: data.api for ns, data in Registry.data.items()}
        self._build_dispatch_table()
        for ns, data in Registry.data.items():
            get_logger().log_message(f"Registered {ns} namespace with features {sorted(data.features)}.", logging.DEBUG)

    def start(self) -> None:
        """The session runs (its config is loaded): watch for training steps that ``step()`` does not separate; find
        the guard."""
        self._step_watch = StepWatch(lambda: self._trainer_iteration_count, STATS_BUFFERS.fed)
        self.guard = self._configured_guard()

    @staticmethod
    def _configured_guard() -> Any:
        """The feature with a ``verdict`` (``NonfiniteGuard``) that a config section enables, if one does. Found from
        the config, which every rank loads alike, not from the tensors a rank's layers gave it: every rank of a
        reduction group then takes part in the verdict's reduction, one none of whose layers the guard selects too."""
        for namespace, name, _ in ConfigManager.enabled_features():
            feature = Registry.data[namespace].features.get(name) if namespace in Registry.data else None
            if callable(getattr(feature, "verdict", None)):
                return feature
        return None

    def load_config(self) -> None:
        logger = get_logger()
        if self.config_file is None or self.config_file == "":
            logger.log_message("No config given: no feature is active.", logging.WARNING)
            return
        if isinstance(self.config_file, dict):
            logger.log_message("Reading config from Python dictionary.")
        else:
            logger.log_message(f"Reading config from {self.config_file}.")
        ConfigManager.load_config(self.config_file, Registry.data, Registry.unusable)
        for warning in ConfigManager.warnings:
            say_once(warning, call_site="config")
        logger.log_message(f"Loaded configs for dict_keys({ConfigManager.section_names}).")

    def _build_dispatch_table(self) -> None:
        """Map every name ``debug_api.<name>`` may resolve to: base APIs first, then namespaces."""
        self._dispatch: dict[str, Any] = dict(self._namespace_apis)
        base = self._namespace_apis.get(BASE_NAMESPACE)
        if base is not None:
            for api_name in base.api_names():
                self._dispatch[api_name] = partial(base.route_api, api_name=api_name)

    def get_extension_api(self, name: str) -> Any:
        """A base-namespace API router for ``name``, else the namespace API object called ``name``."""
        found = self._dispatch.get(name)
        if found is not None:
            return found
        known = sorted(self._dispatch)
        hint = closest(name, known)
        get_logger().log_message(f"API for {name} not found.", logging.ERROR)
        raise UnknownAPIError(
            f"debug_api has no namespace or base API named '{name}'; known: {known}"
            + (f"; did you mean '{hint}'?" if hint else "")
        )

    def step(self) -> None:
        """Advance the counter, then log the finished iteration's statistics and step the namespaces.
        Counting first makes a call of another thread that starts meanwhile part of the next iteration.
        A ``DistributedDesyncError`` comes after all of it, so a caller that catches it can go on. The first
        step ends with a warning about each config section that no layer matched, and each whose features are in
        a namespace its layers do not call."""
        with self._step_lock:
            if self._closed:  # a step racing end_debug() on another thread: as before initialize, nothing
                return
            finished = self._trainer_iteration_count
            verdict = self.nonfinite()
            self._end_guard_step()
            self._trainer_iteration_count += 1
            if self._step_watch is not None:
                self._step_watch.debug_step()
            self._stepping = threading.get_ident()
            try:
                STATS_BUFFERS.flush(step=finished, timeout=self.collective_timeout)
            finally:
                self._stepping = None
                if not self._closed:  # else end_debug ran inside this step (a signal handler): nothing to step
                    self._step_namespaces()
            self.raise_nonfinite(verdict, finished)

    def nonfinite(self) -> tuple[NonFiniteError, str] | None:
        """The step under way's first non-finite tensor and its ``on_nonfinite`` mode, read from the device once per
        step (later calls answer from that read); the first of the run is kept as ``poisoned``, and each is logged and
        warned once. A failure of the guard's bookkeeping is said once and counts as finite: it must not stop training."""
        step = self._trainer_iteration_count
        if self.guard is None:
            return None
        if self._verdict is not None and self._verdict[0] == step:
            return self._verdict[1]
        try:
            verdict = self.guard.verdict(step, self._tensor_reduction_group)
        except Exception as error:
            say_once(f"NonfiniteGuard could not read this step's flags: {type(error).__name__}: {error}")
            verdict = None
        self._verdict = (step, verdict)
        if verdict is not None:
            error = verdict[0]
            if self.poisoned is None:
                self.poisoned = error
            get_logger().log_message(f"NonfiniteGuard: {error}", logging.ERROR)
            fields = ("layer", "gemm", "tensor", "micro_batch")
            get_logger().log_nonfinite({key: getattr(error, key) for key in fields} | {"iteration": step})
            warnings.warn(f"NonfiniteGuard: {error}", RuntimeWarning, stacklevel=3)
        return verdict

    def raise_nonfinite(self, verdict: tuple[NonFiniteError, str] | None, step: int) -> None:
        """Raise the step's ``NonFiniteError`` when its mode says so, once per step."""
        if verdict is not None and verdict[1] == "raise" and self._raised_at != step:
            self._raised_at = step
            raise verdict[0]

    def _end_guard_step(self) -> None:
        if self.guard is not None:
            try:
                self.guard.reset()
            except Exception as error:
                say_once(f"NonfiniteGuard could not start a new step: {type(error).__name__}: {error}")

    def _step_namespaces(self) -> None:
        for api in self._namespace_apis.values():
            api.step()
        if not self._first_step_done:
            self._first_step_done = True
            warn_sections_never_matched()
            warn_features_in_namespaces_not_called()

    @property
    def paused(self) -> bool:
        """Whether inspection is paused (``debug_api.paused``): nothing is recorded, precision is still steered."""
        return self._pauses > 0

    def pause(self) -> None:
        with self._pause_lock:
            self._pauses += 1

    def resume(self) -> None:
        with self._pause_lock:
            self._pauses -= 1

    def set_iteration(self, iteration: int) -> None:
        """Set the counter (``initialize_training_step``), never in the middle of a ``step``."""
        with self._step_lock:
            self._trainer_iteration_count = iteration

    def close(self) -> None:
        """Log the statistics of the unfinished step, run every namespace's ``end_debug`` hook, drop the buffers.
        Called by a signal handler that interrupted this thread's ``step()``, it cannot wait for that step: the
        step being logged is dropped, with a warning, and the steps logged before stay whole. In a child of
        ``os.fork()`` nothing is logged: the parent logs its own unfinished step. First it waits for the calls of
        other threads under way (``SessionCalls``): they are part of that step."""
        still_running = self.calls.close(CALLS_DRAIN_S)
        if still_running:
            say_once(
                f"end_debug() waited {CALLS_DRAIN_S:g} s for debug calls of {still_running} other thread(s) still under "
                "way and closed the run without them: what they log is lost, and they may fail"
            )
        with self._step_lock:
            self._closed = True
            most_fed = STATS_BUFFERS.most_fed()  # before the flush resets the counts
            try:
                if self._stepping == threading.get_ident():
                    say_once(
                        f"end_debug() interrupted step() of iteration {self._trainer_iteration_count - 1} (a signal "
                        "handler): that iteration's statistics are not logged (call end_debug() outside step() to log "
                        "them)."
                    )
                elif os.getpid() == self.owner_pid:  # not in a child of os.fork(): the step is the parent's
                    STATS_BUFFERS.flush(step=self._trainer_iteration_count, timeout=self.collective_timeout)
            finally:
                if self._step_watch is not None:
                    self._step_watch.close(most_fed)
                STATS_BUFFERS.reset()
                for api in self._namespace_apis.values():
                    api.end_debug()


def _checked_timeout(seconds: object) -> float | None:
    """``collective_timeout``: None (torch's default timeout) or a positive, finite number of seconds."""
    if seconds is None:
        return None
    if not is_number(seconds) or not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(
            f"collective_timeout must be a positive number of seconds (or None for torch's default timeout, 30 minutes), "
            f"got {seconds!r}"
        )
    return float(seconds)
