"""E independent GEMMs over consecutive row groups of one input: the experts of a mixture of experts.

Each group ``i`` (expert ``i``) is its own debug layer ``{layer}.gemm_{i}``, as in Transformer Engine's
``GroupedLinear``, with its own ``GemmUnit``: its own quantizers (scales, amax history), weight cache and
routing plan, so a config can select one expert, all of them, or none. Its weight is ``weight[i]``, a view
of one 3-D Parameter ``(groups, out_features, in_features)``: gradients flow back into that Parameter.

Whenever an expert is inspected at a step, the number of rows (tokens) it received is logged beside its
statistics as ``{layer}.gemm_{i}_activation_tokens``, summed over the step's micro-batches (and reduced over
ranks like its activation statistics); an expert that received none logs 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

import nvdlfw_inspect.api as debug_api
from lowprec.modules.gemm_unit import GemmUnit, autocast_dtype, run_eagerly
from lowprec.modules.recompute import in_backward
from nvdlfw_inspect.debug_manager import held
from nvdlfw_inspect.stats.buffers import STATS_BUFFERS
from nvdlfw_inspect.stats.fields import empty_partials, set_fields

TOKENS_TENSOR, TOKENS_STAT = "activation", "tokens"


def gemm_name(layer_name: str, index: int) -> str:
    """The debug layer name of group ``index``: Transformer Engine's ``{layer}.gemm_{i}``."""
    return f"{layer_name}.gemm_{index}"


class GroupedGemm:
    """The ``GemmUnit`` of every group and the grouped forward (see the module docstring)."""

    def __init__(self, num_gemms: int, layer_types: tuple[str, ...]):
        self.units = tuple(GemmUnit(layer_types) for _ in range(num_gemms))

    def names(self, layer_name: str) -> list[str]:
        return [gemm_name(layer_name, i) for i in range(len(self.units))]

    def forward(
        self,
        layer_name: str,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        m_splits: Sequence[int],
        training: bool = True,
    ) -> torch.Tensor:
        """``x`` (rows grouped as ``m_splits`` says, ``sum(m_splits)`` in all) through ``weight[i]`` (and ``bias[i]``)
        for group ``i``; the outputs in the same row order. A group of no rows runs no GEMM. ``training``: the
        module's mode."""
        if torch.compiler.is_compiling():  # the routing plan and the token statistics are host-side
            return run_eagerly(self.forward, layer_name, x, weight, bias, m_splits, training)
        manager = debug_api.DEBUG_MANAGER  # paused (an evaluation) or recomputing (counted already): nothing to count
        log_tokens = manager is not None and not manager.paused and not in_backward()
        outputs = []
        for i, (unit, rows) in enumerate(zip(self.units, x.split(list(m_splits)), strict=True)):
            name = gemm_name(layer_name, i)
            if log_tokens:
                _log_tokens(unit, name, rows, training)
            expert_bias = None if bias is None else bias[i]
            if rows.shape[0] == 0:
                outputs.append(_empty_output(rows, weight.shape[1]))
            else:
                outputs.append(unit.linear(name, rows, weight[i], expert_bias, training))
        return torch.cat(outputs)


def _empty_output(rows: torch.Tensor, out_features: int) -> torch.Tensor:
    """The output of a group of no rows, in the dtype its GEMM would give (``torch.autocast``'s when on). No GEMM
    runs: an empty tensor has no amax to cast with, and a high-precision GEMM would save a view of the weight
    for backward, which makes every other group's weight cache distrust the shared storage (``weight_cache``)."""
    return rows.new_zeros((0, out_features), dtype=autocast_dtype(rows) or rows.dtype)


def _log_tokens(unit: GemmUnit, name: str, rows: torch.Tensor, training: bool) -> None:
    """Feed the rows ``unit`` receives to its ``tokens`` statistic when its plan inspects any of its tensors.
    The plan is the one the unit's GEMM runs with (cached per iteration), so the count appears exactly when
    the expert's statistics do, at the steps their features are due."""
    plan = unit.debug.plan_for(name, unit.gemm_quantizers(name, training).formats, unit.layer_types)
    if plan is None or not any(tensor.inspect for tensor in plan.tensors.values()):
        return
    manager = unit.debug.session
    with held(manager) as open_:
        if not open_:  # end_debug() on another thread since the plan: nothing to count into
            return
        partials = set_fields(empty_partials(rows.device), {"count": float(rows.shape[0])})  # a host number: no sync
        STATS_BUFFERS.feed(
            (name, TOKENS_TENSOR, TOKENS_STAT),
            layer_name=name,
            tensor_name=TOKENS_TENSOR,
            stats=[(TOKENS_STAT, "count")],
            iteration=manager._trainer_iteration_count,
            partials=partials,
            reduction_group=manager._tensor_reduction_group,
            accumulate=True,
        )
