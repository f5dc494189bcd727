/* Partial statistics of a CPU tensor in one read: the CPU counterpart of triton_partials.py.

   The tensor is walked in chunks small enough to stay in the L1 cache. Each chunk is read twice
   from the cache (its mean first, then the squared deviations from that mean, so M2 is well
   conditioned) in float32, eight lanes at a time, and merged into the running result with Chan's
   formula in double precision, so rounding never accumulates beyond one chunk. Large tensors are
   split over a few threads, whose results merge the same way.
   Output, as partials.FIELDS begins: count, mean, m2, min, max, sum |x|, smallest non-zero |x|;
   a NaN anywhere makes every field but the count NaN, as torch's reductions do. */

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

enum { FLOAT32 = 0, BFLOAT16 = 1, FLOAT16 = 2 };
#define CHUNK 2048
#define MAX_THREADS 16

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

typedef struct {
    const void *data;
    int64_t start, end;
    int dtype, want_abs_min;
    Partials result;
} Range;

static void *range_partials(void *argument) {
    Range *range = (Range *)argument;
    float buffer[CHUNK];
    Partials *result = &range->result;
    *result = (Partials){0.0, 0.0, 0.0, INFINITY, -INFINITY, 0.0, INFINITY, 0};
    for (int64_t start = range->start; start < range->end; start += CHUNK) {
        int64_t n = range->end - start < CHUNK ? range->end - start : CHUNK;
        load_chunk(range->data, range->dtype, start, n, buffer);
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < n; i++) sum += buffer[i];
        float chunk_mean = sum / (float)n, chunk_m2 = 0.0f, chunk_abs = 0.0f;
        float chunk_low = INFINITY, chunk_high = -INFINITY, chunk_abs_min = INFINITY;
        if (range->want_abs_min) {
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
        merge(result, (double)n, chunk_mean, chunk_m2, chunk_low, chunk_high, chunk_abs, chunk_abs_min, chunk_nan);
    }
    return NULL;
}

/* The partials of data[0, count) into out[0..6], split over up to MAX_THREADS threads; the smallest
   non-zero |x| only if want_abs_min (else infinity, the field's identity). */
void cpu_partials(const void *data, int64_t count, int dtype, int want_abs_min, double *out, int threads) {
    Range ranges[MAX_THREADS];
    pthread_t workers[MAX_THREADS];
    threads = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
    int64_t per_thread = (count + threads - 1) / threads;
    per_thread = (per_thread + CHUNK - 1) / CHUNK * CHUNK;
    int started = 0;
    for (int t = 0; t < threads; t++) {
        int64_t start = t * per_thread, end = start + per_thread < count ? start + per_thread : count;
        ranges[t] = (Range){.data = data, .start = start < count ? start : count, .end = end, .dtype = dtype,
                            .want_abs_min = want_abs_min};
        if (t > 0 && pthread_create(&workers[t], NULL, range_partials, &ranges[t]) == 0) started |= 1 << t;
    }
    range_partials(&ranges[0]);
    Partials total = ranges[0].result;
    for (int t = 1; t < threads; t++) {
        if (started & (1 << t))
            pthread_join(workers[t], NULL);
        else
            range_partials(&ranges[t]);
        Partials *r = &ranges[t].result;
        merge(&total, r->count, r->mean, r->m2, r->low, r->high, r->abs_sum, r->abs_min, r->nan_seen);
    }
    double results[7] = {total.count, total.mean, total.m2, total.low, total.high, total.abs_sum, total.abs_min};
    if (total.nan_seen)
        for (int i = 1; i < 7; i++) results[i] = NAN;
    memcpy(out, results, sizeof results);
}
