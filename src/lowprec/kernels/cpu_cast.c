/* Block-scaled casts and decodes of CPU tensors, one pass per orientation (see kernels/cpu_cast.py).

Every value equals the torch emulation's (quant/block.py, formats/scales.py, formats/elements.py,
formats/noise.py) bit for bit: the same fp32 operations in the same order (built with
-ffp-contract=off, no fast math), round to nearest even by the FPU's default mode. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };
enum { RULE_MX_NVIDIA = 0, RULE_MX_OCP = 1, RULE_FP8_BLOCK = 2, RULE_NVFP4 = 3 };
#define FP32_MAX 3.4028234663852886e38f
#define PANEL 16            /* logical rows gathered at a time (rounded up to whole blocks) */
#define TRANSPOSED_PANEL 256 /* the same for a columnwise cast: x's columns, a cache line of each row and more */
#define PANEL_PAD 16         /* floats added to a panel row: 64 bytes, so that rows stay aligned */

static inline uint32_t float_bits(float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    return b;
}

static inline float bits_float(uint32_t b) {
    float f;
    memcpy(&f, &b, 4);
    return f;
}

static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
    if (exponent == 0x1F) return bits_float(sign | 0x7F800000u | (mantissa << 13));
    if (exponent == 0) {
        float magnitude = (float)mantissa * 0x1p-24f; /* exact: a subnormal half is a multiple of 2**-24 */
        return sign ? -magnitude : magnitude;
    }
    return bits_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

static inline float load(const void *x, int dtype, int64_t i) {
    if (dtype == DT_F32) return ((const float *)x)[i];
    if (dtype == DT_BF16) return bits_float((uint32_t)((const uint16_t *)x)[i] << 16);
    return half_to_float(((const uint16_t *)x)[i]);
}

/* An element format: mantissa bits, the exponent of its first normal binade, 2 to that power, its largest magnitude,
   its sign bit and the code of NaN (-1: none, NaN casts to +0). */
typedef struct {
    int mantissa_bits, first_exponent;
    float first_binade, max;
    int sign_bit, nan_code;
} Element;

/* The code of fp32 v: saturated at max, rounded to nearest even or (stochastic) to floor(steps + noise). Within the
   binade E of |v| (subnormals in the first normal one, e0) the grid steps by 2**(E - m): k = round(|v| * 2**(m - E))
   steps, code = (E - e0) * 2**m + k (a k that reaches the next binade is its first code), as MiniFloatFormat._codes.
   Branch-free, so that the compiler vectorizes the loops over a block. */
static inline int encode(float v, Element el, int stochastic, float noise) {
    uint32_t bits = float_bits(v);
    int is_nan = (bits & 0x7FFFFFFFu) > 0x7F800000u;
    float magnitude = is_nan ? 0.0f : bits_float(bits & 0x7FFFFFFFu);
    magnitude = magnitude > el.max ? el.max : magnitude;
    int biased = (int)(float_bits(magnitude < el.first_binade ? el.first_binade : magnitude) >> 23); /* E + 127 */
    float steps = magnitude * bits_float((uint32_t)(el.mantissa_bits + 254 - biased) << 23); /* exact: 2**(m - E) */
    float k;
    if (!stochastic) {
        k = (steps + 0x1p23f) - 0x1p23f; /* round to nearest even: steps is below 2**23 */
    } else {
        float whole = (float)(int)steps; /* floor: steps is not negative */
        k = whole + ((steps - whole) >= 1.0f - noise ? 1.0f : 0.0f);
    }
    int sign = (!is_nan && (bits >> 31)) ? el.sign_bit : 0;
    int code = sign + ((biased - 127 - el.first_exponent) << el.mantissa_bits) + (int)k;
    return is_nan && el.nan_code >= 0 ? el.nan_code : code;
}

/* The value of an E4M3 code below 0x7F (a block scale: never NaN), from its fields' bits. */
static inline float e4m3_value(int code) {
    uint32_t exponent = (code >> 3) & 0xF, mantissa = code & 7, normal = ((exponent + 120) << 23) | (mantissa << 20);
    uint32_t subnormal = float_bits((float)mantissa * 0x1p-9f), is_normal = -(uint32_t)(exponent != 0);
    return bits_float((normal & is_normal) | (subnormal & ~is_normal)); /* a select of bits: it vectorizes */
}

static inline uint32_t hash32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x21F0AAADu;
    x ^= x >> 16;
    x *= 0x735A2D97u;
    return x ^ (x >> 15);
}

/* noise.uniform's value at the row-major index whose 32-bit halves are low and high, under the key whose halves are
   key_low and key_high: a multiple of 2**-24 in [0, 1). */
static inline float uniform(uint32_t low, uint32_t high, uint32_t key_low, uint32_t key_high) {
    uint32_t mixed = hash32(hash32(low ^ key_low) ^ high ^ key_high);
    return (float)(int32_t)(mixed >> 8) * 0x1p-24f;
}

/* The NaN-ignoring amax of n contiguous values (TE's fmaxf keeps infinities and drops NaN), as the largest magnitude's
   bits below NaN's (magnitudes' bits order as their values), and in *nonfinite whether any value is NaN or infinite:
   the largest magnitude's bits at or above infinity's. */
static float scan_amax(const void *x, int dtype, int64_t n, int *nonfinite) {
    int32_t amax = 0, top = 0; /* signed, so that the compiler vectorizes the two maxima */
    if (dtype == DT_F32) {
        const int32_t *bits = x;
        for (int64_t i = 0; i < n; i++) {
            int32_t magnitude = bits[i] & 0x7FFFFFFF;
            top = magnitude > top ? magnitude : top;
            magnitude = magnitude <= 0x7F800000 ? magnitude : 0;
            amax = magnitude > amax ? magnitude : amax;
        }
        *nonfinite = top >= 0x7F800000;
        return bits_float((uint32_t)amax);
    }
    /* bf16 and fp16 alike: their own bits order as their magnitudes, so only the largest is converted */
    const int16_t *bits = x;
    int32_t infinity = dtype == DT_BF16 ? 0x7F80 : 0x7C00;
    for (int64_t i = 0; i < n; i++) {
        int32_t magnitude = bits[i] & 0x7FFF;
        top = magnitude > top ? magnitude : top;
        magnitude = magnitude <= infinity ? magnitude : 0;
        amax = magnitude > amax ? magnitude : amax;
    }
    *nonfinite = top >= infinity;
    return dtype == DT_BF16 ? bits_float((uint32_t)amax << 16) : half_to_float((uint16_t)amax);
}

/* The non-finite probe of what a read found: 0 when every value was finite, NaN when one was NaN or infinite. */
static inline float probe_of(int nonfinite) { return nonfinite ? NAN : 0.0f; }

/* An NVFP4 tensor's amax, for its per-tensor scale. */
static float tensor_amax(const void *x, int dtype, int64_t n) {
    int nonfinite;
    return scan_amax(x, dtype, n, &nonfinite);
}

/* A per-tensor FP8 cast's amax (NaN ignored) and, from the same read, its non-finite probe (what NonfiniteGuard
   takes instead of reading the tensor again). */
void amax_and_probe(const void *x, int dtype, int64_t n, float *amax, float *probe) {
    int nonfinite;
    *amax = scan_amax(x, dtype, n, &nonfinite);
    *probe = probe_of(nonfinite);
}

/* The probe alone: how NonfiniteGuard reads a CPU tensor that no cast read for it. */
void nonfinite_probe(const void *x, int dtype, int64_t n, float *probe) {
    float amax;
    amax_and_probe(x, dtype, n, &amax, probe);
}

/* fp32 v rounded to bf16 (nearest even; NaN to the canonical NaN, as torch's conversion) and back. */
static inline float round_bf16(float v) {
    uint32_t bits = float_bits(v);
    if (v != v) return bits_float(0x7FC00000u);
    return bits_float(((bits + 0x7FFFu + ((bits >> 16) & 1)) >> 16) << 16);
}

/* Eight fp32 values in one vector (GCC's and Clang's vector extensions: AVX where the CPU has it, else pairs of SSE
   registers or scalars), and their bits. */
typedef float f32x8 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));

/* *v = x[offset .. offset + 7] as fp32. */
static inline __attribute__((always_inline)) void load_8(const void *x, int dtype, int64_t offset, f32x8 *v) {
    if (dtype == DT_BF16) {
        u16x8 halves;
        memcpy(&halves, (const uint16_t *)x + offset, sizeof halves);
        u32x8 bits = __builtin_convertvector(halves, u32x8) << 16;
        memcpy(v, &bits, sizeof *v);
    } else if (dtype == DT_F32) {
        memcpy(v, (const float *)x + offset, sizeof *v);
    } else {
        for (int j = 0; j < 8; j++) (*v)[j] = load(x, dtype, offset + j);
    }
}

/* round_bf16 of eight values at once, in place. */
static inline __attribute__((always_inline)) void round_bf16_x8(f32x8 *v) {
    u32x8 bits, nan = (u32x8)(*v != *v), out;
    memcpy(&bits, v, sizeof bits);
    out = (nan & 0x7FC00000u) | (~nan & (((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16) << 16));
    memcpy(v, &out, sizeof out);
}

/* columns[j][i] = rows[i][j] for an 8 x 8 block: the interleaves an AVX transpose is made of where the compiler has
   __builtin_shufflevector (Clang, GCC 12 and later), element by element elsewhere. */
static inline void transpose_8x8(const f32x8 rows[8], f32x8 columns[8]) {
#if defined(__has_builtin) && __has_builtin(__builtin_shufflevector)
    f32x8 pairs[8], quads[8];
    for (int k = 0; k < 8; k += 2) {
        pairs[k] = __builtin_shufflevector(rows[k], rows[k + 1], 0, 8, 1, 9, 4, 12, 5, 13);
        pairs[k + 1] = __builtin_shufflevector(rows[k], rows[k + 1], 2, 10, 3, 11, 6, 14, 7, 15);
    }
    for (int k = 0; k < 8; k += 4)
        for (int h = 0; h < 2; h++) {
            quads[k + 2 * h] = __builtin_shufflevector(pairs[k + h], pairs[k + h + 2], 0, 1, 8, 9, 4, 5, 12, 13);
            quads[k + 2 * h + 1] = __builtin_shufflevector(pairs[k + h], pairs[k + h + 2], 2, 3, 10, 11, 6, 7, 14, 15);
        }
    for (int j = 0; j < 4; j++) {
        columns[j] = __builtin_shufflevector(quads[j], quads[j + 4], 0, 1, 2, 3, 8, 9, 10, 11);
        columns[j + 4] = __builtin_shufflevector(quads[j], quads[j + 4], 4, 5, 6, 7, 12, 13, 14, 15);
    }
#else
    for (int j = 0; j < 8; j++)
        for (int i = 0; i < 8; i++) columns[j][i] = rows[i][j];
#endif
}

/* formats/hadamard.transform along a columnwise cast's logical rows, which run down x's columns: every 16 values
   times signs (the padding's zeros too: -0 where a sign is -1), four rounds of butterflies (strides 1, 2, 4, 8:
   a + b, a - b), times 1/4, rounded to bf16 for a bf16 input; for x's rows first .. first + 15 (first: a multiple of
   16) and columns left .. left + width - 1, x of x_rows x x_cols (row_stride apart) padded with zeros. out: where
   column left + r's 16 transformed values go (out[r * out_stride + i]: the rows of a columnwise panel), or NULL to take
   only the amax of the butterflies' results into *amax_bits (NaN ignored, as bits: see tensor_amax); the transformed
   values' amax is that one times 1/4 and rounded, as scaling and rounding keep magnitudes in order. The 16 rows are
   first copied whole into tile (16 x tile_stride floats; x's rows lie a multiple of 4 KiB apart, and reading a little
   of each in turn would evict them from the cache), then transformed 8 columns at a time in vector registers. */
static void hadamard_tile(const void *x, int dtype, int64_t x_rows, int64_t x_cols, int64_t row_stride, int64_t first,
                          int64_t left, int64_t width, const float *signs, float *restrict tile, int64_t tile_stride,
                          float *restrict out, int64_t out_stride, int32_t *amax_bits) {
    int64_t padded_width = (width + 7) / 8 * 8;
    int64_t real_width = x_cols - left < padded_width ? (x_cols - left > 0 ? x_cols - left : 0) : padded_width;
    for (int i = 0; i < 16; i++) {
        float *restrict line = tile + i * tile_stride;
        int64_t r = 0;
        if (first + i < x_rows) {
            int64_t offset = (first + i) * row_stride + left;
            if (dtype == DT_BF16) {
                const uint16_t *restrict source = (const uint16_t *)x + offset;
                for (; r < real_width; r++) line[r] = bits_float((uint32_t)source[r] << 16);
            } else {
                for (; r < real_width; r++) line[r] = load(x, dtype, offset + r);
            }
        }
        for (; r < padded_width; r++) line[r] = 0.0f;
    }
    u32x8 amax = {0};
    for (int64_t r = 0; r < padded_width; r += 8) {
        f32x8 v[16];
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++) {
            memcpy(&v[i], tile + i * tile_stride + r, sizeof v[i]);
            v[i] *= signs[i];
        }
#pragma GCC unroll 4
        for (int stride = 1; stride < 16; stride *= 2)
#pragma GCC unroll 16
            for (int i = 0; i < 16; i++) {
                if (i & stride) continue;
                f32x8 a = v[i], b = v[i + stride];
                v[i] = a + b, v[i + stride] = a - b;
            }
        if (!out) { /* past width: the transform of zeros, zeros */
#pragma GCC unroll 16
            for (int i = 0; i < 16; i++) {
                u32x8 bits;
                memcpy(&bits, &v[i], sizeof bits);
                bits &= 0x7FFFFFFFu;
                bits &= (u32x8)(bits <= 0x7F800000u);
                u32x8 larger = (u32x8)(bits > amax);
                amax = (larger & bits) | (~larger & amax);
            }
            continue;
        }
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++) {
            v[i] *= 0.25f;
            if (dtype == DT_BF16) round_bf16_x8(&v[i]);
        }
        f32x8 top[8], bottom[8];
        transpose_8x8(v, top);
        transpose_8x8(v + 8, bottom);
        int n = width - r < 8 ? (int)(width - r) : 8;
        for (int j = 0; j < n; j++) {
            memcpy(out + (r + j) * out_stride, &top[j], sizeof top[j]);
            memcpy(out + (r + j) * out_stride + 8, &bottom[j], sizeof bottom[j]);
        }
    }
    if (!out)
        for (int j = 0; j < 8; j++) *amax_bits = (int32_t)amax[j] > *amax_bits ? (int32_t)amax[j] : *amax_bits;
}

/* What every block of one cast shares (see block_cast). */
typedef struct {
    int rule, power_2, marks_nan, stochastic;
    Element element, scale_element; /* scale_element: NVFP4's E4M3 */
    float element_max, element_param, encode_inverse, block_factor, mx_multipliers[255];
    uint64_t key;
} Cast;

/* The amax (NaN ignored) of the block whose first value is block in a panel whose rows are padded_cols apart,
   whether it holds a NaN, and (or-ed into *nonfinite) whether it holds a NaN or an infinity. Inlined with a constant
   block_w at each call, so that its loops have a fixed length. */
static inline __attribute__((always_inline)) float block_amax(const float *block, int64_t padded_cols, int block_h,
                                                              const int block_w, int *has_nan, int *nonfinite) {
    int32_t amax_bits = 0, top_bits = 0; /* magnitudes' bits order as their values, NaN's above all */
    for (int r = 0; r < block_h; r++) {
        const float *restrict values = block + r * padded_cols;
        for (int c = 0; c < block_w; c++) {
            int32_t bits = (int32_t)(float_bits(values[c]) & 0x7FFFFFFFu);
            top_bits = bits > top_bits ? bits : top_bits;
            int32_t finite = bits <= 0x7F800000 ? bits : 0;
            amax_bits = finite > amax_bits ? finite : amax_bits;
        }
    }
    *has_nan = top_bits > 0x7F800000;
    *nonfinite |= top_bits >= 0x7F800000;
    return bits_float((uint32_t)amax_bits);
}

/* The multiplier of an MX or FP8 block-scaling block of amax (NaN ignored; has_nan: it holds a NaN), its scale stored
   at scales[index] (NVFP4's: nvfp4_scales). */
static inline float block_scale(const Cast *k, float amax, int has_nan, void *scales, int64_t index) {
    if (k->rule == RULE_MX_NVIDIA || k->rule == RULE_MX_OCP) {
        int64_t byte;
        if (k->rule == RULE_MX_NVIDIA) {
            uint32_t bits = float_bits(amax * k->element_param);
            byte = bits > 0x400000 ? ((int64_t)bits + 0x7FFFFF) >> 23 : 0;
        } else {
            uint32_t bits = float_bits(amax);
            byte = bits == 0x7F800000u ? 254 : (int64_t)(bits >> 23) - (int64_t)k->element_param;
        }
        byte = byte < 0 ? 0 : (byte > 254 ? 254 : byte);
        ((uint8_t *)scales)[index] = has_nan && k->marks_nan ? 0xFF : (uint8_t)byte;
        return k->mx_multipliers[byte];
    }
    int usable = amax > 0.0f && isfinite(amax);
    float scale = k->element_max / (usable ? amax : 1.0f);
    if (isinf(scale)) scale = k->element_param;
    if (k->power_2) scale = bits_float(float_bits(scale) & 0x7F800000u);
    float multiplier = usable ? scale : 1.0f;
    ((float *)scales)[index] = 1.0f / multiplier;
    return multiplier;
}

/* Keeps GCC from compiling a function for its callers' constant arguments (whose folding can leave branches where
   the loops would vectorize). */
#if defined(__GNUC__) && !defined(__clang__)
#define NOT_SPECIALIZED __attribute__((noipa))
#else
#define NOT_SPECIALIZED __attribute__((noinline))
#endif

/* The multipliers of n NVFP4 blocks of amaxes[b] (NaN ignored), their E4M3 scale bytes stored in scales: a loop the
   compiler vectorizes, divisions included, where one block at a time would wait on each division. */
static NOT_SPECIALIZED void nvfp4_scales(const Cast *k, const float *restrict amaxes, int64_t n,
                                         uint8_t *restrict scales, float *restrict multipliers) {
    const Element e4m3 = k->scale_element;
    const float factor = k->block_factor, inverse = k->encode_inverse;
    for (int64_t b = 0; b < n; b++) {
        int code = encode(amaxes[b] * factor, e4m3, 0, 0.0f);
        float reciprocal = 1.0f / (e4m3_value(code) * inverse);
        scales[b] = (uint8_t)code;
        multipliers[b] = reciprocal > FP32_MAX ? FP32_MAX : reciprocal;
    }
}

/* The codes of n values times their multipliers, written from codes[first] on: long loops the compiler vectorizes. */
static void encode_run(const Cast *k, const float *restrict values, const float *restrict multipliers, int64_t n,
                       int64_t first, uint8_t *restrict out) {
    Element el = k->element;
    if (!k->stochastic) {
        for (int64_t c = 0; c < n; c++) out[c] = (uint8_t)encode(values[c] * multipliers[c], el, 0, 0.0f);
        return;
    }
    uint32_t key_low = (uint32_t)k->key, key_high = (uint32_t)(k->key >> 32);
    if ((uint64_t)first >> 32 == (uint64_t)(first + n - 1) >> 32) { /* one high half of the index for the run */
        uint32_t low = (uint32_t)first, high = (uint32_t)((uint64_t)first >> 32);
        for (int64_t c = 0; c < n; c++) {
            float noise = uniform(low + (uint32_t)c, high, key_low, key_high);
            out[c] = (uint8_t)encode(values[c] * multipliers[c], el, 1, noise);
        }
    } else {
        for (int64_t c = 0; c < n; c++) {
            uint64_t i = (uint64_t)(first + c);
            float noise = uniform((uint32_t)i, (uint32_t)(i >> 32), key_low, key_high);
            out[c] = (uint8_t)encode(values[c] * multipliers[c], el, 1, noise);
        }
    }
}

/* Rows top .. top + height - 1 of the logical matrix (element (i, j) at x[i * row_stride + j * col_stride]; its
   first real_rows of them real, each cols long) into a panel whose rows lie stride floats apart, zeros in the
   padding up to padded_cols: a rowwise cast's rows are copied; a columnwise cast's (x's columns) are gathered in
   8 x 8 blocks of x (8 of its rows at a time), each transposed in vector registers. */
static void gather_panel(const void *x, int dtype, int64_t top, int64_t height, int64_t real_rows, int64_t cols,
                         int64_t padded_cols, int64_t row_stride, int64_t col_stride, float *panel, int64_t stride) {
    for (int64_t r = 0; r < real_rows && cols < padded_cols; r++)
        memset(panel + r * stride + cols, 0, sizeof(float) * (padded_cols - cols));
    if (real_rows < height) memset(panel + real_rows * stride, 0, sizeof(float) * (height - real_rows) * stride);
    if (col_stride == 1) {
        for (int64_t r = 0; r < real_rows; r++)
            for (int64_t c = 0; c < cols; c++) panel[r * stride + c] = load(x, dtype, (top + r) * row_stride + c);
        return;
    }
    for (int64_t band = 0; band < cols; band += 8) {
        int64_t end = cols - band < 8 ? cols : band + 8, r = 0;
        if (end - band == 8 && row_stride == 1)
            for (; r + 8 <= real_rows; r += 8) {
                f32x8 block[8], columns[8];
                for (int i = 0; i < 8; i++) load_8(x, dtype, (band + i) * col_stride + top + r, &block[i]);
                transpose_8x8(block, columns);
                for (int j = 0; j < 8; j++) memcpy(panel + (r + j) * stride + band, &columns[j], sizeof columns[j]);
            }
        for (; r < real_rows; r++) /* the edges, value by value */
            for (int64_t c = band; c < end; c++)
                panel[r * stride + c] = load(x, dtype, (top + r) * row_stride + c * col_stride);
    }
}

/* The codes and block scales of the logical rows x columns matrix whose element (i, j) is x[i * row_stride + j *
   col_stride] (the rowwise cast: x itself; the columnwise one: its transpose), padded with zeros to whole
   block_h x block_w blocks. codes: uint8, padded rows x padded columns; scales: one per block, row-major, E8M0 or E4M3
   bytes (uint8) or fp32 (FP8 block scaling); tensor_scale_inv: NVFP4's decode scale. element_param: MX NVIDIA:
   fp32(1 / element max); MX OCP: the element's emax; FP8 block: the input dtype's largest value (an overflowing
   scale's); NVFP4: fp32(1 / 6). key: the noise key of stochastic rounding (stochastic != 0). signs: the 16 signs of
   the Hadamard transform the rows go through first (a columnwise cast's only, row_stride 1; block_w 16; an fp32 or
   bf16 x), NULL for none. probe (NULL: not wanted): the non-finite probe of the values the blocks read (x's, or
   with signs the transformed ones). Returns 0, or -1 where memory ran out. */
int block_cast(const void *x, int dtype, int64_t rows, int64_t cols, int64_t row_stride, int64_t col_stride,
               int block_h, int block_w, int rule, int mantissa_bits, int first_exponent, float element_max,
               int sign_bit, int nan_code, float element_param, int power_2, int marks_nan, int stochastic,
               uint64_t key, const float *signs, uint8_t *codes, void *scales, float *tensor_scale_inv,
               float *probe) {
    Element el = {mantissa_bits, first_exponent, ldexpf(1.0f, first_exponent), element_max, sign_bit, nan_code};
    int64_t padded_rows = (rows + block_h - 1) / block_h * block_h;
    int64_t padded_cols = (cols + block_w - 1) / block_w * block_w, blocks_per_row = padded_cols / block_w;
    if (probe) *probe = 0.0f;
    if (padded_rows == 0 || padded_cols == 0) { /* an empty tensor: no block, an amax of 0 */
        if (rule == RULE_NVFP4) *tensor_scale_inv = 0.0f;
        return 0;
    }
    int nonfinite = 0;
    int transform = signs != NULL;
    /* A columnwise panel gathers whole cache lines of x's rows (TRANSPOSED_PANEL values each); its rows lie
       PANEL_PAD floats more than a power of two apart, so that the gather's writes spread over cache sets. */
    int gathered = col_stride == 1 ? PANEL : TRANSPOSED_PANEL;
    int panel_rows = (gathered + block_h - 1) / block_h * block_h;
    int64_t stride = padded_cols + PANEL_PAD;
    /* the panel, then a row of block multipliers, (a columnwise transform) a tile of 16 of x's rows, and each block's
       amax and multiplier in a row of blocks */
    int64_t tile_stride = (panel_rows + 7) / 8 * 8 + 8; /* rows not a power of two apart */
    float *panel = malloc(sizeof(float) * (panel_rows * stride + padded_cols + (transform ? 16 * tile_stride : 0) +
                                           2 * blocks_per_row));
    if (!panel) return -1;
    float *multipliers = panel + panel_rows * stride, *tile = multipliers + padded_cols;
    float *block_amaxes = tile + (transform ? 16 * tile_stride : 0), *block_multipliers = block_amaxes + blocks_per_row;
    const Element e4m3 = {3, -6, 0x1p-6f, 448.0f, 0x80, 0x7F};
    Cast k = {rule, power_2, marks_nan, stochastic, el, e4m3, element_max, element_param, 1.0f, 1.0f, {0}, key};
    for (int b = 0; b < 255; b++) k.mx_multipliers[b] = ldexpf(1.0f, 127 - b);
    float encode_scale = 1.0f;
    if (rule == RULE_NVFP4) {
        float amax = 0.0f;
        if (transform) { /* a first pass of the transform, for its amax: cheaper than storing its result */
            int32_t amax_bits = 0;
            for (int64_t first = 0; first < padded_cols; first += 16)
                for (int64_t left = 0; left < padded_rows; left += panel_rows) {
                    int64_t width = padded_rows - left < panel_rows ? padded_rows - left : panel_rows;
                    hadamard_tile(x, dtype, cols, rows, col_stride, first, left, width, signs, tile, tile_stride, NULL,
                                  0, &amax_bits);
                }
            amax = bits_float((uint32_t)amax_bits) * 0.25f; /* the largest value's own scaling and rounding */
            if (dtype == DT_BF16) amax = round_bf16(amax);
        } else {
            amax = tensor_amax(x, dtype, rows * cols); /* x holds exactly the logical matrix's elements */
        }
        float ratio = 448.0f * 6.0f / amax;
        encode_scale = ratio > FP32_MAX ? FP32_MAX : ratio;
        if (amax == 0.0f || encode_scale == 0.0f) encode_scale = 1.0f;
        *tensor_scale_inv = amax / (448.0f * 6.0f);
    }
    k.encode_inverse = 1.0f / encode_scale, k.block_factor = encode_scale * element_param;
    for (int64_t top = 0; top < padded_rows; top += panel_rows) {
        int64_t height = padded_rows - top < panel_rows ? padded_rows - top : panel_rows;
        int64_t real_rows = rows - top < height ? rows - top : height;
        if (transform) /* each 16 of x's rows transformed together, then written down the panel (its padding too) */
            for (int64_t first = 0; first < padded_cols; first += 16)
                hadamard_tile(x, dtype, cols, rows, col_stride, first, top, height, signs, tile, tile_stride,
                              panel + first, stride, NULL);
        else
            gather_panel(x, dtype, top, height, real_rows, cols, padded_cols, row_stride, col_stride, panel, stride);
        for (int64_t block_top = 0; block_top < height; block_top += block_h) {
            int64_t first_block = (top + block_top) / block_h * blocks_per_row;
            const float *block_row = panel + block_top * stride;
            if (rule == RULE_NVFP4) { /* every block's amax, then every scale (NaN needs no mark: block_w 16) */
                int has_nan;
                for (int64_t bc = 0; bc < blocks_per_row; bc++)
                    block_amaxes[bc] = block_amax(block_row + bc * 16, stride, block_h, 16, &has_nan, &nonfinite);
                nvfp4_scales(&k, block_amaxes, blocks_per_row, (uint8_t *)scales + first_block, block_multipliers);
                for (int64_t bc = 0; bc < blocks_per_row; bc++)
                    for (int c = 0; c < 16; c++) multipliers[bc * 16 + c] = block_multipliers[bc];
            } else {
                for (int64_t bc = 0; bc < blocks_per_row; bc++) {
                    const float *block = block_row + bc * block_w;
                    int has_nan;
                    float amax = block_w == 32 ? block_amax(block, stride, block_h, 32, &has_nan, &nonfinite)
                                               : block_amax(block, stride, block_h, block_w, &has_nan, &nonfinite);
                    float multiplier = block_scale(&k, amax, has_nan, scales, first_block + bc);
                    for (int c = 0; c < block_w; c++) multipliers[bc * block_w + c] = multiplier;
                }
            }
            for (int r = 0; r < block_h; r++) {
                int64_t first = (top + block_top + r) * padded_cols;
                encode_run(&k, block_row + r * stride, multipliers, padded_cols, first, codes + first);
            }
        }
    }
    free(panel);
    if (probe) *probe = probe_of(nonfinite);
    return 0;
}

/* BlockScaledData.values: table[code] times its block's fp32 scale, then (has_tensor_scale) times tensor_scale, for
   codes of rows x columns in block_h x block_w blocks (whole ones: the data is padded). */
void block_decode(const uint8_t *codes, int64_t rows, int64_t cols, int block_h, int block_w, const float *table,
                  const float *scales, int has_tensor_scale, float tensor_scale, float *out) {
    int64_t blocks_per_row = cols / block_w;
    float factor = has_tensor_scale ? tensor_scale : 1.0f;
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t b = 0; b < blocks_per_row; b++) {
            float scale = scales[r / block_h * blocks_per_row + b];
            const uint8_t *block_codes = codes + r * cols + b * block_w;
            float *block_out = out + r * cols + b * block_w;
            if (has_tensor_scale) {
                for (int c = 0; c < block_w; c++) block_out[c] = (table[block_codes[c]] * scale) * factor;
            } else {
                for (int c = 0; c < block_w; c++) block_out[c] = table[block_codes[c]] * scale;
            }
        }
    }
}

/* A per-tensor FP8 operand's values: each code's fp32 value from table (torch's own conversion of the 256 bytes), in
   one pass, with no wider index between. */
void table_decode(const uint8_t *restrict codes, int64_t n, const float *restrict table, float *restrict out) {
    for (int64_t i = 0; i < n; i++) out[i] = table[codes[i]];
}

/* An emulated per-tensor FP8 GEMM's epilogue, in place on its rows x cols fp32 product: each value times
   scale_a[0] * scale_b[0] (the operands' scale_inv), plus bias[col] where given, as torch's multiply then add
   (two roundings); and from the same pass the result's non-finite probe: NaN when a value is NaN, infinite, or
   at least limit in magnitude (what rounds to infinity in the output dtype), else 0. */
void scale_product(float *restrict x, int64_t rows, int64_t cols, const float *scale_a, const float *scale_b,
                   const float *restrict bias, float limit, float *probe) {
    float scale = scale_a[0] * scale_b[0];
    int bad = 0;
    for (int64_t r = 0; r < rows; r++) {
        float *restrict row = x + r * cols;
        if (bias) {
            for (int64_t c = 0; c < cols; c++) {
                float v = row[c] * scale + bias[c];
                row[c] = v;
                bad |= !(fabsf(v) < limit);
            }
        } else {
            for (int64_t c = 0; c < cols; c++) {
                float v = row[c] * scale;
                row[c] = v;
                bad |= !(fabsf(v) < limit);
            }
        }
    }
    *probe = probe_of(bad);
}
