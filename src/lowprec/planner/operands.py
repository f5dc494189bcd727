"""What-if statistics of the calibration: every GEMM operand of every layer, captured in high precision on a real
batch, cast in each candidate format as the GEMM would read it, and how much the cast loses.

Each GEMM reads its two operands in one orientation (``OPERANDS``): fprop the activation and the weight rowwise
(blocks along the input features), dgrad the output gradient rowwise and the weight columnwise (blocks along the
output features), wgrad the activation and the gradient columnwise (blocks along the tokens). An operand is cast
once per format (``lowprec.quantize``, the layers' own quantizers: both orientations at once), and per GEMM that
reads it, in that GEMM's orientation (``ERROR_STATS``):

- ``rel_mse``: ``||q(x) - x||^2 / ||x||^2`` (float64);
- ``underflow%``: the non-zero values that become zero, in % of the non-zero values;
- ``saturation%``: the values clipped to their block's largest magnitude (``|x|`` above the largest value the block
  represents, as ``saturated_blocks%`` counts a block's), in % of the non-zero values;
- ``worst_block_rel_err``: the largest ``||q - x||_2 / ||x||_2`` of a block (the whole tensor per-tensor).

Blocks are read as ``LogFp8TensorStats``'s per-block statistics read them (``per_block_stats.block_values``): a
cast through the Hadamard transform (NVFP4's wgrad operands) is judged where it quantizes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

import lowprec
from lowprec.debug.per_block_stats import block_values
from lowprec.debug.quantized_stats import from_block
from lowprec.modules.base import gemm_leaves
from lowprec.modules.gemm_unit import GemmUnit, autocast_dtype
from lowprec.modules.grouped_gemm import GroupedGemm
from lowprec.modules.recompute import in_backward
from lowprec.plan import named_recipe
from lowprec.quant.protocol import Float8Tensor
from lowprec.study import QuantizedView

#: per GEMM, the operands it reads (``lowprec.quantize``'s tensor names) and in which orientation
OPERANDS = {
    "fprop": (("activation", "rowwise"), ("weight", "rowwise")),
    "dgrad": (("gradient", "rowwise"), ("weight", "columnwise")),
    "wgrad": (("activation", "columnwise"), ("gradient", "columnwise")),
}
ERROR_STATS = ("rel_mse", "underflow%", "saturation%", "worst_block_rel_err")

Operands = dict[str, dict[str, list[torch.Tensor]]]
"""Per GEMM layer, per tensor name, the tensors its GEMMs read (one per forward or backward of the layer)."""


def _units(model: torch.nn.Module) -> list[GemmUnit]:
    return [
        unit
        for leaf in gemm_leaves(model)
        for value in vars(leaf).values()
        for unit in (value.units if isinstance(value, GroupedGemm) else (value,))
        if isinstance(unit, GemmUnit)
    ]


@contextmanager
def captured_operands(model: torch.nn.Module) -> Iterator[Operands]:
    """While open, the operands of every GEMM layer's forwards and backwards, detached 2-D tensors as its GEMMs
    read them before any cast: the layers' ``GemmUnit.linear`` is wrapped (on the instances, undone at exit), so
    what a layer computes before its GEMMs (a norm, the routing of experts) is already applied."""
    captured: Operands = {}
    units = _units(model)

    def recording(linear: Any) -> Any:
        def record(layer_name: str, x: torch.Tensor, weight: torch.Tensor, bias: Any, training: bool = True) -> Any:
            out = linear(layer_name, x, weight, bias, training)
            tensors = captured.setdefault(layer_name, {"activation": [], "weight": [], "gradient": []})
            if not in_backward():  # a forward inside a backward repeats one recorded already (checkpointing)
                x2d = x.detach().reshape(-1, x.shape[-1])
                tensors["activation"].append(x2d.to(autocast_dtype(x) or x.dtype))
                tensors["weight"].append(weight.detach())
            if out.requires_grad:  # the graph backpropagated: the first forward's, or a reentrant recomputation's
                out.register_hook(lambda grad: tensors["gradient"].append(grad.detach().reshape(-1, grad.shape[-1])))
            return out

        return record

    for unit in units:
        unit.linear = recording(unit.linear)
    try:
        yield captured
    finally:
        for unit in units:
            del unit.linear


def cast_errors(tensor: torch.Tensor, view: QuantizedView, orientation: str) -> dict[str, float]:
    """The ``ERROR_STATS`` of one orientation of ``view``, the cast of 2-D ``tensor``."""
    if isinstance(view.quantized, Float8Tensor):  # per tensor: one block, one scale
        x, v = tensor.float().reshape(1, 1, -1), view.dequantize().reshape(1, 1, -1)
        largest = (view.quantized.format.max * view.quantized.scale_inv.float()).reshape(1, 1)
    else:
        part = getattr(view.quantized, orientation)
        x, v = block_values(tensor, from_block(part, orientation == "columnwise"))
        largest = part.layout.element.max * part.scales.float()
        if part.tensor_scale_inv is not None:
            largest = largest * part.tensor_scale_inv
    nonzero = x != 0
    values = nonzero.sum().clamp(min=1).double()
    saturated = (x.abs() > v.abs()) & (v.abs() == largest.unsqueeze(-1))
    x64 = x.double()
    err, norm = (v.double() - x64).square().sum(-1), x64.square().sum(-1)
    blocks = torch.where(norm > 0, err / norm.where(norm > 0, 1.0), torch.where(err > 0, torch.inf, 0.0)).sqrt()
    stats = torch.stack(
        [
            err.sum() / norm.sum().where(norm.sum() > 0, 1.0),
            (nonzero & (v == 0)).sum() * 100 / values,
            saturated.sum() * 100 / values,
            blocks.amax(),
        ]
    )
    return dict(zip(ERROR_STATS, stats.tolist(), strict=True))


def operand_errors(operands: Operands, formats: Sequence[str]) -> dict[tuple[str, str, str], dict[str, dict[str, float]]]:
    """Per ``(layer, gemm, format)``, per operand, the ``ERROR_STATS`` of its cast in that format as that GEMM reads
    it; a layer's tensors of several forwards are read as one (their rows stacked). A layer with no gradient captured
    (no backward ran) has no dgrad and wgrad entries."""
    errors: dict[tuple[str, str, str], dict[str, dict[str, float]]] = {}
    for fmt in formats:
        recipe = named_recipe(fmt)
        for layer, tensors in operands.items():
            views = {
                name: (tensor, lowprec.quantize(tensor, recipe, name, layer_name=layer))
                for name, parts in tensors.items()
                if parts
                for tensor in [parts[0] if name == "weight" else torch.cat(parts)]
            }
            for gemm, reads in OPERANDS.items():
                if all(name in views for name, _ in reads):
                    errors[(layer, gemm, fmt)] = {name: cast_errors(*views[name], orientation) for name, orientation in reads}
    return errors
