"""Reuse of a layer's weight cast while the weight is unchanged."""

from __future__ import annotations

import torch

from lowprec.quantization import Float8Tensor, Quantizer, uses_fused_kernels


class WeightCache:
    """A layer's last weight cast, reused while the weight is unchanged: across the micro-batches of
    a step (Transformer Engine's ``is_first_microbatch`` idea, decided here from the weight itself).

    The weight counts as unchanged while its storage, its version counter (bumped by every in-place
    update such as an optimizer step), the quantizer and the layout asked for stay the same. Writes
    through ``weight.data`` bypass the version counter: call ``clear()`` after such a write. With
    delayed scaling a reused cast records no new amax, as in Transformer Engine.
    """

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._cast: Float8Tensor | None = None

    def quantize(self, weight: torch.Tensor, quantizer: Quantizer, transpose: bool) -> Float8Tensor:
        key = (weight.data_ptr(), weight._version, weight.shape, weight.dtype, quantizer)
        cached = self._cast  # set together with the key, so a matching key means a cast is there
        if key != self._key or (transpose and cached.other_layout is None and uses_fused_kernels(weight)):
            cached = quantizer.quantize(weight, transpose)
            self._key, self._cast = key, cached
        return cached

    def clear(self) -> None:
        self._key = self._cast = None
