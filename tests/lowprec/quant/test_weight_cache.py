"""The weight cache: one cast of a weight for the micro-batches of an optimizer step, a fresh one after
anything else (an optimizer step, fused or not, ``zero_grad``, a write through ``.data``)."""

from __future__ import annotations

import pytest
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


def accumulate(weight: torch.Tensor) -> None:
    """A micro-batch's backward: it adds to ``weight.grad``."""
    (weight * 0.5).sum().backward()


def test_weight_cache_reuses_the_cast_until_the_weight_changes():
    weight = torch.nn.Parameter(torch.randn(8, 8))
    cache, quantizer = WeightCache(), CountingQuantizer()
    first = cache.quantize(weight, quantizer, transpose=False)
    accumulate(weight)
    assert cache.quantize(weight, quantizer, transpose=True) is first and quantizer.casts == 1
    accumulate(weight)
    assert cache.quantize(weight, quantizer, transpose=True) is first and quantizer.casts == 1
    with torch.no_grad():
        weight.add_(1.0)  # an optimizer step
    second = cache.quantize(weight, quantizer, transpose=False)
    accumulate(weight)
    assert quantizer.casts == 2 and torch.equal(second.dequantize(), quantizer.quantize(weight.detach()).dequantize())
    other = CountingQuantizer()  # a new recipe brings new quantizers
    assert cache.quantize(weight, other, transpose=False) is not second and other.casts == 1
    cache.clear()
    cache.quantize(weight, other, transpose=False)
    assert other.casts == 2


def test_a_cast_made_before_the_gradient_was_accumulated_is_not_reused():
    """Two forwards without a backward between them (evaluation, or a write in between): cast twice."""
    weight = torch.nn.Parameter(torch.randn(8, 8))
    cache, quantizer = WeightCache(), CountingQuantizer()
    cache.quantize(weight, quantizer, transpose=False)
    cache.quantize(weight, quantizer, transpose=False)
    assert quantizer.casts == 2


def test_a_frozen_weight_is_cast_at_every_forward():
    """LoRA's base layers: nothing tells of a write through ``.data`` to a weight without a gradient."""
    weight = torch.nn.Parameter(torch.randn(8, 8), requires_grad=False)
    cache, quantizer = WeightCache(), CountingQuantizer()
    first = cache.quantize(weight, quantizer, transpose=False)
    weight.data += 1.0  # PEFT's merge: no version bump
    second = cache.quantize(weight, quantizer, transpose=False)
    assert quantizer.casts == 2 and not torch.equal(first.dequantize(), second.dequantize())


def holding(weight: torch.nn.Parameter) -> torch.nn.Module:
    module = torch.nn.Module()
    module.weight = weight
    return module


@pytest.mark.parametrize(
    "write, zero_grad",
    [
        pytest.param(lambda w, opt: opt.step(), True, id="fused-adam-step"),
        pytest.param(lambda w, opt: opt.step(), False, id="fused-adam-step-gradient-kept"),
        pytest.param(lambda w, opt: opt.zero_grad(set_to_none=False) or opt.step(), False, id="zeroed-then-fused-step"),
        pytest.param(lambda w, opt: holding(w).load_state_dict({"weight": torch.randn(8, 8)}), False, id="load_state_dict"),
        pytest.param(lambda w, opt: w.data.add_(1.0), True, id="data-write"),
        pytest.param(lambda w, opt: w.data.copy_(torch.randn_like(w)), True, id="data-copy"),
    ],
)
def test_writes_the_version_counter_misses_are_never_served_a_stale_cast(write, zero_grad):
    """Fused optimizers and ``.data`` writes leave ``weight._version`` alone: besides the version, the cache
    watches optimizer steps, and the gradient, which ``zero_grad`` sets to None between steps."""
    weight = torch.nn.Parameter(torch.randn(8, 8))
    optimizer = torch.optim.Adam([weight], lr=0.5, fused=True)
    cache, quantizer = WeightCache(), CountingQuantizer()
    cache.quantize(weight, quantizer, transpose=False)
    accumulate(weight)
    write(weight, optimizer)
    if zero_grad:
        optimizer.zero_grad()
    served = cache.quantize(weight, quantizer, transpose=False)
    assert quantizer.casts == 2
    assert torch.equal(served.dequantize(), quantizer.quantize(weight.detach()).dequantize())


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
        optimizer.zero_grad()
    weight_casts = casts.count((8, 16))
    assert weight_casts == 2 and casts.count((4, 16)) == 6 and casts.count((4, 8)) == 6


def test_a_cached_block_cast_decodes_the_weight_once_per_orientation(monkeypatch):
    """The emulated GEMMs of micro-batches 2 and on multiply the weight operands decoded for the first: the same
    bits, one decode per orientation and optimizer step."""
    import lowprec
    from lowprec.quant.protocol import BlockScaledData

    layer = lowprec.Linear(64, 32, name="fc")
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    decoded = []
    original = BlockScaledData.dequantize

    def counting(self):
        decoded.append(self.layout.shape)
        return original(self)

    monkeypatch.setattr(BlockScaledData, "dequantize", counting)
    x = torch.randn(4, 64, requires_grad=True)
    for _ in range(2):
        outputs = []
        for _ in range(3):  # micro-batches
            with lowprec.fp8_autocast(fp8_recipe=lowprec.MXFP8BlockScaling()):
                out = layer(x)
            out.sum().backward()
            outputs.append(out.detach())
        assert all(torch.equal(out, outputs[0]) for out in outputs)
        optimizer.step()
        optimizer.zero_grad()
    assert decoded.count((32, 64)) == 2 and decoded.count((64, 32)) == 2  # fprop's rowwise, dgrad's columnwise
    assert decoded.count((4, 64)) == 6  # activations are decoded at every micro-batch
