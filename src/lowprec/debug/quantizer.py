"""The debug path of a layer's tensors: inspect, modify or quantize each operand as the plan says.

For an input tensor (activation, weight, gradient) it produces one operand per GEMM that consumes it:
the recipe's FP8 tensor (one cast shared by both GEMMs under one recipe; one per GEMM when a precision plan gives
them two), the high-precision tensor, or whatever ``modify_tensor`` returns; then ``inspect_tensor`` sees the
high-precision tensor and the operands of the recipe it reports (``GemmQuantizers.reported``).
Outputs (output, dgrad, wgrad) can be modified and inspected after their GEMM.

A forward's tensors, and a backward's, are processed inside the layer's debug session (``with processing:`` holds
it): an ``end_debug()`` on another thread waits for them. Once the session has ended (between a forward and its
backward, say), a tensor gets the plan's precisions but neither modification nor inspection, as a layer without a
session.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Any

import torch

import nvdlfw_inspect.api as debug_api
from lowprec.debug.layer_state import SessionRoutes
from lowprec.debug.names import TENSOR_GEMMS, TENSORS
from lowprec.debug.plan import LayerPlan, Precision, TensorPlan
from lowprec.debug.result_probes import RESULT_PROBES
from lowprec.gemm import Operand
from lowprec.modules.gemm_quantizers import GemmQuantizers, Pair
from lowprec.quant.protocol import Quantizer, detached
from nvdlfw_inspect.debug_manager import held
from nvdlfw_inspect.logging import say_once
from nvdlfw_inspect.stats.buffers import STATS_BUFFERS
from nvdlfw_inspect.utils import get_distributed_world_size


def _format(quantizer: Quantizer | None) -> str:
    return "high precision" if quantizer is None else quantizer.label or "its recipe's format"


def _iteration() -> int:
    manager = debug_api.DEBUG_MANAGER
    return manager._trainer_iteration_count if manager is not None else 0


class DebugProcessing:
    """Turns a layer's tensors into GEMM operands under a debug plan (see module docstring)."""

    def __init__(
        self,
        layer_name: str,
        quantizers: GemmQuantizers,
        plan: LayerPlan,
        routes: SessionRoutes,
        tp_group: Any = None,
        inspected: Collection[str] = TENSORS,
    ):
        """``routes``: the layer's feature calls in the debug session that made ``plan``. ``inspected``: the tensors
        shown to the inspection features; the others only get the plan's casts and modifications (a recomputed
        forward's, which the original forward has already shown, or all of a forward run inside
        ``debug_api.paused()``)."""
        self.layer_name = layer_name
        self.routes = routes
        self.inspected = inspected
        self.quantizers = quantizers
        self.plan = plan
        self.tp_group = tp_group
        self.tp_size = get_distributed_world_size(tp_group) if tp_group is not None else 1
        self._open = False  # inside ``with self:``, in the session: features may run

    def __enter__(self) -> DebugProcessing:
        """Hold the debug session for the calls of one forward or one backward (not reentrant)."""
        self._open = held(self.routes.session).__enter__()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._open:
            self._open = False
            held(self.routes.session).__exit__(*exc_info)

    def input(self, tensor_name: str, tensor: torch.Tensor, transpose: bool = False) -> tuple[Operand, Operand]:
        """``(operand for the tensor's first GEMM, operand for its second GEMM)``."""
        open_ = self._open
        plan = self.plan.tensors[tensor_name]
        gemms = TENSOR_GEMMS[tensor_name]
        first, second = gemms
        pair = self.quantizers.pair(tensor_name)
        tensor = detached(tensor)
        iteration = _iteration()
        casts = self._casts(tensor, plan, gemms, pair, transpose)
        operands: dict[str, Operand] = {}
        for gemm, quantizer in ((second, pair[1]), (first, pair[0])):
            precision = plan.gemms[gemm]
            if precision is Precision.MODIFY and open_:
                operands[gemm] = self.routes.call("modify_tensor", self.layer_name, tensor_name, gemm)(
                    tensor=tensor,
                    default_quantizer=quantizer,
                    iteration=iteration,
                    dtype=tensor.dtype,
                )
            elif precision is Precision.QUANTIZE and casts.get(gemm) is not None:
                operands[gemm] = casts[gemm]
            else:
                operands[gemm] = tensor
        inspected = open_ and tensor_name in self.inspected
        if plan.inspect and inspected:
            self._inspect_input(tensor_name, tensor, iteration, operands, pair)
        for gemm in (first, second):
            if inspected and plan.inspect_postquantize.get(gemm) and plan.gemms[gemm] is not Precision.HIGH_PRECISION:
                self.routes.call("inspect_tensor_postquantize", self.layer_name, tensor_name)(
                    gemm=gemm,
                    tensor=operands[gemm],
                    iteration=iteration,
                    tp_group=self.tp_group,
                    tp_size=self.tp_size,
                    rowwise=gemm == first,
                )
        return operands[first], operands[second]

    @staticmethod
    def _casts(
        tensor: torch.Tensor, plan: TensorPlan, gemms: tuple[str, str], pair: Pair, transpose: bool
    ) -> dict[str, Operand | None]:
        """Each GEMM's cast of ``tensor`` where the plan quantizes it: one shared when one quantizer serves both."""
        first, second = gemms
        if pair[0] is pair[1]:
            quantized = pair[0].quantize(tensor, transpose) if pair[0] is not None and plan.quantized_anywhere else None
            return {first: quantized, second: quantized}
        casts: dict[str, Operand | None] = {}
        for gemm, quantizer, orientation in ((first, pair[0], False), (second, pair[1], True)):
            wanted = plan.gemms[gemm] is Precision.QUANTIZE and (gemm == first or transpose)
            casts[gemm] = quantizer.quantize(tensor, orientation) if quantizer is not None and wanted else None
        return casts

    def _inspect_input(
        self, tensor_name: str, tensor: torch.Tensor, iteration: int, operands: dict[str, Operand], pair: Pair
    ) -> None:
        """``inspect_tensor`` of an input: under two recipes, with the quantizer it reports and that one's operand only
        (the quantization statistics describe one recipe's cast), said once."""
        first, second = TENSOR_GEMMS[tensor_name]
        if pair[0] is pair[1]:
            self._inspect(tensor_name, tensor, iteration, operands[first], operands[second], pair[0])
            return
        reported = pair[0] if pair[0] is not None else pair[1]
        gemm = first if pair[0] is not None else second
        other = second if gemm == first else first
        say_once(
            f"{self.layer_name}: {tensor_name}: {first} reads it as {_format(pair[0])}, {second} as {_format(pair[1])}; "
            f"its quantization statistics without a recipe prefix (LogFp8TensorStats, LogNvfp4TensorStats) describe "
            f"{gemm}'s {_format(reported)} cast, not {other}'s",
            self.layer_name,
            level=logging.INFO,
            warning=None,
            call_site=__name__,
        )
        rowwise = operands[first] if gemm == first else None
        columnwise = operands[second] if gemm == second else None
        self._inspect(tensor_name, tensor, iteration, rowwise, columnwise, reported)

    def output(self, tensor_name: str, tensor: torch.Tensor, probe: torch.Tensor | None = None) -> torch.Tensor:
        """The GEMM result ``tensor_name`` (output, dgrad or wgrad), modified and inspected as planned; ``probe``: its
        non-finite probe, where the GEMM gave one (``gemm_and_probe``)."""
        if not self._open:
            return tensor
        plan = self.plan.tensors[tensor_name]
        gemm = TENSOR_GEMMS[tensor_name][0]
        iteration = _iteration()
        if plan.gemms[gemm] is Precision.MODIFY:
            tensor = self.routes.call("modify_tensor", self.layer_name, tensor_name, gemm)(
                tensor=tensor,
                default_quantizer=None,
                iteration=iteration,
            )
            probe = None  # it told of the GEMM's result, not of what a feature made of it
        if plan.inspect and tensor_name in self.inspected:
            inspected = detached(tensor)
            if probe is not None:
                RESULT_PROBES[id(inspected)] = probe
            try:
                self._inspect(tensor_name, inspected, iteration, None, None, None)
            finally:
                RESULT_PROBES.pop(id(inspected), None)
        return tensor

    def _inspect(
        self,
        tensor_name: str,
        tensor: torch.Tensor,
        iteration: int,
        rowwise: Operand | None,
        columnwise: Operand | None,
        quantizer: Quantizer | None,
    ) -> None:
        with STATS_BUFFERS.one_launch(tensor):  # every statistics feature on this tensor shares one kernel
            self.routes.call("inspect_tensor", self.layer_name, tensor_name)(
                tensor=tensor,
                iteration=iteration,
                tp_group=self.tp_group,
                tp_size=self.tp_size,
                rowwise_quantized_tensor=rowwise,
                columnwise_quantized_tensor=columnwise,
                quantizer=quantizer,
            )
