"""``LogTensorStats`` of the base namespace: min, max, mean, std, l1_norm and l2_norm of any tensor, and the
statistics that warn early (kurtosis, rms, outlier_channel_ratio, max_channel)."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

import nvdlfw_inspect.api as debug_api
from nvdlfw_inspect.debug_features.generic_feature_api import GenericConfigAPIMapper, PerConfig
from nvdlfw_inspect.distributed import get_distributed_world_size
from nvdlfw_inspect.errors import ConfigLocation, ErrorCollector, is_int
from nvdlfw_inspect.logging import enable_logging_at_current_step
from nvdlfw_inspect.registry import Registry, api_method
from nvdlfw_inspect.stats import zeros
from nvdlfw_inspect.stats.buffers import STATS_BUFFERS
from nvdlfw_inspect.stats.catalog import EARLY_STATS, TORCH_REDUCTIONS, column_amax, derive_tensors, reads, reducible
from nvdlfw_inspect.stats.fields import empty_partials
from nvdlfw_inspect.stats.kernels import unreadable_reason
from nvdlfw_inspect.utils import append_parent_docstring

WINDOW_KEYS = frozenset({"freq", "start_step", "end_step", "start_end_list"})


def validate_window(config: dict, location: ConfigLocation, closed: bool = False) -> None:
    """Check ``freq`` (int > 0), ``start_step`` (int >= 0), ``end_step`` (int >= -1) and ``start_end_list``
    (half-open ``[start, end)`` windows, or closed ``[start, end]`` ones with ``closed``); raises every error."""
    collector = ErrorCollector()
    if "freq" in config:
        freq = config["freq"]
        if not is_int(freq) or freq <= 0:
            collector.add(location.child("freq").error("must be a positive integer (log every freq steps)", freq))
    start = config.get("start_step", 0)
    if not is_int(start) or start < 0:
        collector.add(location.child("start_step").error("must be a non-negative integer", start))
        start = 0
    if "end_step" in config:
        end = config["end_step"]
        if not is_int(end) or end < -1:
            collector.add(location.child("end_step").error("must be an integer >= 0, or -1 for no end", end))
        elif end != -1 and end < start:
            collector.add(
                location.child("end_step").error(
                    f"is before start_step {start}, so nothing would be logged", end, f"-1 (no end) or an integer >= {start}"
                )
            )
    if "start_end_list" in config:
        with collector.check():
            _validate_start_end_list(config["start_end_list"], location.child("start_end_list"), closed)
    collector.raise_errors()


def window_key(config: dict) -> tuple:
    """The window keys as a hashable value: requests with different windows get different buffers."""
    pairs = tuple(tuple(pair) for pair in config.get("start_end_list") or ())
    return config.get("start_step"), config.get("end_step"), pairs, config.get("freq", 1)


def stats_list(config: dict, location: ConfigLocation, allowed: list[str]) -> list:
    """The ``stats`` of a feature's (or a tensor's) config: present and a non-empty list; checking its
    entries is the caller's part. ``allowed`` is shown in the errors."""
    stats = config.get("stats")
    if stats is None:
        raise location.error(f"tensor '{config.get('tensor', '<tensors>')}' has no 'stats' list", allowed=allowed)
    if isinstance(stats, str) or not isinstance(stats, list) or not stats:
        raise location.child("stats").error("must be a non-empty list of statistics", stats, allowed)
    return stats


def stat_name(stat: Any, location: ConfigLocation, mappings: bool) -> str:
    """The name of a ``stats`` entry: a string, or (with ``mappings``) the key of a one-key mapping of options
    such as ``{max_blockwise_dynamic_range: {block_size: 32, dims: 1}}``, as TE parses them."""
    if isinstance(stat, str):
        return stat
    if mappings and isinstance(stat, dict) and len(stat) == 1:
        ((name, options),) = stat.items()
        if isinstance(name, str) and isinstance(options, dict):
            return name
    shape = "a statistic name or a one-key mapping {name: {option: value}}" if mappings else "a statistic name"
    raise location.error(f"unsupported statistic: must be {shape}", stat)


def _validate_start_end_list(pairs: Any, location: ConfigLocation, closed: bool) -> None:
    shape = "a list of [start, end] integer pairs in increasing, non-overlapping order (end -1: no end)"
    order = "<=" if closed else "<"
    if not isinstance(pairs, list):
        raise location.error(f"must be {shape}", pairs)
    previous_end = -1
    for i, pair in enumerate(pairs):
        ok = (
            isinstance(pair, list)
            and len(pair) == 2
            and all(is_int(v) for v in pair)
            and pair[0] >= 0
            and (pair[1] == -1 or pair[1] > pair[0] or (closed and pair[1] == pair[0]))
        )
        if not ok:
            raise location.child(i).error(f"must be [start, end] with 0 <= start {order} end; the list is {shape}", pair)
        if i > 0 and (previous_end == -1 or pair[0] < previous_end or (closed and pair[0] == previous_end)):
            raise location.child(i).error(f"overlaps the previous window; the list is {shape}", pair)
        previous_end = pair[1]


def _version(tensor: torch.Tensor) -> int | None:
    """The tensor's in-place modification counter; None for inference tensors, which keep none."""
    return None if tensor.is_inference() else tensor._version


class DerivedStats(Mapping):
    """One call's statistics as 0-dim float32 tensors on the tensor's device, each computed when first read:
    most callers never read them. A value is torch's own reduction of the tensor (as the reference returns it; of
    its float32 upcast for 8-bit floats, which torch does not reduce) while the tensor is unchanged since the call;
    otherwise (modified in place, an inference tensor whose changes cannot be seen, an empty or integer tensor), and
    for the statistics the reference lacks (kurtosis, rms, the channel ones), it is derived from the partials (and the
    per-column amax) taken at the call.
    The mapping holds the tensor until it is dropped."""

    def __init__(
        self,
        tensor: torch.Tensor,
        partials: torch.Tensor | None,
        stats: list[str],
        zeros: Mapping[str, tuple[torch.Tensor, str]] | None = None,
        channel_amax: torch.Tensor | None = None,
    ):
        self._tensor, self._version = tensor, _version(tensor)
        self._channel_amax = channel_amax
        self._partials, self._zeros = partials, dict(zeros or {})  # zeros: name -> (its partial, its derivation)
        self._stats = [*stats, *self._zeros]
        self._values: dict[str, torch.Tensor] = {}

    def __getitem__(self, stat: str) -> torch.Tensor:
        if stat not in self._stats:
            raise KeyError(stat)
        if stat not in self._values:
            self._values[stat] = self._compute(stat).float()
        return self._values[stat]

    def _compute(self, stat: str) -> torch.Tensor:
        if stat in self._zeros:
            partials, derivation = self._zeros[stat]
            return derive_tensors(partials, [derivation])[derivation]
        tensor = self._tensor
        unchanged = self._version is not None and _version(tensor) == self._version
        if stat in TORCH_REDUCTIONS and unchanged and tensor.is_floating_point() and tensor.numel() > 0:
            return TORCH_REDUCTIONS[stat](reducible(tensor))
        return derive_tensors(self._partials, [stat], self._channel_amax)[stat]

    def __iter__(self) -> Iterator[str]:
        return iter(self._stats)

    def __len__(self) -> int:
        return len(self._stats)

    def __repr__(self) -> str:
        return repr(dict(self))


@Registry.register_feature(namespace="base")
@append_parent_docstring(parent=GenericConfigAPIMapper)
class LogTensorStats(GenericConfigAPIMapper):
    """Logs statistics of the tensors passed to ``debug_api.log_tensor_stats``.

    Keys: ``stats`` (min, max, mean, std, l1_norm, l2_norm, kurtosis, rms, outlier_channel_ratio, max_channel, and the
    ``num_zeros`` family: ``num_zeros``, ``num_zeros%``, ``num_zeros[1e-10]``, ``num_zeros[1e-10]%``, see
    ``stats.zeros``), ``tensors``/``tensors_struct``, and the
    window keys ``freq`` (default 1), ``start_step``, ``end_step`` (closed window; -1 no end),
    ``start_end_list`` (half-open [start, end) windows; overrides start/end).

    Call: ``debug_api.log_tensor_stats(layer_name, tensor=t, tensor_name="activation",
    [iteration=i], [skip_reduction=True], [reduction_group=g])``. One pass over the tensor stores its
    partial statistics on its device; calls of one step for the same layer and tensor accumulate
    (a ``weight`` counts once per step). ``debug_api.step()`` reduces them over the group (only a few
    floats per rank travel), and logs each statistic as ``{layer_name}_{tensor_name}_{stat}``.

    Returned and logged values differ on purpose: the call returns this call's statistics on this rank,
    each torch's own reduction of the tensor (``returned["mean"] == tensor.mean()``, as in the reference),
    computed only when read; the logged values are merged and reduced from float64 partials, so they are
    accurate to float64 rounding but need not equal torch's float32 reductions bit for bit.

    Subclasses (as Transformer Engine's) bring their own statistics; ``initialize`` asks the subclass which
    it takes, through the first hook it defines: ``_is_supported_stat(stat)``, ``check_if_stat_is_supported(stat)``
    (one needing call-time arguments, such as the recipe, leaves the check to the call), or an overridden
    ``_get_supported_stats_list()`` (names, or one-key mappings of options named by them).
    """

    config_keys = frozenset({"enabled", "tensors", "tensors_struct", "stats"}) | WINDOW_KEYS
    tensor_struct_keys = frozenset({"tensor", "stats"}) | WINDOW_KEYS

    def _get_supported_stats_list(self) -> set[str]:
        """The statistics this class's ``log_tensor_stats`` computes; subclasses (TE's) call it unbound with
        ``self=None``, so it must not use ``self``."""
        return set(TORCH_REDUCTIONS) | set(EARLY_STATS)

    def validate_tensor_config(self, config: dict, location: ConfigLocation) -> None:
        supported = sorted(self._get_supported_stats_list())
        if not self._has_own_stats():
            supported += zeros.FORMS
        collector = ErrorCollector()
        with collector.check():
            for i, stat in enumerate(stats_list(config, location, supported)):
                with collector.check():
                    self._validate_stat(stat, location.child("stats").child(i), supported)
        with collector.check():
            validate_window(config, location)
        collector.raise_errors()

    def _validate_stat(self, stat: Any, location: ConfigLocation, supported: list[str]) -> None:
        """Raise unless this class takes ``stat``, asking the first hook it defines (see the class docstring)."""
        if hasattr(self, "_is_supported_stat"):
            stat_name(stat, location, mappings=True)
            if not _hook_accepts(self._is_supported_stat, stat, location):
                raise location.error("unsupported statistic (_is_supported_stat says no)", stat, supported)
        elif hasattr(self, "check_if_stat_is_supported"):
            stat_name(stat, location, mappings=True)
            if _takes_one_argument(self.check_if_stat_is_supported, stat):
                _hook_accepts(self.check_if_stat_is_supported, stat, location)
        else:
            name = stat_name(stat, location, mappings=self._has_own_stats()).lower()
            if not self._has_own_stats() and _zeros_stat(name, location) is not None:
                return
            if name not in supported:
                raise location.error("unsupported statistic", stat, supported)

    def _has_own_stats(self) -> bool:
        """Whether a subclass (Transformer Engine's) brings its own statistics list, without the ``num_zeros`` family."""
        return type(self)._get_supported_stats_list is not LogTensorStats._get_supported_stats_list

    def _get_current_iteration(self, **kwargs: Any) -> int:
        if "iteration" in kwargs:
            return kwargs["iteration"]
        return debug_api.DEBUG_MANAGER._trainer_iteration_count

    def _check_log_frequency(self, config: dict, **kwargs: Any) -> bool:
        return enable_logging_at_current_step(
            self._get_current_iteration(**kwargs),
            config.get("freq", 1),
            config.get("start_step", 0),
            config.get("end_step", -1),
            config.get("start_end_list"),
        )

    def _check_params(self, config: dict, layer_name: str, **kwargs: Any) -> bool:
        """Whether statistics are due at this call's iteration."""
        return self._check_log_frequency(config, **kwargs)

    def _reduction(self, layer_name: str, **kwargs: Any) -> dict[str, Any]:
        """Where this call's statistics are reduced at ``step()``: its group, or this rank alone."""
        if kwargs.get("skip_reduction", False):
            return {"skip_reduction": True}
        group = kwargs.get("reduction_group")
        if group is None:
            group = debug_api.get_tensor_reduction_group()
        if group is not None:
            return {"reduction_group": group}
        if get_distributed_world_size() > 1:
            debug_api.log_message(
                "No `reduction_group` given and `skip_reduction` is False: statistics are reduced over all ranks "
                "of the default process group and logged on one rank only, the last rank that logs the same layer and "
                "tensor (the default group's last rank when every rank holds the layer; a pipeline stage's last rank "
                "otherwise). Pass `reduction_group` (or set one with debug_api.set_tensor_reduction_group) or "
                "`skip_reduction=True` for per-rank statistics.",
                layer_name,
                level=logging.WARNING,
            )
        return {"last_rank_only": True}

    def _request(self, config: dict) -> tuple[list[str], list[zeros.ZerosStat], tuple]:
        """The config's statistics (those of the ``num_zeros`` family apart) and the end of its buffer key
        (statistics, window), worked out once per config. Kept in the instance's ``__dict__`` (subclasses such as
        Transformer Engine's need not call ``__init__``)."""

        def request(config: dict) -> tuple[list[str], list[zeros.ZerosStat], tuple]:
            stats = [s.lower() for s in config["stats"]]
            family = [zeros.parse_zeros(s) for s in stats]
            plain = [s for s, z in zip(stats, family, strict=True) if z is None]
            return plain, [z for z in family if z is not None], ("base", tuple(stats), window_key(config))

        return vars(self).setdefault("_requests", PerConfig()).get(config, request)

    @api_method
    def log_tensor_stats(self, config: dict, layer_name: str, **kwargs: Any) -> Mapping[str, torch.Tensor]:
        """Returns this call's statistics as 0-dim float32 tensors on the tensor's device, torch's own reductions
        computed when read (see ``DerivedStats``); the logged values, merged over the step's calls and reduced over
        the group, follow at ``step()``. Inside ``debug_api.paused()`` it records nothing and returns ``{}``."""
        if debug_api.DEBUG_MANAGER.paused:
            return {}
        tensor_name = kwargs["tensor_name"]
        announced = vars(self).setdefault("_announced", set())  # (layer, tensor) whose first call the debug log noted
        if (layer_name, tensor_name) not in announced:  # checked here, cheaply: this runs for every call
            announced.add((layer_name, tensor_name))
            debug_api.log_message(
                f"Feature=LogTensorStats, API=log_tensor_stats, TENSOR={tensor_name}: Called",
                layer_name,
                extra_cachable_args=(tensor_name,),
            )
        if not self._check_params(config, layer_name, **kwargs):
            return {}
        stats, zeros_stats, key_tail = self._request(config)
        tensor = kwargs["tensor"]
        readable = unreadable_reason(tensor) is None  # feed warns once about the others and skips them
        if readable:
            tensor = tensor.detach()
        partials = empty_partials(tensor.device) if readable and stats else None
        channel_amax = column_amax(tensor) if readable and reads(stats, "channel_amax") else None
        key = (layer_name, tensor_name, *key_tail)
        feed = {
            "layer_name": layer_name,
            "tensor_name": tensor_name,
            "iteration": self._get_current_iteration(**kwargs),
            "accumulate": tensor_name != "weight",
            **self._reduction(layer_name, **kwargs),
        }
        taken = bool(stats) and STATS_BUFFERS.feed(
            key, stats=stats, tensor=tensor, call_out=partials, channel_amax=channel_amax, **feed
        )
        zeros_taken = zeros.feed_zeros(zeros_stats, key, tensor, **feed) if zeros_stats else {}
        if not taken and not zeros_taken:
            return {}
        returned = {z.name: (zeros_taken[z.threshold], z.derivation) for z in zeros_stats if z.threshold in zeros_taken}
        return DerivedStats(tensor, partials, stats if taken else [], returned, channel_amax)


def _zeros_stat(name: str, location: ConfigLocation) -> zeros.ZerosStat | None:
    """``name`` as a statistic of the ``num_zeros`` family (None: not one); a malformed threshold raises."""
    try:
        return zeros.parse_zeros(name)
    except ValueError as error:
        raise location.error(f"unsupported statistic: {error}", name, zeros.FORMS) from None


def _takes_one_argument(hook: Callable, stat: Any) -> bool:
    """Whether ``hook(stat)`` is a complete call (LogFp8TensorStats' check also needs the call's recipe)."""
    try:
        inspect.signature(hook).bind(stat)
    except (TypeError, ValueError):
        return False
    return True


def _hook_accepts(hook: Callable, stat: Any, location: ConfigLocation) -> bool:
    """``hook(stat)``; a hook raising rejects the statistic with its message (TE's checks raise ValueError)."""
    try:
        return bool(hook(stat))
    except Exception as error:
        raise location.error(f"unsupported statistic ({hook.__name__}: {type(error).__name__}: {error})", stat) from error
