"""A layer's debug plan for one iteration: for every tensor and GEMM, what the layer does with it.

The plan comes from the routing calls (``*_enabled``) of the ``transformer_engine`` namespace, asked
once per layer per iteration. Each input tensor gets a precision for each of its two GEMMs, each
output tensor whether it is modified; any tensor may be inspected.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import nvdlfw_inspect.api as debug_api
from lowprec.debug.features.api import normalize_answer
from lowprec.debug.names import INPUT_TENSORS, ROUTING_ORDER, TENSOR_GEMMS


class Precision(Enum):
    QUANTIZE = "FP8 quantization"
    HIGH_PRECISION = "High precision"
    MODIFY = "modify_tensor()"


@dataclass
class TensorPlan:
    """What happens to one tensor: per GEMM that consumes (or produces) it, and whether it is inspected."""

    name: str
    gemms: dict[str, Precision]
    inspect: bool = False
    inspect_postquantize: dict[str, bool] = field(default_factory=dict)

    @property
    def quantized_anywhere(self) -> bool:
        return Precision.QUANTIZE in self.gemms.values()

    def active(self, fp8: bool) -> bool:
        """Whether a feature touches this tensor (so the layer must take the debug path)."""
        if self.inspect or any(self.inspect_postquantize.values()):
            return True
        if Precision.MODIFY in self.gemms.values():
            return True
        # with FP8 on, an input tensor kept in high precision is a feature's doing too
        return fp8 and self.name in INPUT_TENSORS and not all(p is Precision.QUANTIZE for p in self.gemms.values())


@dataclass
class LayerPlan:
    layer_name: str
    iteration: int
    fp8: bool
    tensors: dict[str, TensorPlan]
    next_iteration: int | None

    @property
    def active(self) -> bool:
        return any(plan.active(self.fp8) for plan in self.tensors.values())

    def precision(self, tensor: str, gemm: str) -> Precision:
        return self.tensors[tensor].gemms[gemm]


class _Asker:
    """Asks the routing calls for one layer and iteration, tracking the earliest next iteration."""

    def __init__(self, layer_name: str, iteration: int):
        self.layer_name = layer_name
        self.iteration = iteration
        self.next_iteration: int | None = None
        self.fp8_gemm: dict[str, bool] = {}
        self.api = debug_api.transformer_engine

    def _note(self, answer: object) -> bool:
        enabled, upcoming = normalize_answer(answer, self.iteration)
        if upcoming is not None:
            self.next_iteration = upcoming if self.next_iteration is None else min(self.next_iteration, upcoming)
        return enabled

    def inspect(self, tensor: str) -> bool:
        return self._note(
            self.api.inspect_tensor_enabled(layer_name=self.layer_name, tensor_name=tensor, iteration=self.iteration)
        )

    def inspect_postquantize(self, tensor: str, gemm: str) -> bool:
        return self._note(
            self.api.inspect_tensor_postquantize_enabled(
                layer_name=self.layer_name, tensor_name=tensor, gemm=gemm, iteration=self.iteration
            )
        )

    def modify(self, tensor: str, gemm: str) -> bool:
        return self._note(
            self.api.modify_tensor_enabled(layer_name=self.layer_name, tensor_name=tensor, gemm=gemm, iteration=self.iteration)
        )

    def fp8(self, gemm: str) -> bool:
        if gemm not in self.fp8_gemm:
            answer = self.api.fp8_gemm_enabled(layer_name=self.layer_name, gemm=gemm, iteration=self.iteration)
            self.fp8_gemm[gemm] = self._note(answer)
        return self.fp8_gemm[gemm]


def build_plan(layer_name: str, iteration: int, fp8: bool) -> LayerPlan:
    """Ask every routing call for ``layer_name`` at ``iteration`` (``fp8``: a recipe is active)."""
    ask = _Asker(layer_name, iteration)
    tensors: dict[str, TensorPlan] = {}
    for tensor in ROUTING_ORDER:
        own_gemms = [g for g in TENSOR_GEMMS[tensor] if g is not None]
        plan = TensorPlan(tensor, {}, inspect=ask.inspect(tensor))
        if tensor in INPUT_TENSORS:
            plan.inspect_postquantize = {g: ask.inspect_postquantize(tensor, g) for g in own_gemms}
            for gemm in own_gemms:
                if ask.modify(tensor, gemm):
                    plan.gemms[gemm] = Precision.MODIFY
                elif fp8 and ask.fp8(gemm):
                    plan.gemms[gemm] = Precision.QUANTIZE
                else:
                    plan.gemms[gemm] = Precision.HIGH_PRECISION
        else:
            gemm = own_gemms[0]
            plan.gemms[gemm] = Precision.MODIFY if ask.modify(tensor, gemm) else Precision.HIGH_PRECISION
        tensors[tensor] = plan
    result = LayerPlan(layer_name, iteration, fp8, tensors, ask.next_iteration)
    _log_plan(result)
    return result


def _log_plan(plan: LayerPlan) -> None:
    """One line per input tensor and GEMM, and per modified output, each written once per run."""
    for tensor in ROUTING_ORDER:
        tensor_plan = plan.tensors[tensor]
        for gemm, precision in tensor_plan.gemms.items():
            if tensor in INPUT_TENSORS or precision is Precision.MODIFY:
                debug_api.log_message(f"{plan.layer_name}: Tensor: {tensor}, gemm {gemm} - {precision.value}")
