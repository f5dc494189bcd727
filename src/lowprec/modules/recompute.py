"""Activation checkpointing: a recomputed forward must repeat its original forward exactly.

``torch.utils.checkpoint`` (``use_reentrant=False``) reruns a region's forward during backward to get
back the tensors it saved. By then the user's ``fp8_autocast`` has usually exited, delayed-scaling
quantizers have moved to the next scale and the debug session may have logged the step; a naive rerun
would run in high precision, cast with other scales, record amaxes twice and log statistics twice.

So a ``GemmUnit`` remembers each of its forwards whose autograd graph may still need it (the recipe and
debug plan it ran with, and its autograd node, which knows the state of its casts), and a forward that
runs inside a backward replays the oldest unfinished one: micro-batches and pipeline schedules run their
backwards in the order of their forwards. The replay casts with the original scales (block recipes
compute theirs from the tensor, which is the same again) and the original stochastic-rounding noise,
records no amax, advances no noise stream and inspects nothing; ``modify_tensor`` features run again,
as they must to give the same tensors.

``use_reentrant=True`` differs: the original forward runs under ``torch.no_grad()`` inside torch's
``CheckpointFunction``, so it leaves no autograd node, and the backward that runs is the recomputed
graph's. So a forward inside a reentrant checkpoint hands its recipe, debug plan, quantizers and cast
states to that checkpoint's node (the ctx of ``CheckpointFunction``, which is the current autograd node
when its backward recomputes the region), and the recomputation takes them from there: it repeats the
forward's casts and inspects nothing of it, while its backward casts the gradient live and inspects the
gradient, dgrad and wgrad, as the original graph's backward would have. A reentrant checkpoint nested
in another checkpoint would run its forward inside a recomputation, where the two cannot be told apart:
that raises an error that names ``use_reentrant=False``.
"""

from __future__ import annotations

import sys
import weakref
from collections import deque
from typing import Any, NamedTuple

import torch
from torch.utils.checkpoint import CheckpointFunction

from lowprec.debug.plan import LayerPlan
from lowprec.errors import LowprecValueError
from lowprec.gemm import Operand
from lowprec.modules.gemm_quantizers import GemmQuantizers
from lowprec.modules.linear_function import Processing, cast_states
from lowprec.quant.protocol import CastState

_CHECKPOINT_FORWARD = CheckpointFunction.forward.__code__
_CHECKPOINT_NODE = CheckpointFunction._backward_cls  # the class of its ctx, which is its autograd node
NESTED_REENTRANT = (
    "a reentrant activation checkpoint (torch.utils.checkpoint with use_reentrant=True) {where}: lowprec cannot tell "
    "its recomputations apart; use use_reentrant=False (torch.utils.checkpoint.checkpoint(..., use_reentrant=False), "
    'or gradient_checkpointing_kwargs={{"use_reentrant": False}} in transformers)'
)


def in_backward() -> bool:
    """Whether autograd is running a backward on this thread: a forward now is a recomputation."""
    return torch._C._current_graph_task_id() != -1


class Forward(NamedTuple):
    """One remembered forward: its autograd node (``LinearFunction``'s ctx) and what it ran with."""

    node: Any
    quantizers: GemmQuantizers
    plan: LayerPlan | None


class ForwardHistory:
    """A unit's forwards whose backward has not run yet, oldest first. Entries hold their node weakly:
    a graph freed without a backward (evaluation with grad on, a dropped loss) leaves nothing behind."""

    def __init__(self) -> None:
        self._entries: deque[tuple[weakref.ref, GemmQuantizers, LayerPlan | None]] = deque()

    def remember(self, node: Any, quantizers: GemmQuantizers, plan: LayerPlan | None) -> None:
        self._drop_finished()
        self._entries.append((weakref.ref(node), quantizers, plan))

    def oldest(self) -> Forward | None:
        """Take the oldest unfinished forward (a recomputation replays it), or None if there is none:
        the original forward ran ``torch.nn.functional.linear`` (no FP8, no debug feature)."""
        self._drop_finished()
        if not self._entries:
            return None
        node_ref, quantizers, plan = self._entries.popleft()
        return Forward(node_ref(), quantizers, plan)

    def _drop_finished(self) -> None:
        while self._entries:
            node = self._entries[0][0]()
            if node is not None and not getattr(node, "backward_done", False):
                return
            self._entries.popleft()

    def __len__(self) -> int:
        return len(self._entries)


def reentrant_checkpoint() -> Any | None:
    """The node of the reentrant checkpoint whose forward runs on this thread (it runs without grad), or
    None; an error if two do (one nested in the other). Walks the Python stack (about 55 ns a frame): only
    FP8 or debugged forwards without grad pay for it."""
    found = None
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _CHECKPOINT_FORWARD:
            if found is not None:
                raise LowprecValueError(NESTED_REENTRANT.format(where="inside another one"))
            found = frame.f_locals["ctx"]
        frame = frame.f_back
    return found


def check_not_in_reentrant_checkpoint() -> None:
    """A forward inside a backward, without grad: a recomputation that runs a reentrant checkpoint's forward."""
    if not torch.is_grad_enabled() and reentrant_checkpoint() is not None:
        raise LowprecValueError(NESTED_REENTRANT.format(where="inside a recomputed checkpoint region"))


def in_reentrant_recomputation() -> bool:
    """Whether torch's reentrant checkpoint is recomputing its region: its node is the current one."""
    return isinstance(torch._C._current_autograd_node(), _CHECKPOINT_NODE)


def refuse_backpropagation(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
    """A prehook for the graph of a forward recomputed for its saved tensors, which nothing should
    backpropagate: if something does, a reentrant checkpoint that is not torch's recomputed it, with
    casts that need not be the original forward's."""
    raise LowprecValueError(
        "a lowprec layer's forward recomputed during backward is being backpropagated: a reentrant activation "
        "checkpoint that lowprec does not recognise (it recognises torch.utils.checkpoint's) recomputed it, and "
        "its gradients would not be those of the original forward's casts; use a non-reentrant checkpoint "
        "(torch.utils.checkpoint.checkpoint(..., use_reentrant=False))"
    )


class Replay(NamedTuple):
    """What a forward inside a reentrant checkpoint ran with: its recomputation repeats it."""

    quantizers: GemmQuantizers
    cast_states: dict[str, tuple[CastState, CastState]]
    plan: LayerPlan | None


class ReentrantForwards:
    """A unit's forwards inside reentrant checkpoints, in call order per checkpoint node, held as long as
    the node is (a graph freed without a backward leaves nothing behind)."""

    def __init__(self) -> None:
        self._by_node: weakref.WeakKeyDictionary[Any, deque[Replay]] = weakref.WeakKeyDictionary()

    def record(self, node: Any, replay: Replay) -> None:
        self._by_node.setdefault(node, deque()).append(replay)

    def take(self) -> Replay | None:
        """The oldest forward not yet repeated of the reentrant checkpoint recomputing its region (see
        ``in_reentrant_recomputation``), or None if the original ran ``torch.nn.functional.linear``."""
        replays = self._by_node.get(torch._C._current_autograd_node())
        return replays.popleft() if replays else None

    def __len__(self) -> int:
        return sum(len(replays) for replays in self._by_node.values())


class CastRecorder:
    """Processing that keeps the cast states of the activation and weight operands it hands out: a
    forward without an autograd node (inside a reentrant checkpoint) has no ctx to find them on.

    Without grad, an input computed inside the region does not require grad, so the forward cannot tell whether the
    recomputation will want the weight's dgrad. When another recipe than fprop's runs dgrad (``quantizers`` does not
    share the tensor's cast), that cast is made here anyway, as a forward with grad makes it, so that the recomputation
    repeats it (its scale; a delayed-scaling amax recorded once, in forward) instead of making a first one."""

    def __init__(self, processing: Processing, quantizers: GemmQuantizers):
        self.processing = processing
        self.quantizers = quantizers
        self._operands: dict[str, tuple[Operand, Operand]] = {}

    def __enter__(self) -> object:
        return self.processing.__enter__()

    def __exit__(self, *exc_info: object) -> None:
        self.processing.__exit__(*exc_info)

    def input(self, tensor_name: str, tensor: torch.Tensor, transpose: bool = False) -> tuple[Operand, Operand]:
        transpose = transpose or not self.quantizers.shared(tensor_name)
        self._operands[tensor_name] = self.processing.input(tensor_name, tensor, transpose)
        return self._operands[tensor_name]

    def output(self, tensor_name: str, tensor: torch.Tensor, probe: torch.Tensor | None = None) -> torch.Tensor:
        return self.processing.output(tensor_name, tensor, probe)

    def cast_states(self) -> dict[str, tuple[CastState, CastState]]:
        return cast_states(*self._operands["activation"], *self._operands["weight"])
