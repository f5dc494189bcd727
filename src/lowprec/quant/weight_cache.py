"""Reuse of a layer's weight cast between the micro-batches of one optimizer step."""

from __future__ import annotations

import weakref
from functools import partial
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from lowprec import kernels
from lowprec.quant.protocol import BlockScaledTensor, Float8Tensor, Quantizer

_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)  # how many hold a storage (a private torch function)


def _unshared_use_count() -> int | None:
    """What ``_storage_use_count`` says of a tensor that shares its storage with no other tensor: the
    tensor and the Python storage object that asks (measured, not assumed). None without the function."""
    if _storage_use_count is None:
        return None
    tensor = torch.empty(1)
    storage = tensor.untyped_storage()
    return _storage_use_count(storage._cdata)


_UNSHARED = _unshared_use_count()


def owns_its_storage(weight: torch.Tensor) -> bool:
    """Whether no tensor but ``weight`` (and the tensor it is a view of) holds its storage.

    Another holder can rewrite the bytes without bumping ``weight``'s version counter, or free them
    and reallocate them at the same address. FSDP2 does both to the unsharded parameter it swaps into
    a module for forward: one Parameter for the whole run over the storage of its all-gather buffer,
    which it frees after each use (``resize_(0)``), reallocates at the next all-gather (often at the
    same address) and refills under ``torch.autograd._unsafe_preserve_version_counter``. Address,
    version (0 for good: the optimizer steps the sharded DTensor), shape and object then all match the
    previous step's weight, and the cache used to serve the old step's cast whenever the allocator
    handed the same address back.
    """
    if _storage_use_count is None or _UNSHARED is None:  # cannot tell: assume the worst
        return False
    storage = weight.untyped_storage()
    return _storage_use_count(storage._cdata) <= _UNSHARED + (weight._base is not None)


def lacks_transpose(cast: Float8Tensor | BlockScaledTensor, weight: torch.Tensor) -> bool:
    """Whether ``cast`` cannot serve a GEMM that reads ``weight`` transposed: a block cast made without
    its columnwise quantization, or a fused FP8 cast made without its other memory order."""
    if isinstance(cast, BlockScaledTensor):
        return cast.columnwise is None
    return cast.other_layout is None and kernels.runs_on(weight)


class WeightCache:
    """A layer's last weight cast, reused between the micro-batches of one optimizer step (Transformer
    Engine's ``is_first_microbatch`` idea, decided here from the weight and its gradient).

    A cast is served again only while all of these hold:

    - the weight is the same tensor (the one it is a view of, for a view) at the same address and
      layout, with the same version counter, dtype and quantizer; a new tensor at a freed weight's
      address (a weight computed in forward) is told apart by identity;
    - the weight owns its storage (``owns_its_storage``): FSDP2's unsharded parameters, which share their
      all-gather buffer, are cast on every call;
    - no ``torch.optim`` optimizer has stepped since the cast (fused optimizers do not bump the version
      counter);
    - the weight is a leaf that requires grad, a backward has added to its gradient since the cast, and
      the gradient is still that tensor (``zero_grad`` has not set it to None): we are between two
      micro-batches of one optimizer step.

    The last rule is what catches writes through ``weight.data`` (PEFT's ``merge_and_unload``, a
    ``load_state_dict`` of copies, hand edits), which no counter sees: they happen between steps, or
    on a frozen weight, which is cast at every forward (as are evaluation forwards). The one write it
    cannot see is one through ``.data`` between the backward of one micro-batch and the forward of the
    next; call ``clear()`` after such a write. With delayed scaling a reused cast records no new amax, as
    in Transformer Engine.

    A block-scaled cast also keeps the fp32 operands its emulated GEMMs decode (``BlockScaledData.kept``), reused
    and dropped with it: one more fp32 copy of the weight per orientation a GEMM read.
    """

    def __init__(self) -> None:
        self._owner: weakref.ref[torch.Tensor] | None = None
        self._key: tuple | None = None
        self._cast: Float8Tensor | BlockScaledTensor | None = None
        self._accumulated: weakref.ref[torch.Tensor] | None = None  # the owner's gradient, once a backward added to it
        self._hooked: weakref.ref[torch.Tensor] | None = None  # the owner whose accumulations we hear of

    def quantize(self, weight: torch.Tensor, quantizer: Quantizer, transpose: bool) -> Float8Tensor | BlockScaledTensor:
        owner = weight if weight._base is None else weight._base
        if not (owner.requires_grad and owner.is_leaf and owns_its_storage(weight)):
            self.clear()
            return quantizer.quantize(weight, transpose)
        _count_optimizer_steps()
        key = (weight.data_ptr(), weight._version, weight.shape, weight.stride(), weight.dtype, quantizer, _optimizer_steps)
        if self._serves(owner, key) and not (transpose and lacks_transpose(self._cast, weight)):
            return self._cast
        cast = quantizer.quantize(weight, transpose)
        if isinstance(cast, BlockScaledTensor):  # keep what the emulated GEMMs decode, for as long as the cast serves
            for part in (cast.rowwise, cast.columnwise):
                if part is not None:
                    part.kept = {}
        self._owner, self._key, self._cast, self._accumulated = weakref.ref(owner), key, cast, None
        self._listen(owner)
        return cast

    def _serves(self, owner: torch.Tensor, key: tuple) -> bool:
        """Whether the held cast is of this very weight, unchanged since (see the class docstring)."""
        if key != self._key or self._owner is None or self._owner() is not owner or self._accumulated is None:
            return False
        return owner.grad is not None and owner.grad is self._accumulated()

    def _listen(self, owner: torch.Tensor) -> None:
        """Hear of every accumulation into ``owner.grad`` (once per owner; the hook holds the cache weakly)."""
        if self._hooked is not None and self._hooked() is owner:
            return
        owner.register_post_accumulate_grad_hook(partial(_gradient_accumulated, weakref.ref(self)))
        self._hooked = weakref.ref(owner)

    def clear(self) -> None:
        self._owner = self._key = self._cast = self._accumulated = None


def _gradient_accumulated(cache_ref: weakref.ref[WeightCache], parameter: torch.Tensor) -> None:
    """A backward has added to ``parameter.grad``: a cast of ``parameter`` made before may serve the next
    micro-batch, as long as that gradient stays and no optimizer steps."""
    cache = cache_ref()
    if cache is None or cache._owner is None or cache._owner() is not parameter or parameter.grad is None:
        return
    cache._accumulated = weakref.ref(parameter.grad)


_optimizer_steps = 0  # steps taken by torch.optim optimizers since the first weight cast
_counting = False


def _count_optimizer_steps() -> None:
    """Start counting optimizer steps (a global hook on every ``torch.optim.Optimizer``, registered once)."""
    global _counting
    if not _counting:
        register_optimizer_step_post_hook(_optimizer_stepped)
        _counting = True


def _optimizer_stepped(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    global _optimizer_steps
    _optimizer_steps += 1
