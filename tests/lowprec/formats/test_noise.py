"""Rounding noise: a counter-based hash of the element index, the same on every device."""

from __future__ import annotations

import torch

from lowprec.formats.noise import RoundingStream, uniform


def reference_hash32(x: int) -> int:
    """``noise.hash32`` on Python integers, written from its definition."""
    for multiplier in (0x21F0AAAD, 0x735A2D97):
        x ^= x >> 16
        x = (x * multiplier) % 2**32
    return x ^ (x >> 15)


def test_noise_is_a_counter_hash_of_the_element_index_the_same_on_every_device():
    key = (0xDEADBEEF << 32) | 0x12345678
    noise = uniform(key, (3, 5), torch.device("cpu"))
    want = [reference_hash32(reference_hash32(i ^ 0x12345678) ^ 0xDEADBEEF) >> 8 for i in range(15)]
    assert (noise * 2**24).flatten().tolist() == want and noise.dtype == torch.float32
    big = uniform(7, (200_000,), torch.device("cpu"))
    assert 0 <= big.min() and big.max() < 1 and abs(big.mean().item() - 0.5) < 0.005
    assert big.unique().numel() > 198_500  # about 1190 birthday repeats are expected among 2**24 values
    stream = RoundingStream(3, "fc1.gradient")
    assert torch.equal(stream.noise(2, "rowwise", (4, 4), torch.device("cpu")), uniform(stream.key(2, "rowwise"), (4, 4), "cpu"))
