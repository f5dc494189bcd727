"""The autograd function shared by every GEMM-bearing layer: fprop, dgrad and wgrad in one place.

For ``y = x W^T + b`` the three GEMMs are fprop ``x W^T``, dgrad ``dy W`` and wgrad ``dy^T x``.
Running them here, not through ``torch.nn.functional.linear``, lets each operand be quantized,
modified or inspected on its way in, and each result on its way out.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from lowprec.gemm import Operand, gemm_and_probe
from lowprec.modules.gemm_quantizers import GemmQuantizers
from lowprec.quant.protocol import CastState, QuantizedTensor, Quantizer
from lowprec.quant.weight_cache import WeightCache


class Processing(Protocol):
    """How a layer turns tensors into GEMM operands and treats GEMM results. ``transpose`` says that
    an FP8 operand should also carry its other memory order (a GEMM will want it). The calls of one forward, and
    those of one backward, run inside one ``with processing:`` (the debug path holds the debug session for it)."""

    def __enter__(self) -> object: ...

    def __exit__(self, *exc_info: object) -> None: ...

    def input(self, tensor_name: str, tensor: torch.Tensor, transpose: bool = False) -> tuple[Operand, Operand]: ...

    def output(self, tensor_name: str, tensor: torch.Tensor, probe: torch.Tensor | None = None) -> torch.Tensor: ...


class PlainProcessing:
    """No debug feature: quantize each input with the quantizer of each GEMM that reads it, once when one recipe
    runs both; the weight through ``weight_caches`` (one per GEMM position), so micro-batches of one step share its
    casts."""

    def __init__(self, quantizers: GemmQuantizers, weight_caches: tuple[WeightCache, WeightCache] | None = None):
        self.quantizers = quantizers
        self.weight_caches = weight_caches

    def __enter__(self) -> PlainProcessing:
        return self

    def __exit__(self, *exc_info: object) -> None:
        pass

    def input(self, tensor_name: str, tensor: torch.Tensor, transpose: bool = False) -> tuple[Operand, Operand]:
        first, second = self.quantizers.pair(tensor_name)
        if first is second:
            operand = self._cast(tensor_name, tensor, first, transpose, 0)
            return operand, operand
        # two recipes: the first GEMM reads the tensor as laid out; the second (when it runs) its transpose. Both casts
        # come before any high-precision operand: a view of the weight alive during a cast makes its cache distrust
        # the storage (``owns_its_storage``) and cast it anew at every micro-batch
        first_cast = None if first is None else self._cast(tensor_name, tensor, first, False, 0)
        second_cast = None if second is None or not transpose else self._cast(tensor_name, tensor, second, True, 1)
        return (
            tensor.detach() if first_cast is None else first_cast,
            tensor.detach() if second_cast is None else second_cast,
        )

    def _cast(
        self, tensor_name: str, tensor: torch.Tensor, quantizer: Quantizer | None, transpose: bool, position: int
    ) -> Operand:
        if quantizer is None:
            return tensor.detach()
        if tensor_name == "weight" and self.weight_caches is not None:
            return self.weight_caches[position].quantize(tensor, quantizer, transpose)
        return quantizer.quantize(tensor, transpose)

    def output(self, tensor_name: str, tensor: torch.Tensor, probe: torch.Tensor | None = None) -> torch.Tensor:
        return tensor


OperandKind = tuple[type[QuantizedTensor], tuple[str, ...], dict[str, Any]] | None
"""How to rebuild a saved operand: a quantized tensor's class, the names of its inner tensors and its
metadata, or None for a plain tensor."""


def save_operands(ctx: Any, *operands: Operand) -> list[OperandKind]:
    """Save the operands' tensors with ``ctx.save_for_backward``, so that activation checkpointing,
    ``saved_tensors_hooks`` and CPU offload see (and may drop, move or recompute) every one of them."""
    tensors: list[torch.Tensor | None] = []
    kinds: list[OperandKind] = []
    for operand in operands:
        if isinstance(operand, QuantizedTensor):
            inner = operand.inner_tensors()
            tensors.extend(inner.values())
            kinds.append((type(operand), tuple(inner), operand.metadata()))
        else:
            tensors.append(operand)
            kinds.append(None)
    ctx.save_for_backward(*tensors)
    return kinds


def saved_operands(ctx: Any) -> list[Operand]:
    """The operands ``save_operands`` saved, rebuilt."""
    tensors = iter(ctx.saved_tensors)
    operands: list[Operand] = []
    for kind in ctx.operand_kinds:
        if kind is None:
            operands.append(next(tensors))
        else:
            cls, names, metadata = kind
            operands.append(cls.from_inner({name: next(tensors) for name in names}, metadata))
    return operands


def cast_states(*operands: Operand) -> dict[str, tuple[CastState, CastState]]:
    """The cast states of the activation and weight operands of a forward (activation fprop and wgrad operands, then
    weight fprop and dgrad ones), per tensor those of its first and second GEMM's operand: what a recomputation
    casts with."""
    states: dict[str, tuple[CastState, CastState]] = {}
    for name, pair in (("activation", operands[:2]), ("weight", operands[2:])):
        state = tuple(operand.cast_state() if isinstance(operand, QuantizedTensor) else None for operand in pair)
        if any(part is not None for part in state):
            states[name] = state
    return states


class LinearFunction(torch.autograd.Function):
    """``y = x W^T + b`` with every operand of the three GEMMs passing through ``processing``."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, processing: Processing
    ) -> torch.Tensor:
        x2d = x.reshape(-1, x.shape[-1])
        needs_dgrad, needs_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        with processing:
            activation_fprop, activation_wgrad = processing.input("activation", x2d, transpose=needs_wgrad)
            weight_fprop, weight_dgrad = processing.input("weight", weight, transpose=needs_dgrad)
            out = processing.output("output", *gemm_and_probe(activation_fprop, weight_fprop.t(), x.dtype, bias))
        ctx.processing = processing
        ctx.cast_states = cast_states(activation_fprop, activation_wgrad, weight_fprop, weight_dgrad)
        ctx.operand_kinds = save_operands(ctx, activation_wgrad, weight_dgrad)
        ctx.x_shape, ctx.weight_dtype, ctx.has_bias = x.shape, weight.dtype, bias is not None
        ctx.bias_dtype = bias.dtype if bias is not None else None
        # not a view of ``out``: autograd forbids in-place updates of a custom function's view outputs, and
        # models do update them (Falcon: ``mlp_output += attention_output``); matmul does the same
        return torch.ops.aten._unsafe_view(out.contiguous(), (*x.shape[:-1], weight.shape[0]))

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        processing: Processing = ctx.processing
        activation_wgrad, weight_dgrad = saved_operands(ctx)
        ctx.backward_done = True  # tells the layer's forward history (recompute.py) this forward is finished
        dy = grad_out.reshape(-1, grad_out.shape[-1])
        dx = dw = db = None
        with processing:
            gradient_dgrad, gradient_wgrad = processing.input("gradient", dy, transpose=ctx.needs_input_grad[1])
            if ctx.needs_input_grad[0]:
                dx = processing.output("dgrad", *gemm_and_probe(gradient_dgrad, weight_dgrad, dy.dtype))
                dx = dx.reshape(ctx.x_shape)
            if ctx.needs_input_grad[1]:
                dw = processing.output("wgrad", *gemm_and_probe(gradient_wgrad.t(), activation_wgrad, dy.dtype))
                dw = dw.to(ctx.weight_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy.sum(dim=0).to(ctx.bias_dtype)
        return dx, dw, db, None
