"""``NonfiniteGuard``: find the first NaN or inf among a step's GEMM tensors without waiting for the device.

An operand that a cast read (per-tensor FP8 or block-scaled) comes with that read's verdict (the quantized tensor's
``nonfinite_probe``: 0, or NaN when the tensor held a NaN or an infinity; the C kernels on a CPU, the Triton kernels
on a GPU): the guard adds no read for it; nor for the result of an emulated per-tensor FP8 GEMM on a CPU, whose
epilogue (the C kernel scaling the product) checks it (``lowprec.gemm.gemm_and_probe``, lent through
``RESULT_PROBES``). Every other inspected tensor (other GEMM results, operands kept in high precision) costs one read:
on a CPU the C kernel's vectorized pass (``cpu_cast.nonfinite_probe``), elsewhere a reduction to its minimum and
maximum (``torch.aminmax``, nothing written but two scalars), which are NaN or infinite exactly when the tensor holds
a NaN or an infinity. The host keeps, per position in the step's order of calls, the layer and tensor (the
micro-batch follows from that order: worked out for the one position reported).
``debug_api.step()`` (or an optimizer wrapped by ``debug_api.guard_optimizer``, which comes first) stacks the step's
values (per call its probe, or its minimum and maximum), finds the first non-finite one on the device, and reads its
index: the one host read of the guard in a step.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from lowprec.debug.features.api import EveryIteration, TEConfigAPIMapper
from lowprec.debug.features.dump_tensors import dump_path
from lowprec.debug.names import BACKWARD_TENSORS, TENSOR_GEMMS, TENSORS
from lowprec.debug.result_probes import RESULT_PROBES
from lowprec.kernels import cpu_cast
from lowprec.quant.protocol import detached
from nvdlfw_inspect.config_manager import ConfigManager
from nvdlfw_inspect.errors import ConfigLocation, ErrorCollector, NonFiniteError
from nvdlfw_inspect.logging import get_logger, say_once
from nvdlfw_inspect.registry import Registry, api_method
from nvdlfw_inspect.utils import get_distributed_rank

MODES = ("warn", "raise")
_NONE = 2**62  # no non-finite tensor yet: larger than any position


class _Call(NamedTuple):  # the reported call (a plain tuple per inspected tensor until then)
    layer: str
    tensor: str
    micro_batch: int
    mode: str


class _MicroBatches:
    """Which micro-batch each call of a step belongs to, from the order of the step's calls. A forward tensor's: how
    often the step's first guarded forward call came before it (with the default, every layer, the model's first
    layer: once per micro-batch). A backward tensor's: that of its layer's forward it belongs to, the k-th backward
    the k-th forward (so an expert no token reached in some micro-batch keeps the micro-batch's number); without a
    guarded forward of its layer, its call count."""

    def __init__(self) -> None:
        self._seen: dict[tuple[str, str], int] = {}
        self._anchor: tuple[str, str] | None = None
        self._micro_batch = 0
        self._layer_forwards: dict[str, tuple[str, list[int]]] = {}  # layer -> (its first forward tensor, micro-batches)

    def next(self, layer: str, tensor_name: str) -> int:
        """The micro-batch of the step's next call, of ``tensor_name`` in ``layer``."""
        key = (layer, tensor_name)
        count = self._seen.get(key, 0)
        self._seen[key] = count + 1
        if tensor_name in BACKWARD_TENSORS:
            forwards = self._layer_forwards.get(layer, ("", []))[1]
            return forwards[count] if count < len(forwards) else count
        if self._anchor is None:
            self._anchor = key
        elif key == self._anchor:
            self._micro_batch += 1
        first, forwards = self._layer_forwards.setdefault(layer, (tensor_name, []))
        if first == tensor_name:
            forwards.append(self._micro_batch)
        return self._micro_batch


def _with_default_tensors(config: dict) -> dict:
    """No ``tensors``/``tensors_struct``: every GEMM tensor of the selected layers."""
    if "tensors" in config or "tensors_struct" in config:
        return config
    return {**config, "tensors": list(TENSORS)}


@Registry.register_feature(namespace="transformer_engine")
class NonfiniteGuard(TEConfigAPIMapper):
    """Finds the first GEMM operand or output (execution order: layer, tensor, micro-batch) holding NaN or inf, and
    reports it at ``debug_api.step()``, as a log message and a warning. Keys: ``tensors``/``tensors_struct``
    (default: all six) and ``on_nonfinite``: ``warn`` (default) or ``raise`` (``NonFiniteError``). Wrap the optimizer
    with ``debug_api.guard_optimizer`` so that a poisoned step is skipped before it changes the weights."""

    uses_gemms = False
    option_keys = frozenset({"on_nonfinite"})

    def __init__(self) -> None:
        super().__init__()
        self._reset()

    def _reset(self) -> None:
        self._values: list[torch.Tensor] = []  # device scalars, per call a probe or the minimum and maximum, in order
        self._calls: list[tuple[str, str, str, int]] = []  # each call's (layer, tensor, on_nonfinite, its values)
        self._device: torch.device | None = None  # the step's first value's: all are kept there, for one stack

    # --- config ------------------------------------------------------------------------------------
    def parse_config_and_api(self, config: dict, **kwargs: Any) -> tuple[bool, dict | None]:
        return super().parse_config_and_api(_with_default_tensors(config), **kwargs)

    def resolved_views(
        self, config: dict, location: ConfigLocation, collector: ErrorCollector
    ) -> list[tuple[dict, ConfigLocation]]:
        return super().resolved_views(_with_default_tensors(config), location, collector)

    def validate_options(self, view: dict, location: ConfigLocation) -> None:
        mode = view.get("on_nonfinite", "warn")
        if mode not in MODES:
            raise location.child("on_nonfinite").error("unknown action on a non-finite tensor", mode, MODES)

    # --- the step ----------------------------------------------------------------------------------
    @api_method
    def inspect_tensor_enabled(self, config: dict, layer_name: str, tensor_name: str, iteration: int) -> tuple[bool, int]:
        return EveryIteration(iteration)

    @api_method
    def inspect_tensor(
        self, config: dict, layer_name: str, tensor_name: str, tensor: torch.Tensor | None, iteration: int, **kwargs: Any
    ) -> None:
        if tensor is None:
            return
        try:
            probe = _probe(tensor, kwargs.get("rowwise_quantized_tensor"), kwargs.get("columnwise_quantized_tensor"))
            self._record(layer_name, tensor_name, tensor, probe, config.get("on_nonfinite", "warn"))
        except Exception as error:  # the guard's own failure must not stop training
            say_once(f"NonfiniteGuard could not check {layer_name} {tensor_name}: {type(error).__name__}: {error}")

    def _record(self, layer: str, tensor_name: str, tensor: torch.Tensor, probe: torch.Tensor | None, mode: str) -> None:
        if tensor.numel() == 0:  # nothing to check (and no extrema to take); a call still, for the micro-batches
            self._calls.append((layer, tensor_name, mode, 0))
            return
        if probe is None:
            probe = cpu_cast.nonfinite_probe(tensor)  # a CPU tensor: the C kernel's pass, cheaper than aminmax's
        # a probe is non-finite exactly when the tensor is; else the extrema: NaN propagates into both, an infinity
        # is one of them
        values = (probe,) if probe is not None else torch.aminmax(detached(tensor))
        if self._device is None:
            self._device = values[0].device
        elif values[0].device != self._device:
            values = [value.to(self._device) for value in values]
        self._values.extend(values)
        self._calls.append((layer, tensor_name, mode, len(values)))

    def _first_value(self) -> torch.Tensor:
        """Device scalar: the index in ``_values`` of the step's first non-finite value, or _NONE."""
        if not self._values:
            return torch.full((), _NONE, dtype=torch.int64)
        bad = ~torch.isfinite(torch.stack(self._values))
        first = bad.to(torch.int64).argmax()  # the first True (0 when there is none)
        return torch.where(bad.any(), first, _NONE)

    def _call(self, value: int) -> _Call:
        """The step's call that value ``value`` is of, with its micro-batch."""
        micro_batches = _MicroBatches()
        for layer, tensor_name, mode, width in self._calls:
            micro_batch = micro_batches.next(layer, tensor_name)
            if value < width:
                return _Call(layer, tensor_name, micro_batch, mode)
            value -= width
        raise IndexError(f"no call of the step holds value {value}")

    def verdict(self, step: int, group: Any) -> tuple[NonFiniteError, str] | None:
        """The step's first non-finite tensor and its ``on_nonfinite``, from one read of the device; with a
        reduction ``group``, also when only another rank of it saw one (the flag all-reduced with MAX)."""
        reduce = group is not None and dist.is_available() and dist.is_initialized()
        if not reduce and not self._values:
            return None  # no tensor this step, and no rank to answer: nothing to read
        first = self._first_value()
        if not reduce:
            index = first.item()  # the one host read
            flag = index < _NONE
        else:
            values = torch.stack([first, (first < _NONE).to(torch.int64)])  # the value's index, and a flag to reduce with MAX
            on_device = dist.get_backend(group) == "nccl"
            if on_device:
                values = values.to(torch.device("cuda", torch.cuda.current_device()))  # on the host when none came
                dist.all_reduce(values[1:], op=dist.ReduceOp.MAX, group=group)
            values = values.cpu()  # the one host read
            if not on_device:
                dist.all_reduce(values[1:], op=dist.ReduceOp.MAX, group=group)
            index, flag = values.tolist()
        if not flag:
            return None
        if index == _NONE:
            error = NonFiniteError(
                f"non-finite values (NaN or inf) at step {step} on another rank of the reduction group; this rank's "
                "tensors are finite",
                step=step,
            )
            return error, self._calls[0][2] if self._calls else _configured_mode()
        call = self._call(index)
        gemm, other = TENSOR_GEMMS[call.tensor]
        read_by = f"the {gemm} GEMM" + (f" (and {other})" if other else "")
        message = (
            f"non-finite values (NaN or inf) at step {step}: first in layer {call.layer}, tensor {call.tensor} "
            f"of {read_by}, micro-batch {call.micro_batch}{_dump_note(step, call)}"
        )
        return NonFiniteError(message, call.layer, gemm, call.tensor, call.micro_batch, step), call.mode

    def reset(self) -> None:
        """A new step: nothing seen yet."""
        self._reset()


def _configured_mode() -> str:
    """The strictest ``on_nonfinite`` the config gives the guard: a rank none of whose tensors reached it this step
    answers another rank's non-finite values with it."""
    modes = {
        config.get("on_nonfinite", "warn")
        for namespace, feature, config in ConfigManager.enabled_features()
        if (namespace, feature) == ("transformer_engine", "NonfiniteGuard")
    }
    return "raise" if "raise" in modes else "warn"


def _probe(tensor: torch.Tensor, *casts: Any) -> torch.Tensor | None:
    """The non-finite probe a cast of the tensor took from its own read (``nonfinite_probe`` of ``Float8Tensor`` and
    ``BlockScaledTensor``), if one did: the GEMM operand it made is non-finite exactly when that is; for a GEMM result,
    the one the GEMM's last pass took, if the debug path lent it (``RESULT_PROBES``)."""
    result = RESULT_PROBES.get(id(tensor))
    if result is not None:
        return result
    for cast in casts:
        probe = getattr(cast, "nonfinite_probe", None)
        if probe is not None:
            return probe
    return None


def _dump_note(step: int, call: _Call) -> str:
    """Where ``DumpTensors`` put that tensor this step, if it did (it keeps the last micro-batch's)."""
    root = get_logger().root_log_dir
    path = dump_path(root, get_distributed_rank(), step, call.layer, call.tensor)
    if os.path.exists(path):
        return f"; DumpTensors saved it (its last micro-batch) to {path}"
    return "; no DumpTensors dump of it at this step (configure DumpTensors for this layer and tensor to keep one)"
