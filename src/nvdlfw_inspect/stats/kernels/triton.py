"""The statistics of a CUDA tensor in one launch: a persistent Triton kernel that reduces within itself.

A grid of at most a few programs per multiprocessor walks the tensor once; each program keeps running
partials (count, mean and M2 merged with Chan's formula in float64, when asked M3 and M4 with Pebay's, min,
max, sums, and per quantization grid its underflows, overflows and squared error) and writes them to a scratch
row. The last program to finish (an atomic counter) merges the scratch rows and merges the result into every
requested row of the statistics table, the same rows and rules as ``cpu_partials.c``. No per-block rows are
merged by torch ops afterwards. With ``TRITON_INTERPRET=1`` the same kernel runs on CPU tensors, which is how
the tests check it without a GPU. ``_column_amax`` reads a tensor once more for the channel statistics.

Within a block the arithmetic stays in float32 (float64 is slow on many GPUs), on values scaled by a
power of two that brings the block's largest magnitude to [2, 4): no sum or square overflows or
underflows, whether the values are near 3e38 or subnormal, and the scaling is exact. The block's M2
is the corrected two-pass sum around the float32 value nearest its mean, so the mean may dwarf the
spread; the blocks merge in float64.

Offsets come from ``stats.fields``: ``F_<FIELD>`` (the field's index in a table row) and ``R_<FIELD>``
(its merge rule) are constexprs built from it, and a program's scratch row (its tensor fields, then each
grid's counts for ``MAX_VARIANTS`` grids) is laid out from its lists of fields, so no offset is written
here as a number.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from nvdlfw_inspect.stats.fields import BY_NAME, FIELDS, INDEX, MERGE_RULES, filled_by

BLOCK = 2048
PROGRAMS_PER_SM = 4
MAX_PROGRAMS = 1024  # also the scratch rows; a power of two
MAX_VARIANTS = 4
MAX_ROWS = 4
OPTIONS = {"enable_fp_fusion": False}  # no fused multiply-adds: the grid and the error x - q * scale_inv round as written
MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23: adding and subtracting it rounds |y| < 2**22 to an integer (RNE)
N_FIELDS = tl.constexpr(len(FIELDS))

# A table row: each field's index and merge rule (RULE_*), as stats.fields lays them out.
RULE_SUM, RULE_MIN = (tl.constexpr(MERGE_RULES.index(rule)) for rule in ("sum", "min"))
F_COUNT, F_MEAN, F_M2, F_MIN, F_MAX, F_ABS_SUM, F_ABS_MIN_NONZERO, F_M3, F_M4 = (
    tl.constexpr(INDEX[name]) for name in ("count", "mean", "m2", "min", "max", "abs_sum", "abs_min_nonzero", "m3", "m4")
)
F_UNDERFLOWS, F_OVERFLOWS, F_SQ_ERR, F_SCALE_INV_MIN, F_SCALE_INV_MAX = (
    tl.constexpr(INDEX[name]) for name in ("underflows", "overflows", "sq_err", "scale_inv_min", "scale_inv_max")
)
R_MIN, R_MAX, R_ABS_SUM, R_ABS_MIN_NONZERO = (
    tl.constexpr(MERGE_RULES.index(BY_NAME[name].merge)) for name in ("min", "max", "abs_sum", "abs_min_nonzero")
)
R_UNDERFLOWS, R_OVERFLOWS, R_SQ_ERR, R_SCALE_INV_MIN, R_SCALE_INV_MAX = (
    tl.constexpr(MERGE_RULES.index(BY_NAME[name].merge))
    for name in ("underflows", "overflows", "sq_err", "scale_inv_min", "scale_inv_max")
)

# A program's scratch row: its tensor fields (abs_sum NaN: a NaN was read), then for each grid field its
# MAX_VARIANTS values, one per grid.
SCRATCH_TENSOR, SCRATCH_GRID = filled_by("tensor") + filled_by("moments"), filled_by("grid")
SCRATCH_FIELDS = len(SCRATCH_TENSOR) + len(SCRATCH_GRID) * MAX_VARIANTS
SCRATCH_ROW = tl.constexpr(SCRATCH_FIELDS)
S_COUNT, S_MEAN, S_M2, S_MIN, S_MAX, S_ABS_SUM, S_ABS_MIN_NONZERO, S_M3, S_M4 = (
    tl.constexpr(SCRATCH_TENSOR.index(name))
    for name in ("count", "mean", "m2", "min", "max", "abs_sum", "abs_min_nonzero", "m3", "m4")
)
S_UNDERFLOWS, S_OVERFLOWS, S_SQ_ERR = (
    tl.constexpr(len(SCRATCH_TENSOR) + SCRATCH_GRID.index(name) * MAX_VARIANTS) for name in ("underflows", "overflows", "sq_err")
)


@triton.jit
def round_to_grid(v, MIN_NORMAL_EXP: tl.constexpr, MANTISSA_BITS: tl.constexpr):
    """``v`` rounded to the nearest value of an FP8-like grid (ties to even), as fp32; ``v`` is in range."""
    bits = v.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) & 0xFF
    spacing_exponent = tl.maximum(exponent, 127 + MIN_NORMAL_EXP) - MANTISSA_BITS  # biased
    spacing = (spacing_exponent << 23).to(tl.float32, bitcast=True)
    inverse = ((254 - spacing_exponent) << 23).to(tl.float32, bitcast=True)
    steps = (v * inverse + MAGIC) - MAGIC
    rounded = steps * spacing
    return tl.where(rounded == 0.0, v * 0.0, rounded)  # keep the sign of values that round to zero


@triton.jit
def _power_of_two_scale(amax):
    """``2**(128 - e)`` for ``amax`` of biased exponent ``e`` (kept within 1..254, so the scale is a normal
    float32): ``amax * scale`` lies in [2, 4), and a subnormal ``amax`` below 2."""
    exponent = tl.minimum(tl.maximum((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF, 1), 254)
    return ((255 - exponent) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _sum_of_squares(v):
    """``sum(v * v)`` of a float32 block in float64, squared after scaling by a power of two: values of
    any float32 magnitude neither overflow nor vanish."""
    scale = _power_of_two_scale(tl.max(tl.abs(v), axis=0))
    scaled = v * scale
    inverse = 1.0 / scale.to(tl.float64)
    return tl.sum(scaled * scaled, axis=0).to(tl.float64) * inverse * inverse


@triton.jit
def _moments(x, valid, count, amax, WANT_MOMENTS: tl.constexpr):
    """(mean, M2, sum of |x|, M3, M4) of one block of ``count`` values in float64, from float32 arithmetic on ``x``
    scaled by ``amax`` (see the module docstring); M3 and M4 only if ``WANT_MOMENTS`` (else 0). The centre is the
    float32 value nearest the mean (the float32 mean, corrected once), so a constant block has deviations of exactly
    zero; over the deviations d from it and c = sum d / n, M2 = sum d^2 - n c^2, M3 = sum d^3 - 3 c sum d^2 + 2 n c^3
    and M4 = sum d^4 - 4 c sum d^3 + 6 c^2 sum d^2 - 3 n c^4, and the mean is the centre plus c."""
    scale = _power_of_two_scale(amax)
    inverse = 1.0 / scale.to(tl.float64)
    y = x * scale
    n = count.to(tl.float32)
    rough = tl.sum(y, axis=0) / n
    center = rough + tl.sum(tl.where(valid, y - rough, 0.0), axis=0) / n
    deviation = tl.where(valid, y - center, 0.0)
    shifted = tl.sum(deviation, axis=0).to(tl.float64)
    correction = shifted / count
    finite = tl.abs(rough) < float("inf")  # else the mean is inf or NaN, and the deviations NaN
    mean = tl.where(finite, center.to(tl.float64) + correction, rough.to(tl.float64)) * inverse
    square = deviation * deviation
    squares = tl.sum(square, axis=0).to(tl.float64)
    m2 = squares - shifted * correction
    m2 = tl.where(m2 < 0.0, 0.0, m2) * inverse * inverse  # a NaN stays NaN
    m3 = tl.zeros((), dtype=tl.float64)
    m4 = tl.zeros((), dtype=tl.float64)
    if WANT_MOMENTS:
        cubes = tl.sum(square * deviation, axis=0).to(tl.float64)
        fourths = tl.sum(square * square, axis=0).to(tl.float64)
        c2 = correction * correction
        m3 = (cubes - 3.0 * correction * squares + 2.0 * count * c2 * correction) * inverse * inverse * inverse
        m4 = fourths - 4.0 * correction * cubes + 6.0 * c2 * squares - 3.0 * count * c2 * c2
        m4 = tl.where(m4 < 0.0, 0.0, m4) * (inverse * inverse) * (inverse * inverse)
    return mean, m2, tl.sum(tl.abs(y), axis=0).to(tl.float64) * inverse, m3, m4


@triton.jit
def _pebay(count_a, m2_a, m3_a, m4_a, count_b, m2_b, m3_b, m4_b, delta):
    """M3 and M4 of two sets of values merged (``delta``: the second's mean minus the first's), by Pebay's formulas
    from the sets' own M2, M3 and M4 (their M2 merges by Chan's formula where this is called)."""
    n = count_a + count_b
    safe = tl.where(n > 0, n, 1.0)
    product = count_a * count_b
    d_n = delta / safe
    d_n2 = d_n * d_n
    m4 = (
        m4_a
        + m4_b
        + delta * d_n * d_n2 * product * (count_a * count_a - product + count_b * count_b)
        + 6.0 * d_n2 * (count_a * count_a * m2_b + count_b * count_b * m2_a)
        + 4.0 * d_n * (count_a * m3_b - count_b * m3_a)
    )
    m3 = m3_a + m3_b + delta * d_n2 * product * (count_a - count_b) + 3.0 * d_n * (count_a * m2_b - count_b * m2_a)
    return m3, m4


@triton.jit
def _merged_mean(mean, delta, share, other):
    """Chan's update of ``mean`` by ``other`` (``delta = other - mean``, ``share`` its weight); with an
    infinite or NaN mean their sum, which keeps inf where the update would give NaN (inf - inf)."""
    return tl.where(tl.abs(delta) < float("inf"), mean + delta * share, mean + other)


@triton.jit
def _grid_counts(x, valid, scale_ptr, GRID_MAX: tl.constexpr, MIN_NORMAL_EXP: tl.constexpr, MANTISSA_BITS: tl.constexpr):
    """(underflows, overflows, squared error in float64) of one block cast with the scale at ``scale_ptr``."""
    scale = tl.load(scale_ptr)
    scale_inv = tl.math.div_rn(1.0, scale)
    scaled = x * scale
    overflows = tl.sum((valid & (tl.abs(scaled) > GRID_MAX)).to(tl.float32), axis=0)
    clamped = tl.where(scaled > GRID_MAX, GRID_MAX, tl.where(scaled < -GRID_MAX, -GRID_MAX, scaled))
    q = round_to_grid(clamped, MIN_NORMAL_EXP, MANTISSA_BITS)
    underflows = tl.sum((valid & (x != 0.0) & (q == 0.0)).to(tl.float32), axis=0)
    error = tl.where(valid, x - q * scale_inv, 0.0)
    return underflows, overflows, _sum_of_squares(error)


@triton.jit
def _merge_into_row(
    table_ptr,
    row,
    count,
    mean,
    m2,
    m3,
    m4,
    low,
    high,
    abs_sum,
    abs_min,
    underflows,
    overflows,
    sq_err,
    scale_ptr,
    HAS_VARIANT: tl.constexpr,
    WANT_MOMENTS: tl.constexpr,
):
    """Merge one call's fields into table row ``row``: count, mean and M2 by Chan's formula, M3 and M4 (if
    ``WANT_MOMENTS``) by Pebay's, every other field by its rule in ``stats.fields``."""
    base = table_ptr + row.to(tl.int64) * N_FIELDS
    old_count = tl.load(base + F_COUNT)
    old_mean = tl.load(base + F_MEAN)
    old_m2 = tl.load(base + F_M2)
    total = old_count + count
    delta = mean - old_mean
    safe_total = tl.where(total > 0, total, 1.0)
    merged_mean = tl.where(old_count == 0, mean, _merged_mean(old_mean, delta, count / safe_total, mean))
    merged_m2 = tl.where(old_count == 0, m2, old_m2 + m2 + delta * delta * (old_count * count / safe_total))
    if WANT_MOMENTS:
        old_m3 = tl.load(base + F_M3)
        old_m4 = tl.load(base + F_M4)
        merged_m3, merged_m4 = _pebay(old_count, old_m2, old_m3, old_m4, count, m2, m3, m4, delta)
        tl.store(base + F_M3, tl.where(old_count == 0, m3, merged_m3))
        tl.store(base + F_M4, tl.where(old_count == 0, m4, merged_m4))
    tl.store(base + F_COUNT, total)
    tl.store(base + F_MEAN, merged_mean)
    tl.store(base + F_M2, merged_m2)
    _merge_field(base + F_MIN, R_MIN, low)
    _merge_field(base + F_MAX, R_MAX, high)
    _merge_field(base + F_ABS_SUM, R_ABS_SUM, abs_sum)
    _merge_field(base + F_ABS_MIN_NONZERO, R_ABS_MIN_NONZERO, abs_min)
    if HAS_VARIANT:
        scale_inv = tl.math.div_rn(1.0, tl.load(scale_ptr)).to(tl.float64)
        _merge_field(base + F_UNDERFLOWS, R_UNDERFLOWS, underflows)
        _merge_field(base + F_OVERFLOWS, R_OVERFLOWS, overflows)
        _merge_field(base + F_SQ_ERR, R_SQ_ERR, sq_err)
        _merge_field(base + F_SCALE_INV_MIN, R_SCALE_INV_MIN, scale_inv)
        _merge_field(base + F_SCALE_INV_MAX, R_SCALE_INV_MAX, scale_inv)


@triton.jit
def _merge_field(ptr, RULE: tl.constexpr, value):
    """Merge ``value`` into the table entry at ``ptr`` by ``RULE`` (a compile-time choice)."""
    if RULE == RULE_SUM:
        tl.store(ptr, tl.load(ptr) + value)
    elif RULE == RULE_MIN:
        tl.store(ptr, _min_nan(tl.load(ptr), value))
    else:  # RULE_MAX (the RULE_CHAN fields, mean and M2, merge with the count in _merge_into_row)
        tl.store(ptr, _max_nan(tl.load(ptr), value))


@triton.jit
def _min_nan(a, b):
    return tl.where((a != a) | (b != b), float("nan"), tl.minimum(a, b))


@triton.jit
def _max_nan(a, b):
    return tl.where((a != a) | (b != b), float("nan"), tl.maximum(a, b))


@triton.jit
def _store_per_grid(ptr, v0, v1, v2, v3):
    """A scratch field's values of the four grids, one after another from ``ptr``."""
    tl.store(ptr + 0, v0)
    tl.store(ptr + 1, v1)
    tl.store(ptr + 2, v2)
    tl.store(ptr + 3, v3)


@triton.jit
def _scratch_sum(ptr, mine):
    """The sum over the programs' scratch rows of the entry at ``ptr`` of each (``mine``: the rows written)."""
    return tl.sum(tl.load(ptr, mask=mine, other=0.0, cache_modifier=".cg"), axis=0)


@triton.jit
def _pick(variant: tl.constexpr, u0, u1, u2, u3):
    """The value of grid ``variant`` among four (a compile-time choice)."""
    if variant == 0:
        return u0
    elif variant == 1:
        return u1
    elif variant == 2:
        return u2
    else:
        return u3


@triton.jit
def _scale_ptr(variant: tl.constexpr, s0, s1, s2, s3):
    if variant <= 0:
        return s0
    elif variant == 1:
        return s1
    elif variant == 2:
        return s2
    else:
        return s3


# Rows are plain ints: Triton would make a row equal to 1 a constant (no ``.to``) and compile once per row.
@triton.jit(do_not_specialize=["row0", "row1", "row2", "row3"])
def _tensor_stats(
    x_ptr,
    n,
    table_ptr,
    scratch_ptr,
    counter_ptr,
    call_out_ptr,
    amax_out_ptr,
    row0,
    row1,
    row2,
    row3,
    scale0_ptr,
    scale1_ptr,
    scale2_ptr,
    scale3_ptr,
    ROWS: tl.constexpr,
    VARIANTS: tl.constexpr,
    ROW_VARIANT0: tl.constexpr,
    ROW_VARIANT1: tl.constexpr,
    ROW_VARIANT2: tl.constexpr,
    ROW_VARIANT3: tl.constexpr,
    GRID_MAX0: tl.constexpr,
    GRID_MAX1: tl.constexpr,
    GRID_MAX2: tl.constexpr,
    GRID_MAX3: tl.constexpr,
    MIN_EXP0: tl.constexpr,
    MIN_EXP1: tl.constexpr,
    MIN_EXP2: tl.constexpr,
    MIN_EXP3: tl.constexpr,
    MANTISSA0: tl.constexpr,
    MANTISSA1: tl.constexpr,
    MANTISSA2: tl.constexpr,
    MANTISSA3: tl.constexpr,
    CALL_OUT: tl.constexpr,
    AMAX_OUT: tl.constexpr,
    WANT_MOMENTS: tl.constexpr,
    BLOCK: tl.constexpr,
    PROGRAMS_BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    count = tl.zeros((), dtype=tl.float64)
    mean = tl.zeros((), dtype=tl.float64)
    m2 = tl.zeros((), dtype=tl.float64)
    m3 = tl.zeros((), dtype=tl.float64)
    m4 = tl.zeros((), dtype=tl.float64)
    low = tl.full((), float("inf"), dtype=tl.float32)
    high = tl.full((), float("-inf"), dtype=tl.float32)
    abs_sum = tl.zeros((), dtype=tl.float64)
    abs_min = tl.full((), float("inf"), dtype=tl.float32)
    u0 = tl.zeros((), dtype=tl.float64)
    u1 = tl.zeros((), dtype=tl.float64)
    u2 = tl.zeros((), dtype=tl.float64)
    u3 = tl.zeros((), dtype=tl.float64)
    o0 = tl.zeros((), dtype=tl.float64)
    o1 = tl.zeros((), dtype=tl.float64)
    o2 = tl.zeros((), dtype=tl.float64)
    o3 = tl.zeros((), dtype=tl.float64)
    e0 = tl.zeros((), dtype=tl.float64)
    e1 = tl.zeros((), dtype=tl.float64)
    e2 = tl.zeros((), dtype=tl.float64)
    e3 = tl.zeros((), dtype=tl.float64)
    block = pid.to(tl.int64)
    while block * BLOCK < n:  # a while loop: Triton 3.6's interpreter cannot take a tensor as a range bound
        start = block * BLOCK
        offsets = start + tl.arange(0, BLOCK)
        block += programs
        valid = offsets < n
        x = tl.load(x_ptr + offsets, mask=valid, other=0.0).to(tl.float32)
        block_count = tl.minimum(n - start, BLOCK).to(tl.float64)
        number = valid & (x == x)  # min and max skip NaN (``poisoned`` below marks the fields NaN)
        block_low = tl.min(tl.where(number, x, float("inf")), axis=0)
        block_high = tl.max(tl.where(number, x, float("-inf")), axis=0)
        amax = tl.maximum(tl.abs(block_low), tl.abs(block_high))
        block_mean, block_m2, block_abs_sum, block_m3, block_m4 = _moments(x, valid, block_count, amax, WANT_MOMENTS)
        low = tl.minimum(low, block_low)
        high = tl.maximum(high, block_high)
        abs_sum += block_abs_sum
        magnitude = tl.abs(x)
        abs_min = tl.minimum(abs_min, tl.min(tl.where(valid & (magnitude > 0), magnitude, float("inf")), axis=0))
        merged = count + block_count
        delta = block_mean - mean
        share = block_count / merged
        if WANT_MOMENTS:
            m3, m4 = _pebay(count, m2, m3, m4, block_count, block_m2, block_m3, block_m4, delta)
        m2 += block_m2 + delta * delta * count * share
        mean = _merged_mean(mean, delta, share, block_mean)
        count = merged
        if VARIANTS > 0:
            a, b, c = _grid_counts(x, valid, scale0_ptr, GRID_MAX0, MIN_EXP0, MANTISSA0)
            u0 += a.to(tl.float64)
            o0 += b.to(tl.float64)
            e0 += c.to(tl.float64)
        if VARIANTS > 1:
            a, b, c = _grid_counts(x, valid, scale1_ptr, GRID_MAX1, MIN_EXP1, MANTISSA1)
            u1 += a.to(tl.float64)
            o1 += b.to(tl.float64)
            e1 += c.to(tl.float64)
        if VARIANTS > 2:
            a, b, c = _grid_counts(x, valid, scale2_ptr, GRID_MAX2, MIN_EXP2, MANTISSA2)
            u2 += a.to(tl.float64)
            o2 += b.to(tl.float64)
            e2 += c.to(tl.float64)
        if VARIANTS > 3:
            a, b, c = _grid_counts(x, valid, scale3_ptr, GRID_MAX3, MIN_EXP3, MANTISSA3)
            u3 += a.to(tl.float64)
            o3 += b.to(tl.float64)
            e3 += c.to(tl.float64)
    own = scratch_ptr + pid.to(tl.int64) * SCRATCH_ROW
    tl.store(own + S_COUNT, count)
    tl.store(own + S_MEAN, mean)
    tl.store(own + S_M2, m2)
    tl.store(own + S_MIN, low.to(tl.float64))
    tl.store(own + S_MAX, high.to(tl.float64))
    tl.store(own + S_ABS_SUM, abs_sum)
    tl.store(own + S_ABS_MIN_NONZERO, abs_min.to(tl.float64))
    tl.store(own + S_M3, m3)
    tl.store(own + S_M4, m4)
    _store_per_grid(own + S_UNDERFLOWS, u0, u1, u2, u3)
    _store_per_grid(own + S_OVERFLOWS, o0, o1, o2, o3)
    _store_per_grid(own + S_SQ_ERR, e0, e1, e2, e3)
    tl.debug_barrier()
    finished = tl.atomic_add(counter_ptr, 1, sem="acq_rel")
    if finished == programs - 1:  # the last program: merge every program's row, then into the table
        tl.store(counter_ptr, 0)  # ready for the next launch
        p = tl.arange(0, PROGRAMS_BLOCK)
        rows = scratch_ptr + p.to(tl.int64) * SCRATCH_ROW
        mine = p < programs
        counts = tl.load(rows + S_COUNT, mask=mine, other=0.0, cache_modifier=".cg")
        means = tl.load(rows + S_MEAN, mask=mine, other=0.0, cache_modifier=".cg")
        total = tl.sum(counts, axis=0)
        safe = tl.where(total > 0, total, 1.0)
        t_mean = tl.sum(counts * means, axis=0) / safe
        spread = tl.where(counts > 0, counts * (means - t_mean) * (means - t_mean), 0.0)
        program_m2 = tl.load(rows + S_M2, mask=mine, other=0.0, cache_modifier=".cg")
        t_m2 = tl.sum(program_m2, axis=0) + tl.sum(spread, axis=0)
        t_m3 = tl.zeros((), dtype=tl.float64)
        t_m4 = tl.zeros((), dtype=tl.float64)
        if WANT_MOMENTS:  # each program's moments moved to the merged mean, then added up
            program_m3 = tl.load(rows + S_M3, mask=mine, other=0.0, cache_modifier=".cg")
            program_m4 = tl.load(rows + S_M4, mask=mine, other=0.0, cache_modifier=".cg")
            d = tl.where(counts > 0, means - t_mean, 0.0)
            t_m3 = tl.sum(program_m3 + 3.0 * d * program_m2 + counts * d * d * d, axis=0)
            t_m4 = tl.sum(program_m4 + 4.0 * d * program_m3 + 6.0 * d * d * program_m2 + counts * d * d * d * d, axis=0)
        t_low = tl.min(tl.load(rows + S_MIN, mask=mine, other=float("inf"), cache_modifier=".cg"), axis=0)
        t_high = tl.max(tl.load(rows + S_MAX, mask=mine, other=float("-inf"), cache_modifier=".cg"), axis=0)
        t_abs = tl.sum(tl.load(rows + S_ABS_SUM, mask=mine, other=0.0, cache_modifier=".cg"), axis=0)
        t_abs_min = tl.min(tl.load(rows + S_ABS_MIN_NONZERO, mask=mine, other=float("inf"), cache_modifier=".cg"), axis=0)
        poisoned = t_abs != t_abs  # a NaN read anywhere (min and max skipped it)
        if AMAX_OUT:  # NaN ignored, as an FP8 recipe's amax; no number at all: 0
            amax = tl.maximum(tl.abs(t_low), tl.abs(t_high))
            tl.store(amax_out_ptr, tl.where(t_low <= t_high, amax, 0.0).to(tl.float32))
        t_mean = tl.where(poisoned, float("nan"), t_mean)
        t_m2 = tl.where(poisoned, float("nan"), t_m2)
        t_m3 = tl.where(poisoned, float("nan"), t_m3)
        t_m4 = tl.where(poisoned, float("nan"), t_m4)
        t_low = tl.where(poisoned, float("nan"), t_low)
        t_high = tl.where(poisoned, float("nan"), t_high)
        t_abs_min = tl.where(poisoned, float("nan"), t_abs_min)
        t_u0 = _scratch_sum(rows + S_UNDERFLOWS + 0, mine)
        t_u1 = _scratch_sum(rows + S_UNDERFLOWS + 1, mine)
        t_u2 = _scratch_sum(rows + S_UNDERFLOWS + 2, mine)
        t_u3 = _scratch_sum(rows + S_UNDERFLOWS + 3, mine)
        t_o0 = _scratch_sum(rows + S_OVERFLOWS + 0, mine)
        t_o1 = _scratch_sum(rows + S_OVERFLOWS + 1, mine)
        t_o2 = _scratch_sum(rows + S_OVERFLOWS + 2, mine)
        t_o3 = _scratch_sum(rows + S_OVERFLOWS + 3, mine)
        t_e0 = _scratch_sum(rows + S_SQ_ERR + 0, mine)
        t_e1 = _scratch_sum(rows + S_SQ_ERR + 1, mine)
        t_e2 = _scratch_sum(rows + S_SQ_ERR + 2, mine)
        t_e3 = _scratch_sum(rows + S_SQ_ERR + 3, mine)
        if CALL_OUT:
            tl.store(call_out_ptr + F_COUNT, total)
            tl.store(call_out_ptr + F_MEAN, t_mean)
            tl.store(call_out_ptr + F_M2, t_m2)
            tl.store(call_out_ptr + F_MIN, t_low)
            tl.store(call_out_ptr + F_MAX, t_high)
            tl.store(call_out_ptr + F_ABS_SUM, t_abs)
            tl.store(call_out_ptr + F_ABS_MIN_NONZERO, t_abs_min)
            if WANT_MOMENTS:
                tl.store(call_out_ptr + F_M3, t_m3)
                tl.store(call_out_ptr + F_M4, t_m4)
        if ROWS > 0:
            _merge_into_row(
                table_ptr,
                row0,
                total,
                t_mean,
                t_m2,
                t_m3,
                t_m4,
                t_low,
                t_high,
                t_abs,
                t_abs_min,
                _pick(ROW_VARIANT0, t_u0, t_u1, t_u2, t_u3),
                _pick(ROW_VARIANT0, t_o0, t_o1, t_o2, t_o3),
                _pick(ROW_VARIANT0, t_e0, t_e1, t_e2, t_e3),
                _scale_ptr(ROW_VARIANT0, scale0_ptr, scale1_ptr, scale2_ptr, scale3_ptr),
                ROW_VARIANT0 >= 0,
                WANT_MOMENTS,
            )
        if ROWS > 1:
            _merge_into_row(
                table_ptr,
                row1,
                total,
                t_mean,
                t_m2,
                t_m3,
                t_m4,
                t_low,
                t_high,
                t_abs,
                t_abs_min,
                _pick(ROW_VARIANT1, t_u0, t_u1, t_u2, t_u3),
                _pick(ROW_VARIANT1, t_o0, t_o1, t_o2, t_o3),
                _pick(ROW_VARIANT1, t_e0, t_e1, t_e2, t_e3),
                _scale_ptr(ROW_VARIANT1, scale0_ptr, scale1_ptr, scale2_ptr, scale3_ptr),
                ROW_VARIANT1 >= 0,
                WANT_MOMENTS,
            )
        if ROWS > 2:
            _merge_into_row(
                table_ptr,
                row2,
                total,
                t_mean,
                t_m2,
                t_m3,
                t_m4,
                t_low,
                t_high,
                t_abs,
                t_abs_min,
                _pick(ROW_VARIANT2, t_u0, t_u1, t_u2, t_u3),
                _pick(ROW_VARIANT2, t_o0, t_o1, t_o2, t_o3),
                _pick(ROW_VARIANT2, t_e0, t_e1, t_e2, t_e3),
                _scale_ptr(ROW_VARIANT2, scale0_ptr, scale1_ptr, scale2_ptr, scale3_ptr),
                ROW_VARIANT2 >= 0,
                WANT_MOMENTS,
            )
        if ROWS > 3:
            _merge_into_row(
                table_ptr,
                row3,
                total,
                t_mean,
                t_m2,
                t_m3,
                t_m4,
                t_low,
                t_high,
                t_abs,
                t_abs_min,
                _pick(ROW_VARIANT3, t_u0, t_u1, t_u2, t_u3),
                _pick(ROW_VARIANT3, t_o0, t_o1, t_o2, t_o3),
                _pick(ROW_VARIANT3, t_e0, t_e1, t_e2, t_e3),
                _scale_ptr(ROW_VARIANT3, scale0_ptr, scale1_ptr, scale2_ptr, scale3_ptr),
                ROW_VARIANT3 >= 0,
                WANT_MOMENTS,
            )


@functools.cache
def _programs(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # the interpreter: a few programs still exercise the merge of their rows
    return min(torch.cuda.get_device_properties(device).multi_processor_count * PROGRAMS_PER_SM, MAX_PROGRAMS)


_workspace: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _scratch(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The programs' rows and the finished-programs counter of ``device``, allocated once (the
    counter is zeroed once; the last program of every launch sets it back to zero)."""
    if device not in _workspace:
        _workspace[device] = (
            torch.empty(MAX_PROGRAMS, SCRATCH_FIELDS, dtype=torch.float64, device=device),
            torch.zeros(1, dtype=torch.int32, device=device),
        )
    return _workspace[device]


def triton_tensor_stats(
    x: torch.Tensor,
    table: torch.Tensor,
    rows: Sequence[int],
    row_variants: Sequence[int],
    scales: Sequence[torch.Tensor],
    grids: Sequence[tuple[float, int, int]],
    call_out: torch.Tensor | None = None,
    amax_out: torch.Tensor | None = None,
    want_moments: bool = False,
) -> None:
    """``kernels.tensor_stats`` for a contiguous, non-empty CUDA tensor: one launch (see module docstring)."""
    if len(rows) > MAX_ROWS or len(scales) > MAX_VARIANTS:
        raise ValueError(f"one launch serves at most {MAX_ROWS} rows and {MAX_VARIANTS} grids")
    scratch, counter = _scratch(x.device)
    blocks = triton.cdiv(x.numel(), BLOCK)
    programs = min(blocks, _programs(x.device))
    padded_rows = [*rows, *[0] * (MAX_ROWS - len(rows))]
    padded_variants = [*row_variants, *[-1] * (MAX_ROWS - len(rows))]
    padded_scales = [*scales, *[table] * (MAX_VARIANTS - len(scales))]
    padded_grids = [*grids, *[(0.0, 0, 0)] * (MAX_VARIANTS - len(grids))]
    _tensor_stats[(programs,)](
        x,
        x.numel(),
        table,
        scratch,
        counter,
        call_out if call_out is not None else table,
        amax_out if amax_out is not None else table,
        *padded_rows,
        *padded_scales,
        ROWS=len(rows),
        VARIANTS=len(scales),
        **{f"ROW_VARIANT{i}": v for i, v in enumerate(padded_variants)},
        **{f"GRID_MAX{i}": g[0] for i, g in enumerate(padded_grids)},
        **{f"MIN_EXP{i}": g[1] for i, g in enumerate(padded_grids)},
        **{f"MANTISSA{i}": g[2] for i, g in enumerate(padded_grids)},
        CALL_OUT=call_out is not None,
        AMAX_OUT=amax_out is not None,
        WANT_MOMENTS=want_moments,
        BLOCK=BLOCK,
        PROGRAMS_BLOCK=MAX_PROGRAMS,
        **OPTIONS,
    )


COLUMN_BLOCK, ROW_BLOCK = 128, 32


# Sizes are plain ints: a launch would make one equal to 1 a constant and compile once more for it.
@triton.jit(do_not_specialize=["rows", "cols", "row_programs"])
def _column_amax(x_ptr, top_ptr, rows, cols, row_programs, ROWS: tl.constexpr, COLUMNS: tl.constexpr):
    """Each program: ``COLUMNS`` columns of the row-major ``rows`` x ``cols`` tensor, over every ``row_programs``-th
    tile of ``ROWS`` rows; the largest magnitude's bits of each column (NaN left out: its bits lie above
    infinity's), merged into ``top_ptr`` (int32, zeros at first) by an atomic maximum (bits order as magnitudes)."""
    columns = tl.program_id(0) * COLUMNS + tl.arange(0, COLUMNS)
    in_columns = columns < cols
    top = tl.zeros([COLUMNS], dtype=tl.int32)
    tile = tl.program_id(1).to(tl.int64)
    while tile * ROWS < rows:  # a while loop: Triton 3.6's interpreter cannot take a tensor as a range bound
        row = tile * ROWS + tl.arange(0, ROWS)
        tile += row_programs
        valid = (row < rows)[:, None] & in_columns[None, :]
        offsets = row[:, None] * cols + columns[None, :]
        if x_ptr.dtype.element_ty == tl.bfloat16:  # a bfloat16's bits are a float32's top half: no conversion
            halves = tl.load(x_ptr.to(tl.pointer_type(tl.int16)) + offsets, mask=valid, other=0)
            bits = (halves.to(tl.int32) & 0xFFFF) << 16
        else:
            bits = tl.load(x_ptr + offsets, mask=valid, other=0.0).to(tl.float32).to(tl.int32, bitcast=True)
        bits = bits & 0x7FFFFFFF
        bits = tl.where(bits > 0x7F800000, 0, bits)
        top = tl.maximum(top, tl.max(bits, axis=0))
    tl.atomic_max(top_ptr + columns, top, mask=in_columns)


def triton_column_amax(x: torch.Tensor) -> torch.Tensor:
    """``catalog.column_amax`` of the contiguous, non-empty 2-D CUDA tensor ``x`` (float32, bfloat16 or float16): one
    read of it, as float64."""
    rows, cols = x.shape
    top = torch.zeros(cols, dtype=torch.int32, device=x.device)
    column_programs = triton.cdiv(cols, COLUMN_BLOCK)
    row_programs = max(1, min(triton.cdiv(rows, ROW_BLOCK), _programs(x.device) // column_programs))
    _column_amax[(column_programs, row_programs)](x, top, rows, cols, row_programs, ROWS=ROW_BLOCK, COLUMNS=COLUMN_BLOCK)
    return top.view(torch.float32).double()
