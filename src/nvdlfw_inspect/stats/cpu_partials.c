/* Partial statistics of a CPU tensor in one read: the CPU counterpart of triton_partials.py.

   The tensor is walked in chunks small enough to stay in the L1 cache. Each chunk is read twice
   from the cache (its mean first, then the squared deviations from that mean, so M2 is well
   conditioned) in float32, eight lanes at a time, and merged into the running result with Chan's
   formula in double precision, so rounding never accumulates beyond one chunk.
   Output, as partials.FIELDS begins: count, mean, m2, min, max, sum |x|, smallest non-zero |x|;
   a NaN anywhere makes every field but the count NaN, as torch's reductions do. */

#include <math.h>
#include <stdint.h>
#include <string.h>

enum { FLOAT32 = 0, BFLOAT16 = 1, FLOAT16 = 2 };
#define CHUNK 2048

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

/* The chunk [start, start + n) as float32 in buffer. */
static void load_chunk(const void *data, int dtype, int64_t start, int64_t n, float *buffer) {
    if (dtype == FLOAT32) {
        memcpy(buffer, (const float *)data + start, (size_t)n * sizeof(float));
    } else if (dtype == BFLOAT16) {
        const uint16_t *x = (const uint16_t *)data + start;
        for (int64_t i = 0; i < n; i++) buffer[i] = bfloat16_value(x[i]);
    } else {
        const uint16_t *x = (const uint16_t *)data + start;
        for (int64_t i = 0; i < n; i++) buffer[i] = float16_value(x[i]);
    }
}

/* Running partials: count, mean and M2 (Chan's merge), min, max, sum |x|, min non-zero |x|, NaN seen. */
typedef struct {
    double count, mean, m2, low, high, abs_sum, abs_min;
    int nan_seen;
} Partials;

static void merge(Partials *into, double count, double mean, double m2, double low, double high, double abs_sum,
                  double abs_min, int nan_seen) {
    double merged = into->count + count, delta = mean - into->mean;
    if (count == 0.0) return;
    into->mean += delta * (count / merged);
    into->m2 += m2 + delta * delta * (into->count * count / merged);
    into->count = merged;
    into->abs_sum += abs_sum;
    into->low = low < into->low ? low : into->low;
    into->high = high > into->high ? high : into->high;
    into->abs_min = abs_min < into->abs_min ? abs_min : into->abs_min;
    into->nan_seen |= nan_seen;
}

/* The partials of data[0, count) into out[0..6]; the smallest non-zero |x| only if want_abs_min
   (else infinity, the field's identity). One thread: in a training step torch's own threads are
   still spinning after the previous operator, and a second thread of ours would compete with them. */
void cpu_partials(const void *data, int64_t count, int dtype, int want_abs_min, double *out) {
    float buffer[CHUNK];
    Partials total = {0.0, 0.0, 0.0, INFINITY, -INFINITY, 0.0, INFINITY, 0};
    for (int64_t start = 0; start < count; start += CHUNK) {
        int64_t n = count - start < CHUNK ? count - start : CHUNK;
        load_chunk(data, dtype, start, n, buffer);
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < n; i++) sum += buffer[i];
        float chunk_mean = sum / (float)n, chunk_m2 = 0.0f, chunk_abs = 0.0f;
        float chunk_low = INFINITY, chunk_high = -INFINITY, chunk_abs_min = INFINITY;
        if (want_abs_min) {
#pragma omp simd reduction(+ : chunk_m2, chunk_abs) reduction(min : chunk_low, chunk_abs_min) reduction(max : chunk_high)
            for (int64_t i = 0; i < n; i++) {
                float x = buffer[i], deviation = x - chunk_mean, magnitude = fabsf(x);
                chunk_m2 += deviation * deviation;
                chunk_abs += magnitude;
                chunk_low = x < chunk_low ? x : chunk_low;
                chunk_high = x > chunk_high ? x : chunk_high;
                chunk_abs_min = (magnitude > 0.0f && magnitude < chunk_abs_min) ? magnitude : chunk_abs_min;
            }
        } else {
#pragma omp simd reduction(+ : chunk_m2, chunk_abs) reduction(min : chunk_low) reduction(max : chunk_high)
            for (int64_t i = 0; i < n; i++) {
                float x = buffer[i], deviation = x - chunk_mean;
                chunk_m2 += deviation * deviation;
                chunk_abs += fabsf(x);
                chunk_low = x < chunk_low ? x : chunk_low;
                chunk_high = x > chunk_high ? x : chunk_high;
            }
        }
        int chunk_nan = 0;
        if (sum != sum) /* NaN in the chunk, or +inf and -inf: only the first poisons min and max */
            for (int64_t i = 0; i < n; i++) chunk_nan |= buffer[i] != buffer[i];
        merge(&total, (double)n, chunk_mean, chunk_m2, chunk_low, chunk_high, chunk_abs, chunk_abs_min, chunk_nan);
    }
    double results[7] = {total.count, total.mean, total.m2, total.low, total.high, total.abs_sum, total.abs_min};
    if (total.nan_seen)
        for (int i = 1; i < 7; i++) results[i] = NAN;
    memcpy(out, results, sizeof results);
}
