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
   min, max, sum |x|, smallest non-zero |x|, and when asked the third and fourth central moments m3 and m4
   (kurtosis; chunks merge them by Pebay's formulas); then per quantization grid ("variant": a scale and an
   FP8-like grid) the values that become zero (underflows), lie beyond the grid's range after scaling
   (overflows), the squared error of the dequantized value (squared in double: an FP8 error of a large
   value overflows float32), and the grid's scale_inv as its min and max. A NaN anywhere makes every
   field but the count NaN, as torch's reductions do. Each requested table row takes the tensor fields
   and the fields of its variant, merged with what the row already holds, each field by its rule. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
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

/* The central moments M2, M3 and M4 (m[0..2]) of count_a values of mean mean_a merged with those (b) of count_b
   values of mean mean_b: Chan's formula for M2, Pebay's for M3 and M4 (each from the others' values before it). */
static void merge_central(double *a, double count_a, double mean_a, const double *b, double count_b, double mean_b) {
    double n = count_a + count_b, delta = mean_b - mean_a, product = count_a * count_b;
    double d_n = delta / n, d_n2 = d_n * d_n;
    a[2] += b[2] + delta * d_n * d_n2 * product * (count_a * count_a - product + count_b * count_b) +
            6.0 * d_n2 * (count_a * count_a * b[0] + count_b * count_b * a[0]) + 4.0 * d_n * (count_a * b[1] - count_b * a[1]);
    a[1] += b[1] + delta * d_n2 * product * (count_a - count_b) + 3.0 * d_n * (count_a * b[0] - count_b * a[0]);
    a[0] += b[0] + delta * d_n * product;
}

/* Merge the row `add` into `into` (both N_FIELDS long), each field by its FIELD_RULE; the RULE_CHAN
   fields are the mean and the central moments, merged with the counts before the counts add up. */
static void merge_row(double *into, const double *add) {
    double n = into[F_COUNT] + add[F_COUNT];
    if (into[F_COUNT] == 0.0) {
        into[F_MEAN] = add[F_MEAN];
        into[F_M2] = add[F_M2], into[F_M3] = add[F_M3], into[F_M4] = add[F_M4];
    } else if (add[F_COUNT] > 0.0) {
        double moments[3] = {into[F_M2], into[F_M3], into[F_M4]}, added[3] = {add[F_M2], add[F_M3], add[F_M4]};
        merge_central(moments, into[F_COUNT], into[F_MEAN], added, add[F_COUNT], add[F_MEAN]);
        into[F_M2] = moments[0], into[F_M3] = moments[1], into[F_M4] = moments[2];
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
    double count, mean, moments[3], low, high, abs_sum, abs_min; /* moments: M2, M3 and M4 */
    int nan_seen;
    double underflows[MAX_VARIANTS], overflows[MAX_VARIANTS], sq_err[MAX_VARIANTS];
} Running;

/* Merge a chunk of n values, of mean mean and central moments chunk[0..2], into the running ones. */
static void merge_moments(Running *total, double n, double mean, const double *chunk) {
    merge_central(total->moments, total->count, total->mean, chunk, n, mean);
    total->mean = total->count == 0.0 ? mean : merged_mean(total->mean, total->count, mean, n);
    total->count += n;
}

/* A chunk's sums of the powers 1 to 4 of its values' deviations d from centre (double; shifted[k - 1]: sum of
   d^k), and its min, max, sum of |x| and (want_abs_min) smallest non-zero |x|. Inlined for a constant
   want_moments and want_abs_min, so that each loop computes only what is asked. */
static inline __attribute__((always_inline)) void chunk_sums(const float *buffer, int64_t n, double center,
                                                             const int want_moments, const int want_abs_min,
                                                             double *shifted, double *abs_sum_out, float *extremes) {
    double s1 = 0.0, s2 = 0.0, s3 = 0.0, s4 = 0.0, abs_sum = 0.0;
    float low = INFINITY, high = -INFINITY, abs_min = INFINITY;
#pragma omp simd reduction(+ : s1, s2, s3, s4, abs_sum) reduction(min : low, abs_min) reduction(max : high)
    for (int64_t i = 0; i < n; i++) {
        float x = buffer[i], magnitude = fabsf(x);
        double deviation = (double)x - center, square = deviation * deviation;
        s1 += deviation;
        s2 += square;
        if (want_moments) {
            s3 += square * deviation;
            s4 += square * square;
        }
        abs_sum += (double)magnitude;
        low = x < low ? x : low;
        high = x > high ? x : high;
        if (want_abs_min) abs_min = (magnitude > 0.0f && magnitude < abs_min) ? magnitude : abs_min;
    }
    shifted[0] = s1, shifted[1] = s2, shifted[2] = s3, shifted[3] = s4;
    *abs_sum_out = abs_sum;
    extremes[0] = low, extremes[1] = high, extremes[2] = abs_min;
}

static void add_chunk(Running *total, const float *buffer, int64_t n, int want_abs_min, int want_moments) {
    double center = isfinite(buffer[0]) ? (double)buffer[0] : 0.0; /* an infinite centre would turn +inf into NaN */
    double shifted[4], abs_sum;
    float extremes[3];
    if (want_moments)
        chunk_sums(buffer, n, center, 1, 1, shifted, &abs_sum, extremes);
    else if (want_abs_min)
        chunk_sums(buffer, n, center, 0, 1, shifted, &abs_sum, extremes);
    else
        chunk_sums(buffer, n, center, 0, 0, shifted, &abs_sum, extremes);
    /* central moments about the chunk's mean, centre + d where d = s1 / n: M2 = s2 - n d^2,
       M3 = s3 - 3 d s2 + 2 n d^3, M4 = s4 - 4 d s3 + 6 d^2 s2 - 3 n d^4 */
    double count = (double)n, d = shifted[0] / count, chunk[3];
    chunk[0] = shifted[1] - shifted[0] * d;
    chunk[0] = chunk[0] < 0.0 ? 0.0 : chunk[0]; /* NaN stays NaN */
    chunk[1] = want_moments ? shifted[2] - 3.0 * d * shifted[1] + 2.0 * count * d * d * d : 0.0;
    chunk[2] = want_moments ? shifted[3] - 4.0 * d * shifted[2] + 6.0 * d * d * shifted[1] - 3.0 * count * d * d * d * d : 0.0;
    chunk[2] = chunk[2] < 0.0 ? 0.0 : chunk[2];
    merge_moments(total, count, center + d, chunk);
    total->abs_sum += abs_sum;
    total->low = extremes[0] < total->low ? extremes[0] : total->low;
    total->high = extremes[1] > total->high ? extremes[1] : total->high;
    if (want_abs_min) total->abs_min = extremes[2] < total->abs_min ? extremes[2] : total->abs_min;
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
   mantissa_bits[v]. The smallest non-zero |x| only if want_abs_min (else its identity, infinity); M3 and M4 only
   if want_moments (else their identity, 0). If call_out is not NULL it receives the call's own row (tensor fields
   only); if amax_out is not NULL, the call's max |x| as float32, NaN ignored (0 when no element is a number). One
   thread: in a training step torch's own threads are still spinning after the previous operator, and a second
   thread of ours would compete with them. */
void tensor_stats(const void *data, int64_t count, int dtype, int want_abs_min, int want_moments, int variants,
                  const float *const *scales,
                  const float *grid_max, const int *min_normal_exp, const int *mantissa_bits, int slots, const int64_t *slot_rows,
                  const int *slot_variants, double *table, double *call_out, float *amax_out) {
    float buffer[CHUNK];
    Grid grids[MAX_VARIANTS];
    Running total = {0.0, 0.0, {0.0, 0.0, 0.0}, INFINITY, -INFINITY, 0.0, INFINITY, 0, {0}, {0}, {0}};
    variants = variants > MAX_VARIANTS ? MAX_VARIANTS : variants;
    for (int v = 0; v < variants; v++) {
        grids[v] = (Grid){*scales[v], 1.0f / *scales[v], grid_max[v], min_normal_exp[v], mantissa_bits[v]};
    }
    for (int64_t start = 0; start < count; start += CHUNK) {
        int64_t n = count - start < CHUNK ? count - start : CHUNK;
        const float *values = load_chunk(data, dtype, start, n, buffer);
        add_chunk(&total, values, n, want_abs_min, want_moments);
        for (int v = 0; v < variants; v++) add_chunk_quantization(&total, v, &grids[v], values, n);
    }
    double row[N_FIELDS];
    memcpy(row, FIELD_IDENTITY, sizeof row);
    row[F_COUNT] = total.count;
    row[F_MEAN] = total.mean;
    row[F_M2] = total.moments[0];
    if (want_moments) row[F_M3] = total.moments[1], row[F_M4] = total.moments[2];
    row[F_MIN] = total.low;
    row[F_MAX] = total.high;
    row[F_ABS_SUM] = total.abs_sum;
    row[F_ABS_MIN_NONZERO] = total.abs_min;
    if (total.nan_seen) {
        row[F_MEAN] = row[F_M2] = row[F_MIN] = row[F_MAX] = row[F_ABS_SUM] = row[F_ABS_MIN_NONZERO] = NAN;
        if (want_moments) row[F_M3] = row[F_M4] = NAN;
    }
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

/* The largest magnitude of each of the cols columns of the rows x cols row-major data into out (double), NaN
   ignored (0 for a column without a number): one read, keeping per column the largest magnitude's bits (they order as
   the magnitudes do, NaN's above infinity's, which are left out). Returns 0, or -1 where memory ran out. */
int column_amax(const void *data, int64_t rows, int64_t cols, int dtype, double *out) {
    uint32_t *top = calloc(cols > 0 ? (size_t)cols : 1, sizeof *top);
    if (top == NULL) return -1;
    for (int64_t r = 0; r < rows; r++) {
        if (dtype == FLOAT32) {
            const uint32_t *x = (const uint32_t *)data + r * cols;
            for (int64_t c = 0; c < cols; c++) {
                uint32_t magnitude = x[c] & 0x7FFFFFFFu;
                magnitude = magnitude > 0x7F800000u ? 0u : magnitude;
                top[c] = magnitude > top[c] ? magnitude : top[c];
            }
        } else {
            const uint16_t *x = (const uint16_t *)data + r * cols;
            for (int64_t c = 0; c < cols; c++) {
                float value = dtype == BFLOAT16 ? bfloat16_value(x[c]) : float16_value(x[c]);
                uint32_t magnitude;
                memcpy(&magnitude, &value, sizeof magnitude);
                magnitude &= 0x7FFFFFFFu;
                magnitude = magnitude > 0x7F800000u ? 0u : magnitude;
                top[c] = magnitude > top[c] ? magnitude : top[c];
            }
        }
    }
    for (int64_t c = 0; c < cols; c++) out[c] = (double)from_bits(top[c]);
    free(top);
    return 0;
}
