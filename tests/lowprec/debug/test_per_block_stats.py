"""Per-block statistics (``lowprec.debug.per_block_stats``) of the layer's own block cast and of what-if casts,
against float64 references of each block written here from the definitions, over one and two micro-batches."""

from __future__ import annotations

import math
import struct

import pytest
import torch
from blockref import mx_fake, nvfp4_ref
from debugrun import make_linear, section, start, train_step
from test_log_fp8_tensor_stats import Collect, fp8_config, run

import lowprec
import nvdlfw_inspect.api as debug_api
from lowprec.formats.elements import E4M3
from nvdlfw_inspect.errors import ConfigError
from nvdlfw_inspect.stats.catalog import derive_floats, derive_tensors
from nvdlfw_inspect.stats.fields import empty_partials, set_fields

FLUSHED = ["worst_block_flushed%", "worst_flushed_row", "worst_flushed_col"]
BLOCK = ["underflow_blocks%", "saturated_blocks%", "worst_block_rel_err", "worst_block_row", "worst_block_col", *FLUSHED]
OUTLIER_COL, LOUD_ROW = 70, 37


def planted(
    rows: int = 64, cols: int = 256, seed: int = 0, loud_row: int | None = LOUD_ROW, outlier: float = 2.0**30
) -> torch.Tensor:
    """Values +-1 and +-2 (exact in every format here) and an outlier channel (column ``OUTLIER_COL``) of 2**30
    whose blocks' other values flush to zero; in row ``loud_row`` they are all +-2, so its block loses the most."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randint(1, 3, (rows, cols), generator=g) * (torch.randint(0, 2, (rows, cols), generator=g) * 2 - 1)).float()
    x[:, OUTLIER_COL % cols] = outlier
    if loud_row is not None:
        loud_row %= rows
        x[loud_row] = 2.0 * x[loud_row].sign()
        x[loud_row, OUTLIER_COL % cols] = outlier
    return x


def block_ref(x: torch.Tensor, dq: torch.Tensor, block: tuple[int, int], threshold: float = 50.0) -> dict:
    """Per-block statistics of one cast from its float64 dequantized values ``dq`` (both 2-D, blocks of ``block``)."""
    h, w = block
    r, c = x.shape
    xb = x.double().reshape(r // h, h, c // w, w).transpose(1, 2)
    db = dq.double().reshape(r // h, h, c // w, w).transpose(1, 2)
    nonzero = (xb != 0).sum((-1, -2))
    flushed = ((xb != 0) & (db == 0)).sum((-1, -2))
    rel = ((db - xb).square().sum((-1, -2)) / xb.square().sum((-1, -2))).sqrt()
    worst = rel.max()
    rows, cols = torch.nonzero(rel == worst, as_tuple=True)
    share = torch.where(nonzero > 0, 100.0 * flushed / nonzero.clamp(min=1), 0.0)
    last = torch.nonzero(share.flatten() == share.max()).max().item()  # ties: the last block in row-major order
    return {
        "blocks": rel.numel(),
        "bad": int((flushed * 100 > threshold * nonzero).sum()),
        "worst": worst.item(),
        "row": rows.max().item(),
        "col": cols.max().item(),
        "flushed": share.max().item(),
        "flushed_row": last // share.shape[1],
        "flushed_col": last % share.shape[1],
    }


def expect_blocks(got: dict, prefix: str, ref: dict, suffix: str = "") -> None:
    assert got[(f"{prefix}underflow_blocks%{suffix}", 0)] == pytest.approx(100 * ref["bad"] / ref["blocks"], rel=1e-12)
    assert got[(f"{prefix}saturated_blocks%{suffix}", 0)] == 0
    assert got[(f"{prefix}worst_block_rel_err{suffix}", 0)] == pytest.approx(ref["worst"], rel=1e-6)
    assert got[(f"{prefix}worst_block_row{suffix}", 0)] == ref["row"]
    assert got[(f"{prefix}worst_block_col{suffix}", 0)] == ref["col"]
    assert got[(f"{prefix}worst_block_flushed%{suffix}", 0)] == pytest.approx(ref["flushed"], rel=1e-7)
    assert got[(f"{prefix}worst_flushed_row{suffix}", 0)] == ref["flushed_row"]
    assert got[(f"{prefix}worst_flushed_col{suffix}", 0)] == ref["flushed_col"]


def test_outlier_channel_under_the_layers_own_mxfp8_rowwise_and_columnwise(log_dir):
    x, dy = planted(), torch.randn(64, 128)
    stats = BLOCK + [s + "_columnwise" for s in BLOCK]
    got = run(
        fp8_config(stats, tensors=["activation"]),
        log_dir,
        [(x, dy)],
        recipe=lowprec.MXFP8BlockScaling(),
        layer=make_linear(in_f=256, out_f=128),
    )
    rowwise = block_ref(x, mx_fake(x, E4M3), (1, 32))
    # every block of the outlier channel flushes its other 31 values; the loud row's loses the most
    assert rowwise["bad"] == 64 and rowwise["blocks"] == 64 * 8
    assert (rowwise["row"], rowwise["col"]) == (LOUD_ROW, OUTLIER_COL // 32)
    # the block flushing most: 31 of 32 in every row's outlier block, a tie that goes to the last row
    assert (rowwise["flushed"], rowwise["flushed_row"], rowwise["flushed_col"]) == (100 * 31 / 32, 63, OUTLIER_COL // 32)
    expect_blocks(got, "lin_activation_", rowwise)
    # the columnwise copy (blocks of 32 down a column): the outlier channel's blocks are all 2**30, exact; every block
    # exact: the worst error 0, its location the last block (ties go to the last)
    columnwise = block_ref(x.t(), mx_fake(x.t(), E4M3), (1, 32))
    assert columnwise["bad"] == 0 and columnwise["worst"] == 0
    assert got[("lin_activation_underflow_blocks%_columnwise", 0)] == 0
    assert got[("lin_activation_worst_block_rel_err_columnwise", 0)] == 0
    assert got[("lin_activation_worst_block_row_columnwise", 0)] == 64 // 32 - 1  # in the tensor's orientation
    assert got[("lin_activation_worst_block_col_columnwise", 0)] == 256 - 1
    assert got[("lin_activation_worst_block_flushed%_columnwise", 0)] == 0  # nothing flushes: the last block again
    assert got[("lin_activation_worst_flushed_row_columnwise", 0)] == 64 // 32 - 1
    assert got[("lin_activation_worst_flushed_col_columnwise", 0)] == 256 - 1


def two_micro_batches(log_dir, x1: torch.Tensor, x2: torch.Tensor, dy: torch.Tensor) -> Collect:
    """One MXFP8 step of two micro-batches with the block statistics of the activation; what was logged."""
    collect = Collect()
    start(fp8_config(BLOCK, tensors=["activation"]), log_dir, statistics_logger=collect)
    layer = make_linear(in_f=256, out_f=128)
    for x in (x1, x2):
        train_step(layer, x, dy, recipe=lowprec.MXFP8BlockScaling())
    debug_api.step()
    debug_api.end_debug()
    return collect


def test_two_micro_batches_reduce_as_their_concatenation(log_dir):
    """Counts add, the worst error is the larger; its column is the concatenation's, its row the one in the
    micro-batch that held it (here the second)."""
    x1, x2, dy = planted(seed=1, loud_row=None), planted(seed=2, loud_row=5), torch.randn(64, 128)
    x1[:, 3] = 0.0  # some blocks of the first lose nothing at all: the counts differ between micro-batches
    collect = two_micro_batches(log_dir, x1, x2, dy)
    both = torch.cat([x1, x2])
    ref = block_ref(both, mx_fake(both, E4M3), (1, 32))
    assert ref["row"] == 64 + 5
    # every row's outlier block flushes 31 of 32 in both: each feed's last, row 63, then the larger of the two rows
    assert (ref["flushed"], ref["flushed_row"]) == (100 * 31 / 32, 64 + 63)
    expect_blocks(collect.values, "lin_activation_", {**ref, "row": 5, "flushed_row": 63})


def gaussian_outlier(seed: int, full_row: int) -> torch.Tensor:
    """N(0, 1) values and channel ``OUTLIER_COL`` at 1e6: its blocks' scale (2**12) flushes their values under 4 (there
    clipped to 1.5: all), and a value of 100 (kept) in each of them but row ``full_row``'s, whose block then flushes
    most (31 of 32, the others 30)."""
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(seed))
    block = OUTLIER_COL // 32 * 32
    x[:, block : block + 32].clamp_(-1.5, 1.5)
    x[:, OUTLIER_COL] = 1e6
    x[:, OUTLIER_COL - 6] = 100.0
    x[full_row, OUTLIER_COL - 6] = 0.5
    return x


def test_the_block_that_flushes_most_is_the_outlier_channels_not_the_worst_by_relative_error(log_dir):
    """Over two micro-batches, the outlier's blocks flush most and are located at its column block; the worst block by
    relative error is elsewhere (the outlier dominates its blocks' norms), its row that micro-batch's."""
    x1, x2, dy = gaussian_outlier(1, full_row=40), gaussian_outlier(2, full_row=9), torch.randn(64, 128)
    x2[9, OUTLIER_COL + 10] = 6.0  # kept (rounds to 8): x2's row 9 flushes 30 of 32, x1's row 40 alone 31
    collect = two_micro_batches(log_dir, x1, x2, dy)
    both = torch.cat([x1, x2])
    ref = block_ref(both, mx_fake(both, E4M3), (1, 32))
    first, second = (block_ref(x, mx_fake(x, E4M3), (1, 32)) for x in (x1, x2))
    assert (ref["flushed"], ref["flushed_row"], ref["flushed_col"]) == (100 * 31 / 32, 40, OUTLIER_COL // 32)
    assert second["flushed"] == 100 * 30 / 32
    assert ref["col"] != OUTLIER_COL // 32  # what worst_block_col cannot show
    assert ref["worst"] in (first["worst"], second["worst"])
    row = first["row"] if ref["worst"] == first["worst"] else second["row"]
    expect_blocks(collect.values, "lin_activation_", {**ref, "row": row})
    assert collect.values[("lin_activation_worst_flushed_col", 0)] == OUTLIER_COL // 32


def test_what_if_prefixes_on_a_per_tensor_layer(log_dir):
    x, dy = planted(), torch.randn(64, 128)
    stats = ["mxfp8_" + s for s in BLOCK] + ["fp8_block_scaling_underflow_blocks%", "fp8_block_scaling_worst_block_col"]
    got = run(
        fp8_config(stats, tensors=["activation"]),
        log_dir,
        [(x, dy)],
        recipe=lowprec.Float8CurrentScaling(),
        layer=make_linear(in_f=256, out_f=128),
    )
    expect_blocks(got, "lin_activation_mxfp8_", block_ref(x, mx_fake(x, E4M3), (1, 32)))
    # FP8 block scaling: 1 x 128 blocks with power-of-two scales 2**floor(log2(448 / amax)): the outlier's
    # blocks (columns 0-127) flush their +-1 (below 2**-9 / scale = 2**13) and keep nothing else
    assert got[("lin_activation_fp8_block_scaling_underflow_blocks%", 0)] == 50.0
    assert got[("lin_activation_fp8_block_scaling_worst_block_col", 0)] == 0


def test_nvfp4_own_and_what_if_with_a_threshold(log_dir):
    """NVFP4 (blocks of 16): ``block_underflow_threshold`` 0 counts a block with any flush. An outlier of 2**30
    would flush every block (their E4M3 scales fall below 2**-9 under the per-tensor scale): 100 flushes its own."""
    x, dy = planted(rows=32, cols=64, outlier=100.0), torch.randn(32, 48)
    x[3, 20] = 0.01  # one value of its block flushes: only threshold 0 counts the block
    feature = {"enabled": True, "tensors": ["activation"], "stats": BLOCK, "what_if": True, "block_underflow_threshold": 0}
    config = section({"LogNvfp4TensorStats": feature})
    for recipe in (lowprec.NVFP4BlockScaling(), lowprec.MXFP8BlockScaling()):
        got = run(config, log_dir, [(x, dy)], recipe=recipe, layer=make_linear(in_f=64, out_f=48))
        ref = block_ref(x, nvfp4_ref(x)[0], (1, 16), threshold=0.0)
        assert ref["bad"] == 32 + 1 and (ref["row"], ref["col"]) == (LOUD_ROW % 32, OUTLIER_COL % 64 // 16)
        expect_blocks(got, "lin_activation_nvfp4_", ref)


def test_saturation_under_the_ocp_rule_and_never_under_nvidias(log_dir):
    """OCP's E8M0 scale rounds down: a block whose amax has a mantissa above E4M3's 1.75 saturates it."""
    x, dy = torch.ones(64, 256), torch.randn(64, 128)
    x[:, 5] = 1.9  # 1.9 * 2**8 / 2**0 -> beyond 448 after OCP's scale 2**(0 - 8)
    x[10:20, 40] = 1.5  # these blocks' amax 1.5 fits
    stats = ["mxfp8_saturated_blocks%", "mxfp8_ocp_saturated_blocks%", "mxfp8_ocp_worst_block_col"]
    got = run(
        fp8_config(stats, tensors=["activation"]),
        log_dir,
        [(x, dy)],
        recipe=None,
        fp8=False,
        layer=make_linear(in_f=256, out_f=128),
    )
    assert got[("lin_activation_mxfp8_saturated_blocks%", 0)] == 0
    assert got[("lin_activation_mxfp8_ocp_saturated_blocks%", 0)] == pytest.approx(100 * 64 / (64 * 8))
    assert got[("lin_activation_mxfp8_ocp_worst_block_col", 0)] == 0


@pytest.mark.parametrize(
    ("stats", "match"),
    [
        (["worst_block_colum"], r"stats\.0'.*unsupported statistic.*worst_block_col"),
        (["fp8_current_scaling_underflow_blocks%"], r"stats\.0'.*describes the blocks of a block-scaled cast"),
        (["mxfp8_worst_blocks_rel_err"], r"stats\.0'.*unsupported statistic"),
        (["mxfp8_worst_flushed_colum_columnwise"], r"stats\.0'.*unsupported statistic.*worst_flushed_col"),
        (["fp8_current_scaling_worst_block_flushed%"], r"stats\.0'.*describes the blocks of a block-scaled cast"),
    ],
)
def test_config_errors_name_the_per_block_statistic(log_dir, stats, match):
    with pytest.raises(ConfigError, match=match):
        start(fp8_config(stats, tensors=["activation"]), log_dir)


@pytest.mark.parametrize("threshold", [100, -1, "half", True])
def test_threshold_must_be_a_percentage(log_dir, threshold):
    with pytest.raises(ConfigError, match=r"block_underflow_threshold'.*must be a percentage"):
        start(fp8_config(["mxfp8_underflow_blocks%"], tensors=["activation"], block_underflow_threshold=threshold), log_dir)


def key(err: float, index: int) -> float:
    high = struct.unpack("<i", struct.pack("<f", err))[0] + (1 << 20)
    return struct.unpack("<d", struct.pack("<q", high << 32 | index))[0]


def test_location_keys_order_by_error_then_index_and_decode_alike():
    keys = [key(0.5, 7), key(0.25, 900), key(0.5, 3), key(0.0, 4_000_000_000), key(math.inf, 2)]
    assert all(math.isfinite(k) and k >= 2.0**-1022 for k in keys)
    assert max(keys[:4]) == keys[0] and max(keys) == keys[4]
    for k, index in zip(keys, (7, 900, 3, 4_000_000_000, 2), strict=True):
        partial = set_fields(empty_partials(), {"count": 1, "max": k})
        assert derive_floats(partial.tolist(), ["worst_block_row"])["worst_block_row"] == index
        assert derive_tensors(partial, ["worst_block_col"])["worst_block_col"].item() == index
    empty = empty_partials()
    assert math.isnan(derive_floats(empty.tolist(), ["worst_block_row"])["worst_block_row"])
    assert derive_tensors(empty, ["worst_block_row"])["worst_block_row"].isnan()
