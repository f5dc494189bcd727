"""Per-tensor quantized tensors, current and delayed scaling (the scale rule: formats/test_scales.py)."""

from __future__ import annotations

import pytest
import torch

from lowprec.formats.elements import E4M3, E5M2
from lowprec.quant.block import block_scaling_quantize, mxfp8_quantize
from lowprec.quant.per_tensor import CurrentScalingQuantizer, DelayedScalingQuantizer, amax_of, quantize_with_scale
from lowprec.quant.protocol import Float8Tensor
from lowprec.recipe import DelayedScaling


def test_quantize_and_dequantize_by_hand():
    x = torch.tensor([[0.5, -3.0], [100.0, 1e-3]])
    q = quantize_with_scale(x, torch.tensor(2.0), E4M3)
    assert q.data.dtype == torch.float8_e4m3fn and q.scale_inv.item() == 0.5
    assert q.data.float().tolist() == [[1.0, -6.0], [200.0 - 8.0, 0.001953125]]  # 200 rounds to 192; 2e-3 to 2^-9
    assert torch.equal(q.dequantize(), q.data.float() * 0.5)
    assert q.t().shape == (2, 2) and torch.equal(q.t().data.float(), q.data.float().t())
    assert q.dequantize(torch.bfloat16).dtype == torch.bfloat16


def test_current_scaling_uses_the_tensors_amax():
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0)) * 5
    quantizer = CurrentScalingQuantizer(E4M3)
    q = quantizer.quantize(x)
    amax = x.abs().max()
    assert q.scale_inv.item() == pytest.approx((amax / 448.0).item(), rel=1e-6)
    assert q.data.float().abs().max().item() == 448.0
    subnormal_step = (amax / 448.0).item() * 2**-9  # below 2**-6 E4M3 has fixed steps of 2**-9
    assert torch.allclose(q.dequantize(), x, rtol=2**-4, atol=subnormal_step / 2)  # 3 mantissa bits: half a step
    assert CurrentScalingQuantizer(E4M3, margin=1).quantize(x).data.float().abs().max().item() == 224.0


def test_amax_of_empty_and_nan():
    assert amax_of(torch.empty(0)).item() == 0.0
    assert amax_of(torch.tensor([1.0, float("nan")])).item() == 1.0  # NaN ignored, as TE's fmaxf
    assert amax_of(torch.tensor([float("nan")])).item() == 0.0


NAN_BITS = {  # +NaN, -NaN, NaNs with payloads (signalling ones too), all-ones of both signs
    torch.float32: (torch.int32, [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF812345, 0x7FFFFFFF, 0xFFFFFFFF]),
    torch.bfloat16: (torch.int16, [0x7FC0, 0xFFC0, 0x7F81, 0xFF85, 0x7FFF, 0xFFFF]),
    torch.float16: (torch.int16, [0x7E00, 0xFE00, 0x7C01, 0xFC2A, 0x7FFF, 0xFFFF]),
}


def nans(dtype: torch.dtype) -> torch.Tensor:
    """A 2 x 3 tensor of ``dtype`` NaNs made from their bits."""
    int_dtype, bits = NAN_BITS[dtype]
    x = torch.tensor(bits, dtype=torch.int64).to(int_dtype).view(dtype).reshape(2, 3)
    assert x.isnan().all() and x.signbit().any() and not x.signbit().all()
    return x


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda fmt: fmt.name)
@pytest.mark.parametrize("dtype", list(NAN_BITS), ids=str)
def test_every_nan_quantizes_to_the_canonical_nan_byte(fmt, dtype):
    """0x7F whatever the sign or payload: the byte a GPU writes, whose multiply by the scale drops the sign."""
    x = nans(dtype)
    casts = {
        "FP8Format.cast": fmt.cast(x),
        "quantize_with_scale": quantize_with_scale(x, torch.tensor(3.0), fmt).data,
        "current scaling": CurrentScalingQuantizer(fmt).quantize(x).data,
        "delayed scaling": DelayedScalingQuantizer(fmt, DelayedScaling()).quantize(x).data,
        "MXFP8": mxfp8_quantize(x, fmt).data[:, :3],
        "MXFP8 columnwise": mxfp8_quantize(x, fmt, columnwise=True).data[:, :2],
        "block scaling": block_scaling_quantize(x, fmt).data[:2, :3],
    }
    for path, data in casts.items():
        assert data.view(torch.uint8).tolist() == [[0x7F] * data.shape[1]] * data.shape[0], path


def test_delayed_scaling_first_cast_uses_scale_one_then_history():
    quantizer = DelayedScalingQuantizer(E4M3, DelayedScaling(amax_history_len=3))
    casts = [torch.full((4,), v) for v in (2.0, 8.0, 1.0, 0.5, 0.25)]
    scales = []
    for x in casts:
        q = quantizer.quantize(x)
        scales.append(1.0 / q.scale_inv.item())
    # scale of cast i comes from the max amax of the (up to 3) casts before it
    assert scales == pytest.approx([1.0, 448.0 / 2.0, 448.0 / 8.0, 448.0 / 8.0, 448.0 / 8.0], rel=1e-6)
    assert quantizer.amax_history.tolist() == [0.25, 0.5, 1.0]
    assert quantizer.scale.item() == 448.0 / 1.0


def test_delayed_scaling_most_recent_and_margin():
    quantizer = DelayedScalingQuantizer(E5M2, DelayedScaling(margin=1, amax_compute_algo="most_recent"))
    for v in (4.0, 1.0):
        quantizer.quantize(torch.full((2,), v))
    assert quantizer.scale.item() == 57344.0 / 1.0 / 2


def test_delayed_scaling_keeps_the_scale_for_zero_or_nan_amax():
    quantizer = DelayedScalingQuantizer(E4M3, DelayedScaling(amax_history_len=1))
    quantizer.quantize(torch.full((2,), 4.0))
    quantizer.quantize(torch.zeros(2))
    assert quantizer.scale.item() == 112.0
    quantizer.quantize(torch.tensor([float("nan")]))
    assert quantizer.scale.item() == 112.0


class CountCopies(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.copies += func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default)
        return func(*args, **(kwargs or {}))


def test_delayed_scaling_makes_a_fresh_state_on_the_device_and_copies_a_recorded_one():
    """A copy from the host inside the first training step would wait for the GPU ("meta" stands in for it)."""
    fresh = DelayedScalingQuantizer(E4M3, DelayedScaling(amax_history_len=4))
    with CountCopies() as counted:
        assert fresh.scale_for(torch.empty(2, device="meta")).device.type == "meta"
    assert counted.copies == 0 and fresh.amax_history.shape == (4,) and fresh.scale_inv.device.type == "meta"
    used = DelayedScalingQuantizer(E4M3, DelayedScaling(amax_history_len=4))
    used.quantize(torch.full((2,), 4.0))
    with CountCopies() as counted:
        used.scale_for(torch.empty(2, device="meta"))
    assert counted.copies == 3 and used.amax_history.device.type == "meta"


def test_delayed_scaling_overflow_saturates():
    quantizer = DelayedScalingQuantizer(E4M3, DelayedScaling())
    quantizer.quantize(torch.full((2,), 1.0))  # next scale 448
    q = quantizer.quantize(torch.tensor([3.0, 0.5]))  # 3 * 448 is beyond E4M3
    assert q.dequantize().tolist() == [1.0, 0.5]


def test_float8_tensor_layouts():
    x = torch.randn(6, 4)
    cast = quantize_with_scale(x, torch.tensor(2.0), E4M3)
    assert cast.other_layout is None  # the torch path writes one layout
    assert cast.row_major().data_ptr() == cast.data.data_ptr()
    column = cast.column_major()
    assert column.t().is_contiguous() and torch.equal(column.float(), cast.data.float())
    other = cast.data.t().contiguous().t()
    both = Float8Tensor(cast.data, cast.scale_inv, E4M3, x.dtype, other)
    assert both.column_major().data_ptr() == other.data_ptr()  # no copy when the layout is stored
    flipped = both.t()
    assert flipped.shape == (4, 6)
    assert flipped.row_major().data_ptr() == other.data_ptr() and flipped.column_major().data_ptr() == cast.data.data_ptr()
    assert torch.equal(flipped.dequantize(), cast.dequantize().t())
