"""The weight cache: one cast of a weight for every micro-batch, a fresh one after each optimizer step."""

from __future__ import annotations

import torch

from lowprec.formats.elements import E4M3
from lowprec.quant.per_tensor import CurrentScalingQuantizer, DelayedScalingQuantizer
from lowprec.quant.weight_cache import WeightCache


class CountingQuantizer(CurrentScalingQuantizer):
    def __init__(self):
        super().__init__(E4M3)
        self.casts = 0

    def quantize(self, tensor, transpose=False):
        self.casts += 1
        return super().quantize(tensor, transpose)


def test_weight_cache_reuses_the_cast_until_the_weight_changes():
    weight = torch.nn.Parameter(torch.randn(8, 8))
    cache, quantizer = WeightCache(), CountingQuantizer()
    first = cache.quantize(weight, quantizer, transpose=False)
    assert cache.quantize(weight, quantizer, transpose=True) is first and quantizer.casts == 1
    with torch.no_grad():
        weight.add_(1.0)  # an optimizer step
    second = cache.quantize(weight, quantizer, transpose=False)
    assert quantizer.casts == 2 and torch.equal(second.dequantize(), quantizer.quantize(weight.detach()).dequantize())
    other = CountingQuantizer()  # a new recipe brings new quantizers
    assert cache.quantize(weight, other, transpose=False) is not second and other.casts == 1
    cache.clear()
    cache.quantize(weight, other, transpose=False)
    assert other.casts == 2


def test_micro_batches_share_the_weight_cast_and_optimizer_steps_renew_it(monkeypatch):
    import lowprec

    layer = lowprec.Linear(16, 8, name="fc")
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    casts = []
    original = DelayedScalingQuantizer.quantize

    def counting(self, tensor, transpose=False):
        casts.append(tuple(tensor.shape))
        return original(self, tensor, transpose)

    monkeypatch.setattr(DelayedScalingQuantizer, "quantize", counting)
    for _ in range(2):
        for _ in range(3):  # micro-batches
            with lowprec.fp8_autocast():
                layer(torch.randn(4, 16)).sum().backward()
        optimizer.step()
    weight_casts = casts.count((8, 16))
    assert weight_casts == 2 and casts.count((4, 16)) == 6 and casts.count((4, 8)) == 6
