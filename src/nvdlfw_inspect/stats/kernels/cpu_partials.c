/* Partial statistics of a CPU tensor in one read, merged straight into rows of a statistics table:
   the CPU counterpart of triton.py.

   The tensor is walked in chunks small enough to stay in the L1 cache. Each chunk is read from the
   cache once for the tensor fields and once per quantization grid. The tensor fields are accumulated
   in double precision around a centre taken from the chunk itself (its first finite value), so no
   square of a float32, bfloat16 or float16 value overflows or underflows (3e38 and subnormals alike),
   and M2 = sum (x - c)^2 - (sum (x - c))^2 / n loses at most a factor n + 1 to cancellation however
   large the mean is against the spread. Chunks merge into the running result with Chan's formula in
   double precision, so rounding never accumulates beyond one chunk.

   A row is laid out as stats/fields.py says: kernels/cpu.py compiles this file after the layout it
   generates from there (the F_<FIELD> indices, N_FIELDS, and each field's FIELD_RULE and FIELD_IDENTITY),
   so this file names fields and never numbers them. A call fills the tensor fields: count, mean, m2,
   min, max, sum |x|, smallest non-zero |x|; then per quantization grid ("variant": a scale and an
   FP8-like grid) the values that become zero (underflows), lie beyond the grid's range after scaling
   (overflows), the squared error of the dequantized value (squared in double: an FP8 error of a large
   value overflows float32), and the grid's scale_inv as its min and max. A NaN anywhere makes every
   field but the count NaN, as torch's reductions do. Each requested table row takes the tensor fields
   and the fields of its variant, merged with what the row already holds, each field by its rule. */

#include <math.h>
#include <stdint.h>
#include <string.h>

enum { FLOAT32 = 0, BFLOAT16 = 1, FLOAT16 = 2 };
#define CHUNK 2048
#define MAX_VARIANTS 4
#define MAGIC 12582912.0f /* 1.5 * 2**23: adding and subtracting it rounds |y| < 2**22 to an integer (ties to even) */

static inline float bfloat16_value(uint16_t bits) {
    uint32_t wide = (uint32_t)bits << 16;
    float value;
    memcpy(&value, &wide, sizeof value);
    return value;
}

static inline float float16_value(uint16_t bits) {
    _Float16 value;
    memcpy(&value, &bits, sizeof value);
    return (float)value;
}

static inline float from_bits(uint32_t bits) {
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* The chunk [start, start + n) as float32: float32 data in place, other types converted into buffer. */
static const float *load_chunk(const void *data, int dtype, int64_t start, int64_t n, float *buffer) {
    if (dtype == FLOAT32) return (const float *)data + start;
    const uint16_t *x = (const uint16_t *)data + start;
    if (dtype == BFLOAT16) {
        for (int64_t i = 0; i < n; i++) buffer[i] = bfloat16_value(x[i]);
    } else {
        for (int64_t i = 0; i < n; i++) buffer[i] = float16_value(x[i]);
    }
    return buffer;
}

/* One quantization grid: x * scale saturates at +-max and rounds to nearest even on a grid with
   mantissa_bits bits whose smallest normal is 2**min_normal_exp (subnormals below); the value it
   stands for is that times scale_inv. The same arithmetic as triton.py's round_to_grid. */
typedef struct {
    float scale, scale_inv, max;
    int min_normal_exp, mantissa_bits;
} Grid;

static inline float round_to_grid(float v, const Grid *grid) {
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    int exponent = (int)((bits >> 23) & 0xFF);
    int floor_exponent = 127 + grid->min_normal_exp;
    int spacing_exponent = (exponent > floor_exponent ? exponent : floor_exponent) - grid->mantissa_bits;
    float spacing = from_bits((uint32_t)spacing_exponent << 23);
    float inverse = from_bits((uint32_t)(254 - spacing_exponent) << 23);
    float steps = (v * inverse + MAGIC) - MAGIC;
    float rounded = steps * spacing;
    return rounded == 0.0f ? v * 0.0f : rounded;
}

static inline double min_nan(double a, double b) { return (a != a || b != b) ? NAN : (a < b ? a : b); }
static inline double max_nan(double a, double b) { return (a != a || b != b) ? NAN : (a > b ? a : b); }

/* The mean of count_a values of mean a and count_b of mean b (Chan's update; with an infinite or NaN
   mean, their sum: inf and a finite mean give inf, inf and -inf NaN, where the update would give NaN). */
static inline double merged_mean(double a, double count_a, double b, double count_b) {
    double delta = b - a;
    return isfinite(delta) ? a + delta * (count_b / (count_a + count_b)) : a + b;
}

/* Merge the row `add` into `into` (both N_FIELDS long), each field by its FIELD_RULE; the RULE_CHAN
   fields are the mean and M2, merged with the counts by Chan's formula before the counts add up. */
static void merge_row(double *into, const double *add) {
    double n = into[F_COUNT] + add[F_COUNT];
    if (into[F_COUNT] == 0.0) {
        into[F_MEAN] = add[F_MEAN];
        into[F_M2] = add[F_M2];
    } else if (add[F_COUNT] > 0.0) {
        double delta = add[F_MEAN] - into[F_MEAN];
        into[F_M2] += add[F_M2] + delta * delta * (into[F_COUNT] * add[F_COUNT] / n);
        into[F_MEAN] = merged_mean(into[F_MEAN], into[F_COUNT], add[F_MEAN], add[F_COUNT]);
    }
    for (int i = 0; i < N_FIELDS; i++) {
        switch (FIELD_RULE[i]) {
        case RULE_SUM: into[i] += add[i]; break;
        case RULE_MIN: into[i] = min_nan(into[i], add[i]); break;
        case RULE_MAX: into[i] = max_nan(into[i], add[i]); break;
        default: break; /* RULE_CHAN: merged above */
        }
    }
}

/* Running tensor fields over the chunks, and per grid the quantization counts and error. */
typedef struct {
    double count, mean, m2, low, high, abs_sum, abs_min;
    int nan_seen;
    double underflows[MAX_VARIANTS], overflows[MAX_VARIANTS], sq_err[MAX_VARIANTS];
} Running;

/* Merge the chunk's count n, mean and m2 into the running ones (Chan's formula). */
static void merge_moments(Running *total, double n, double mean, double m2) {
    double merged = total->count + n, delta = mean - total->mean;
    total->m2 += m2 + delta * delta * (total->count * n / merged);
    total->mean = total->count == 0.0 ? mean : merged_mean(total->mean, total->count, mean, n);
    total->count = merged;
}

static void add_chunk(Running *total, const float *buffer, int64_t n, int want_abs_min) {
    double center = isfinite(buffer[0]) ? (double)buffer[0] : 0.0; /* an infinite centre would turn +inf into NaN */
    double shifted = 0.0, squares = 0.0, abs_sum = 0.0;
    float low = INFINITY, high = -INFINITY, abs_min = INFINITY;
    if (want_abs_min) {
#pragma omp simd reduction(+ : shifted, squares, abs_sum) reduction(min : low, abs_min) reduction(max : high)
        for (int64_t i = 0; i < n; i++) {
            float x = buffer[i], magnitude = fabsf(x);
            double deviation = (double)x - center;
            shifted += deviation;
            squares += deviation * deviation;
            abs_sum += (double)magnitude;
            low = x < low ? x : low;
            high = x > high ? x : high;
            abs_min = (magnitude > 0.0f && magnitude < abs_min) ? magnitude : abs_min;
        }
    } else {
#pragma omp simd reduction(+ : shifted, squares, abs_sum) reduction(min : low) reduction(max : high)
        for (int64_t i = 0; i < n; i++) {
            float x = buffer[i];
            double deviation = (double)x - center;
            shifted += deviation;
            squares += deviation * deviation;
            abs_sum += (double)fabsf(x);
            low = x < low ? x : low;
            high = x > high ? x : high;
        }
    }
    double count = (double)n, m2 = squares - shifted * (shifted / count);
    merge_moments(total, count, center + shifted / count, m2 < 0.0 ? 0.0 : m2); /* NaN stays NaN */
    total->abs_sum += abs_sum;
    total->low = low < total->low ? low : total->low;
    total->high = high > total->high ? high : total->high;
    total->abs_min = abs_min < total->abs_min ? abs_min : total->abs_min;
    total->nan_seen |= abs_sum != abs_sum; /* only a NaN makes a sum of magnitudes NaN */
}

static void add_chunk_quantization(Running *total, int v, const Grid *grid, const float *buffer, int64_t n) {
    double sq_err = 0.0;
    int64_t underflows = 0, overflows = 0;
#pragma omp simd reduction(+ : sq_err, underflows, overflows)
    for (int64_t i = 0; i < n; i++) {
        float x = buffer[i], scaled = x * grid->scale;
        overflows += fabsf(scaled) > grid->max;
        scaled = scaled > grid->max ? grid->max : (scaled < -grid->max ? -grid->max : scaled);
        float q = round_to_grid(scaled, grid);
        underflows += x != 0.0f && q == 0.0f;
        double error = (double)(x - q * grid->scale_inv);
        sq_err += error * error;
    }
    total->underflows[v] += (double)underflows;
    total->overflows[v] += (double)overflows;
    total->sq_err[v] += sq_err;
}

/* The statistics of data[0, count) merged into the table rows slot_rows[0, slots): every row takes
   the tensor fields, and the quantization fields of the variant slot_variants[s] (-1: none). Variant
   v casts with the float32 *scales[v] on a grid of max grid_max[v], min_normal_exp[v] and
   mantissa_bits[v]. The smallest non-zero |x| only if want_abs_min (else its identity, infinity).
   If call_out is not NULL it receives the call's own row (tensor fields only); if amax_out is not
   NULL, the call's max |x| as float32, NaN ignored (0 when no element is a number). One thread: in a training step torch's own threads are still
   spinning after the previous operator, and a second thread of ours would compete with them. */
void tensor_stats(const void *data, int64_t count, int dtype, int want_abs_min, int variants, const float *const *scales,
                  const float *grid_max, const int *min_normal_exp, const int *mantissa_bits, int slots, const int64_t *slot_rows,
                  const int *slot_variants, double *table, double *call_out, float *amax_out) {
    float buffer[CHUNK];
    Grid grids[MAX_VARIANTS];
    Running total = {0.0, 0.0, 0.0, INFINITY, -INFINITY, 0.0, INFINITY, 0, {0}, {0}, {0}};
    variants = variants > MAX_VARIANTS ? MAX_VARIANTS : variants;
    for (int v = 0; v < variants; v++) {
        grids[v] = (Grid){*scales[v], 1.0f / *scales[v], grid_max[v], min_normal_exp[v], mantissa_bits[v]};
    }
    for (int64_t start = 0; start < count; start += CHUNK) {
        int64_t n = count - start < CHUNK ? count - start : CHUNK;
        const float *values = load_chunk(data, dtype, start, n, buffer);
        add_chunk(&total, values, n, want_abs_min);
        for (int v = 0; v < variants; v++) add_chunk_quantization(&total, v, &grids[v], values, n);
    }
    double row[N_FIELDS];
    memcpy(row, FIELD_IDENTITY, sizeof row);
    row[F_COUNT] = total.count;
    row[F_MEAN] = total.mean;
    row[F_M2] = total.m2;
    row[F_MIN] = total.low;
    row[F_MAX] = total.high;
    row[F_ABS_SUM] = total.abs_sum;
    row[F_ABS_MIN_NONZERO] = total.abs_min;
    if (total.nan_seen)
        row[F_MEAN] = row[F_M2] = row[F_MIN] = row[F_MAX] = row[F_ABS_SUM] = row[F_ABS_MIN_NONZERO] = NAN;
    if (call_out != NULL) memcpy(call_out, row, sizeof row);
    if (amax_out != NULL) { /* NaN ignored, as an FP8 recipe's amax: low and high skip it; nothing else: 0 */
        double amax = fabs(total.low) > fabs(total.high) ? fabs(total.low) : fabs(total.high);
        *amax_out = total.low > total.high ? 0.0f : (float)amax;
    }
    for (int s = 0; s < slots; s++) {
        int v = slot_variants[s];
        double own[N_FIELDS];
        memcpy(own, row, sizeof row);
        if (v >= 0 && v < variants) {
            own[F_UNDERFLOWS] = total.underflows[v];
            own[F_OVERFLOWS] = total.overflows[v];
            own[F_SQ_ERR] = total.sq_err[v];
            own[F_SCALE_INV_MIN] = own[F_SCALE_INV_MAX] = grids[v].scale_inv;
        }
        merge_row(table + slot_rows[s] * N_FIELDS, own);
    }
}
