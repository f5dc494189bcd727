"""Seeds derived from a recipe's seed, so every random choice of a run is reproducible and independent.

Stochastic rounding draws fresh noise for every cast from a ``torch.Generator`` seeded with
``derived_seed(seed, layer, tensor, cast number, orientation)``: the same run repeats its bits, a
recomputed forward (activation checkpointing) given the cast number of its original repeats them too,
and the global random state is never touched.
"""

from __future__ import annotations

import hashlib

import torch


def derived_seed(seed: int, *parts: object) -> int:
    """A 63-bit seed from ``seed`` and ``parts`` (their ``str``), the same on every platform and process."""
    text = "/".join(str(part) for part in (seed, *parts))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


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
        generator = torch.Generator(device=device).manual_seed(derived_seed(self.seed, self.name, offset, part))
        return torch.rand(shape, generator=generator, device=device)
