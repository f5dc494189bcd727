"""Seeds derived from a recipe's seed, so every random choice of a run is reproducible and independent.

Stochastic rounding draws fresh noise for every cast from the key ``derived_seed(seed, layer, tensor,
cast number, orientation)``: the same run repeats its bits, a recomputed forward (activation
checkpointing) given the cast number of its original repeats them too, and the global random state is
never touched. The noise is a counter-based hash of each element's index under the key (``uniform``),
integer arithmetic that every device computes alike, so a cast on a GPU, in a fused Triton kernel or on
the CPU gives the same bits (a ``torch.Generator`` draws different numbers on each device).
"""

from __future__ import annotations

import hashlib

import torch


def derived_seed(seed: int, *parts: object) -> int:
    """A 63-bit seed from ``seed`` and ``parts`` (their ``str``), the same on every platform and process."""
    text = "/".join(str(part) for part in (seed, *parts))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


MASK32 = 0xFFFFFFFF
# odd multipliers below 2**31: int32 scalars, and a 32-bit value times one stays inside int64 (torch has no uint32 shifts)
HASH_MULTIPLIERS = (0x21F0AAAD, 0x735A2D97)
NOISE_BITS = 24  # fp32 holds every multiple of 2**-24 in [0, 1) exactly


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix (xorshift-multiply, two rounds) of ``x``: int32 bit patterns (products wrap, as
    two's complement does, and shifts are made logical by a mask: half the memory traffic of int64) or int64 in
    [0, 2**32), each as uint32 arithmetic would give it; a new tensor, the caller's stays as it was."""
    return hash32_(x.clone(), torch.empty_like(x))


def hash32_(x: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """:func:`hash32` of ``x`` written into ``x``, with ``scratch`` (its shape and dtype) for the shifted copies: no
    tensor allocated, 4x faster on a CPU than a new tensor per operation."""
    wide = x.dtype == torch.int64
    for multiplier in HASH_MULTIPLIERS:
        x.bitwise_xor_(torch.bitwise_right_shift(x, 16, out=scratch).bitwise_and_(0xFFFF))
        x.mul_(multiplier)
        if wide:
            x.bitwise_and_(MASK32)
    return x.bitwise_xor_(torch.bitwise_right_shift(x, 15, out=scratch).bitwise_and_(0x1FFFF))


def _int32(value: int) -> int:
    """The int32 of the same bits as ``value`` in [0, 2**32)."""
    return value - (1 << 32) if value >= 1 << 31 else value


def uniform(key: int, shape: torch.Size | tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Noise in [0, 1), fp32 multiples of 2**-24, for the elements of ``shape`` in row-major order:
    ``hash32(hash32(index_low ^ key_low) ^ index_high ^ key_high) >> 8`` times 2**-24, with the 64-bit
    ``key`` and index split into 32-bit halves; hashed in int32 where no index reaches 2**31 (6x faster on a
    CPU than int64), in place."""
    numel = torch.Size(shape).numel()
    if numel > 1 << 31:
        index = torch.arange(numel, dtype=torch.int64, device=device)
        scratch = torch.empty_like(index)
        mixed = hash32_((index & MASK32).bitwise_xor_(key & MASK32), scratch)
        mixed = hash32_(mixed.bitwise_xor_(index.bitwise_right_shift_(32)).bitwise_xor_(key >> 32), scratch)
    else:
        mixed = torch.arange(numel, dtype=torch.int32, device=device).bitwise_xor_(_int32(key & MASK32))
        scratch = torch.empty_like(mixed)
        mixed = hash32_(hash32_(mixed, scratch).bitwise_xor_(_int32(key >> 32)), scratch)
    bits = torch.bitwise_right_shift(mixed, 32 - NOISE_BITS, out=scratch).bitwise_and_((1 << NOISE_BITS) - 1)
    return bits.float().mul_(2.0**-NOISE_BITS).reshape(shape)


class RoundingStream:
    """The noise source of one quantizer: ``seed`` and ``name`` (layer and tensor) fix it, each cast takes
    the next ``offset``."""

    def __init__(self, seed: int, name: str):
        self.seed = seed
        self.name = name
        self.next_offset = 0

    def take(self) -> int:
        """The offset of a new cast."""
        offset = self.next_offset
        self.next_offset += 1
        return offset

    def noise(self, offset: int, part: str, shape: torch.Size, device: torch.device) -> torch.Tensor:
        """Uniform fp32 noise in [0, 1) for cast ``offset``; ``part`` tells a cast's tensors apart."""
        return uniform(self.key(offset, part), shape, device)

    def key(self, offset: int, part: str) -> int:
        """The 63-bit key of cast ``offset``'s ``part`` (see :func:`uniform`)."""
        return derived_seed(self.seed, self.name, offset, part)
