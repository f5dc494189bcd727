"""Reuse of a layer's weight cast while the weight is unchanged."""

from __future__ import annotations

import weakref

import torch

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
    """A layer's last weight cast, reused while the weight is unchanged: across the micro-batches of
    a step (Transformer Engine's ``is_first_microbatch`` idea, decided here from the weight itself).

    The weight counts as unchanged while it is the same tensor (the one it is a view of, for a view)
    at the same address and layout, with the same version counter (bumped by every in-place update
    such as an optimizer step), dtype and quantizer. These checks cost nothing; comparing values would
    read the whole weight, about as much as casting it again. A new tensor at a freed weight's address
    (a weight computed in forward) is told apart by identity.

    The checks only hold for a weight that owns its storage (``owns_its_storage``). A weight sharing
    its storage, as FSDP2's unsharded parameters share their all-gather buffer, is cast on every call
    (under delayed scaling each of those casts records its amax). Writes through a temporary
    ``weight.data`` bypass the version counter: call ``clear()`` after such a write. With delayed
    scaling a reused cast records no new amax, as in Transformer Engine.
    """

    def __init__(self) -> None:
        self._owner: weakref.ref[torch.Tensor] | None = None
        self._key: tuple | None = None
        self._cast: Float8Tensor | BlockScaledTensor | None = None

    def quantize(self, weight: torch.Tensor, quantizer: Quantizer, transpose: bool) -> Float8Tensor | BlockScaledTensor:
        if not owns_its_storage(weight):
            self.clear()
            return quantizer.quantize(weight, transpose)
        owner = weight if weight._base is None else weight._base
        key = (weight.data_ptr(), weight._version, weight.shape, weight.stride(), weight.dtype, quantizer)
        cached = self._cast  # set together with the key and owner, so a matching key means a cast is there
        fresh = key != self._key or self._owner is None or self._owner() is not owner
        if fresh or (transpose and lacks_transpose(cached, weight)):
            cached = quantizer.quantize(weight, transpose)
            self._owner, self._key, self._cast = weakref.ref(owner), key, cached
        return cached

    def clear(self) -> None:
        self._owner = self._key = self._cast = None
