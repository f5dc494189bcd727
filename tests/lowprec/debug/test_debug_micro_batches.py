"""Inspecting a layer changes none of its numbers, also over the micro-batches of a step: its weight is cast
once per step on the debug path as on the plain one, so delayed scaling records the same amaxes."""

from __future__ import annotations

import torch
from debugrun import make_linear, section, start

import lowprec
import nvdlfw_inspect.api as debug_api

DELAYED = lowprec.DelayedScaling(amax_history_len=4)


def train(layer: lowprec.Linear, debug: bool, steps: int = 3, micro_batches: int = 3) -> list[torch.Tensor]:
    """Outputs of every micro-batch, then the weight quantizer's amax history and the weight."""
    torch.manual_seed(1)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    outputs = []
    for _ in range(steps):
        for _ in range(micro_batches):
            x = torch.randn(8, 32)
            with lowprec.fp8_autocast(fp8_recipe=DELAYED):
                y = layer(x)
            y.square().mean().backward()
            outputs.append(y.detach())
        optimizer.step()
        optimizer.zero_grad()
        if debug:
            debug_api.step()
    weight_quantizer = layer.gemm_unit.quantizers(DELAYED, layer.name)["weight"]
    return [*outputs, weight_quantizer.amax_history.clone(), layer.weight.detach().clone()]


def test_statistics_on_the_activation_change_no_number_over_micro_batches(log_dir):
    plain = train(make_linear(), debug=False)
    start(section({"LogTensorStats": {"enabled": True, "tensors": ["activation"], "stats": ["max"]}}), log_dir)
    inspected = train(make_linear(), debug=True)
    assert len(plain) == len(inspected)
    for want, got in zip(plain, inspected, strict=True):
        assert torch.equal(want, got)
