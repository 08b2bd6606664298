/* Decode attention over the paged cache, for a CPU: one query per sequence,
 * K/V read in place from their blocks (no gather copy), float32 softmax.
 *
 * The same attention as ops.paged_decode_attention (the definition; the tests
 * compare the two). Built by cpu_decode.py with the shapes that stay fixed
 * for a model as constants, so the compiler unrolls and vectorizes the
 * head_dim loops and keeps each head's accumulator on the stack:
 *   HEAD_DIM, Q_PER_KV (query heads per kv head), KV_HEADS, and the element
 *   types cache_t (the cache's) and act_t (the activations': q, the output,
 *   the new K/V rows, so no caller converts them around the call), each
 *   uint16_t (bf16 bits), _Float16 or float. An 8-bit float cache (vLLM's
 *   unscaled fp8: CACHE_FP8_E4M3 or CACHE_FP8_E5M2 defined, cache_t
 *   uint8_t) is read and written here too, at half the bytes a 16-bit one
 *   takes; an int8 cache (CACHE_INT8, cache_t int8_t) is read with its
 *   per-token scales.
 *
 * Work items are (sequence, range of kv heads): a whole token row (every kv
 * head) is contiguous in a block, so one item per sequence reads each block
 * front to back; with fewer sequences than threads each kv head is its own
 * item so one sequence still fills every core.
 *
 * Each block is one step of an online softmax (as the Triton decode kernel
 * does): scores for its tokens, a running max and sum per query head, the
 * accumulator rescaled when the max grows. A head's scores lie side by side
 * so its max and exponentials run as vector loops (exp_simd).
 *
 * While a block's scores are computed, the K and V rows PREFETCH_ROWS tokens
 * ahead are requested (into the next block at its end): the blocks of a
 * sequence lie anywhere in the cache, and a row's first load otherwise waits
 * on memory (docs/cpu.md has the measurements). Fetching a whole next
 * block at once did not help (too many requests in flight at once). */
#include <math.h>
#include <stdint.h>

#define HEADS (KV_HEADS * Q_PER_KV)
#define ROW (KV_HEADS * HEAD_DIM)
#define MAX_BLOCK 256
#define PREFETCH_ROWS 4  /* token rows of K and V requested ahead of the row in use */

#include "bf16.h"

static inline float float_from_bits(uint32_t u) {
    const union { uint32_t u; float f; } bits = { .u = u };
    return bits.f;
}

static inline uint32_t float_bits(float f) {
    const union { float f; uint32_t u; } bits = { .f = f };
    return bits.u;
}

/* float16 bits widened exactly, in integer and float operations that
 * vectorize (a _Float16 cast here is a call per element, ~4x slower): the
 * exponent rebiased, which is right for a normal number; a subnormal one
 * (exponent 0, mantissa m: m 2^-24) then reads 2^-15 (1 + m/1024), and
 * twice that less 2^-14 is its value; infinities and NaNs kept. */
static inline float half_bits_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, mag = h & 0x7fff;
    const float f = float_from_bits((mag << 13) + (112u << 23));
    const float special = float_from_bits(0x7f800000u | (mag & 0x3ff) << 13);  /* inf, NaN */
    const float value = mag < 0x400 ? 2.f * f - 0x1p-14f : (mag >= 0x7c00 ? special : f);
    return float_from_bits(sign | float_bits(value));
}

static inline float f16_to_float(_Float16 x) {
    const union { _Float16 h; uint16_t u; } bits = { .h = x };
    return half_bits_to_float(bits.u);
}
static inline _Float16 f16_from_float(float x) { return (_Float16)x; }
static inline float f32_as_is(float x) { return x; }

#if defined(CACHE_FP8_E4M3) || defined(CACHE_FP8_E5M2)
#define CACHE_FP8
/* An fp8 code widened exactly. e5m2 is the top byte of a float16. e4m3
 * (bias 7, no infinities, NaN at 0x7f/0xff) is rebiased the same way: a
 * subnormal code m (m 2^-9) reads 2^-7 (1 + m/8), twice that less 2^-6. */
static inline float fp8_to_float(uint8_t x) {
#ifdef CACHE_FP8_E5M2
    return half_bits_to_float((uint16_t)(x << 8));
#else
    const uint32_t sign = (uint32_t)(x & 0x80) << 24, mag = x & 0x7f;
    const float f = float_from_bits(((mag << 20) + (120u << 23)));
    const float value = mag < 8 ? 2.f * f - 0x1p-6f : f;
    return mag == 0x7f ? NAN : float_from_bits(sign | float_bits(value));
#endif
}

/* The reference's saturating cast (kv_quant.quantize: clamped to the
 * largest finite value, then rounded to nearest even), bit for bit; NaN
 * keeps its sign. A subnormal code is the value in units of the smallest
 * one, rounded; a normal one is the float's exponent and top mantissa bits
 * after rounding the bits below them, rebiased. */
static inline uint8_t float_to_fp8(float x) {
#ifdef CACHE_FP8_E5M2
    enum { MAN = 2, REBIAS = (127 - 15) << 2 };
    const float largest = 57344.f, smallest_normal = 0x1p-14f, subnormal_units = 0x1p16f;
#else
    enum { MAN = 3, REBIAS = (127 - 7) << 3 };
    const float largest = 448.f, smallest_normal = 0x1p-6f, subnormal_units = 0x1p9f;
#endif
    const uint32_t sign = (float_bits(x) >> 24) & 0x80;
    const float a = fabsf(x) > largest ? largest : fabsf(x);
    const uint32_t u = float_bits(a), low = 23 - MAN;
    const uint32_t normal = (u + (1u << (low - 1)) - 1 + ((u >> low) & 1)) >> low;
    const uint32_t code = a < smallest_normal ? (uint32_t)__builtin_rintf(a * subnormal_units) : normal - REBIAS;
    return (uint8_t)(sign | (x != x ? 0x7f : code));
}
#define FP8_CASE uint8_t: fp8_to_float,
#define FP8_FROM_CASE uint8_t: float_to_fp8,
#else
#define FP8_CASE
#define FP8_FROM_CASE
#endif

#ifdef CACHE_INT8
/* An int8 cache: codes times their token's float16 scale (per kv head), applied after widening. */
static inline float int8_as_float(int8_t x) { return (float)x; }
#define INT8_CASE int8_t: int8_as_float,
#else
#define INT8_CASE
#endif

/* cache_t and act_t come from the build flags: uint16_t holds bf16 bits. */
#define TO_FLOAT(x) _Generic((x), FP8_CASE INT8_CASE uint16_t: bf16_to_float, _Float16: f16_to_float, float: f32_as_is)(x)
#define FROM_FLOAT(type, x) \
    _Generic((type){0}, FP8_FROM_CASE uint16_t: bf16_from_float, _Float16: f16_from_float, float: f32_as_is)(x)

/* e^x, vectorizable (glibc's expf is a call per element here): Cody-Waite
 * range reduction and Cephes' degree-6 polynomial, within 2 ulp of expf; 0
 * below -87 (expf's results there are under 1e-38), NaN stays NaN. */
static inline float exp_simd(float x) {
    const float c = x > 88.f ? 88.f : x;
    const float n = __builtin_rintf(c * 1.44269504f);
    const float r = (c - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    const float y = x < -87.f ? 0.f : p * float_from_bits((uint32_t)((int32_t)n + 127) << 23);
    return x != x ? x : y;
}

#ifdef CACHE_INT8
/* One token's widened int8 row times its kv heads' float16 scales (the
 * reference's dequantization: one float32 product per value). */
static inline void scale_row(float* row, const uint16_t* scales, int64_t h0, int64_t h1) {
    for (int64_t h = h0; h < h1; h++) {
        const float f = half_bits_to_float(scales[h]);
        for (int d = 0; d < HEAD_DIM; d++) row[h * HEAD_DIM + d] *= f;
    }
}
#endif

/* Ask for kv heads [h0, h1) of a token row ahead of its use. */
static inline void prefetch_heads(const cache_t* row, int64_t h0, int64_t h1) {
    const char* first = (const char*)(row + h0 * HEAD_DIM);
    const char* end = (const char*)(row + h1 * HEAD_DIM);
    for (const char* line = first; line < end; line += 64) __builtin_prefetch(line, 0, 3);
}

static inline __attribute__((always_inline)) void attend(const act_t* q, const cache_t* k, const cache_t* v, const int32_t* table,
                   int64_t len, int64_t h0, int64_t h1, act_t* out, int64_t block_size,
                   int64_t num_blocks, float scale, int64_t window, float softcap,
                   const uint16_t* k_scales, const uint16_t* v_scales) {
    const int64_t start = (window > 0 && len > window) ? len - window : 0;
    float qs[HEADS][HEAD_DIM], acc[HEADS][HEAD_DIM], row[ROW];
    float score[HEADS][MAX_BLOCK], m[HEADS], sum[HEADS];
    for (int64_t i = h0 * Q_PER_KV; i < h1 * Q_PER_KV; i++) {
        for (int d = 0; d < HEAD_DIM; d++) {
            qs[i][d] = TO_FLOAT(q[i * HEAD_DIM + d]) * scale;
            acc[i][d] = 0.f;
        }
        m[i] = -INFINITY;
        sum[i] = 0.f;
    }
    for (int64_t first = start - start % block_size; first < len; first += block_size) {
        int64_t blk = table[first / block_size];
        blk = blk < 0 ? 0 : (blk >= num_blocks ? num_blocks - 1 : blk);  /* junk entries */
        const int64_t lo = first < start ? start - first : 0;
        const int64_t hi = len - first < block_size ? len - first : block_size;
        const cache_t* kb = k + blk * block_size * ROW;
        const cache_t* vb = v + blk * block_size * ROW;
        const cache_t* kn = kb;  /* the next block's rows: where the prefetch goes past this one */
        const cache_t* vn = vb;
        if (first + block_size < len) {
            int64_t next = table[first / block_size + 1];
            next = next < 0 ? 0 : (next >= num_blocks ? num_blocks - 1 : next);
            kn = k + next * block_size * ROW;
            vn = v + next * block_size * ROW;
        }
        for (int64_t s = lo; s < hi; s++) {
            const int64_t ahead = s + PREFETCH_ROWS;
            prefetch_heads(ahead < block_size ? kb + ahead * ROW : kn + (ahead - block_size) * ROW, h0, h1);
            prefetch_heads(ahead < block_size ? vb + ahead * ROW : vn + (ahead - block_size) * ROW, h0, h1);
            for (int64_t d = h0 * HEAD_DIM; d < h1 * HEAD_DIM; d++) row[d] = TO_FLOAT(kb[s * ROW + d]);
#ifdef CACHE_INT8
            scale_row(row, k_scales + (blk * block_size + s) * KV_HEADS, h0, h1);
#endif
            for (int64_t i = h0 * Q_PER_KV; i < h1 * Q_PER_KV; i++) {
                const float* kh = row + (i / Q_PER_KV) * HEAD_DIM;
                float dot = 0.f;
                for (int d = 0; d < HEAD_DIM; d++) dot += qs[i][d] * kh[d];
                if (softcap > 0.f) dot = softcap * tanhf(dot / softcap);
                score[i][s] = dot;
            }
        }
        for (int64_t i = h0 * Q_PER_KV; i < h1 * Q_PER_KV; i++) {
            float top = m[i];
            float* sc = score[i];
            #pragma omp simd reduction(max:top)
            for (int64_t s = lo; s < hi; s++) top = sc[s] > top ? sc[s] : top;
            if (top > m[i]) {  /* rescale what was summed under the old max */
                const float shrink = expf(m[i] - top);
                for (int d = 0; d < HEAD_DIM; d++) acc[i][d] *= shrink;
                sum[i] *= shrink;
                m[i] = top;
            }
            float total = 0.f;
            #pragma omp simd reduction(+:total)
            for (int64_t s = lo; s < hi; s++) {
                sc[s] = exp_simd(sc[s] - top);
                total += sc[s];
            }
            sum[i] += total;
        }
        /* One kv head at a time, so its query heads' accumulators stay in
         * registers over the block's tokens (all heads' do not fit). */
        for (int64_t h = h0; h < h1; h++) {
            float a[Q_PER_KV][HEAD_DIM];
            for (int j = 0; j < Q_PER_KV; j++)
                for (int d = 0; d < HEAD_DIM; d++) a[j][d] = acc[h * Q_PER_KV + j][d];
            for (int64_t s = lo; s < hi; s++) {
                const cache_t* vh = vb + s * ROW + h * HEAD_DIM;
                float vr[HEAD_DIM];
                for (int d = 0; d < HEAD_DIM; d++) vr[d] = TO_FLOAT(vh[d]);
#ifdef CACHE_INT8
                const float f = half_bits_to_float(v_scales[(blk * block_size + s) * KV_HEADS + h]);
                for (int d = 0; d < HEAD_DIM; d++) vr[d] *= f;
#endif
                for (int j = 0; j < Q_PER_KV; j++) {
                    const float p = score[h * Q_PER_KV + j][s];
                    for (int d = 0; d < HEAD_DIM; d++) a[j][d] += p * vr[d];
                }
            }
            for (int j = 0; j < Q_PER_KV; j++)
                for (int d = 0; d < HEAD_DIM; d++) acc[h * Q_PER_KV + j][d] = a[j][d];
        }
    }
    for (int64_t i = h0 * Q_PER_KV; i < h1 * Q_PER_KV; i++) {
        const float inv = sum[i] > 0.f ? 1.f / sum[i] : 0.f;  /* no visible key: zeros */
        for (int d = 0; d < HEAD_DIM; d++) out[i * HEAD_DIM + d] = FROM_FLOAT(act_t, acc[i][d] * inv);
    }
}

/* q: [batch, HEADS, HEAD_DIM] with rows q_stride apart; out: the same,
 * contiguous; k, v: [num_blocks, block_size, KV_HEADS, HEAD_DIM]; tables:
 * [batch, width] int32; lens: [batch] int32. window <= 0: no sliding window;
 * softcap <= 0: none. k_scales, v_scales: an int8 cache's float16 scales,
 * [num_blocks, block_size, KV_HEADS] (read only in a CACHE_INT8 build). Returns 0, or -1 when block_size exceeds MAX_BLOCK (the
 * caller then uses the reference). */
int paged_decode(const act_t* q, const cache_t* k, const cache_t* v, const int32_t* tables,
                 const int32_t* lens, act_t* out, int64_t batch, int64_t q_stride,
                 int64_t block_size, int64_t width, int64_t num_blocks, float scale,
                 int64_t window, float softcap, int num_threads, const uint16_t* k_scales,
                 const uint16_t* v_scales) {
    if (block_size > MAX_BLOCK) return -1;
    const int64_t split = batch < num_threads ? KV_HEADS : 1;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t item = 0; item < batch * split; item++) {
        const int64_t b = item / split, part = item % split;
        const int64_t h0 = part * KV_HEADS / split, h1 = (part + 1) * KV_HEADS / split;
        int64_t len = lens[b] < width * block_size ? lens[b] : width * block_size;
        if (split == 1)  /* constant head bounds: the compiler unrolls every head loop */
            attend(q + b * q_stride, k, v, tables + b * width, len, 0, KV_HEADS,
                   out + b * HEADS * HEAD_DIM, block_size, num_blocks, scale, window, softcap,
                   k_scales, v_scales);
        else
            attend(q + b * q_stride, k, v, tables + b * width, len, h0, h1,
                   out + b * HEADS * HEAD_DIM, block_size, num_blocks, scale, window, softcap,
                   k_scales, v_scales);
    }
    return 0;
}

#ifndef CACHE_INT8  /* an int8 cache's rows and scales are written by the reference */
/* Scatter n new K/V rows (k, v: [n, KV_HEADS, HEAD_DIM], rows *_stride
 * apart) into the cache viewed as [num_slots, KV_HEADS, HEAD_DIM]; a negative
 * slot is padding. Returns -1, writing nothing, when a slot is out of range (the
 * caller then lets the reference raise its error). */
int paged_write(const act_t* k, const act_t* v, int64_t k_stride, int64_t v_stride,
                const int64_t* slots, int64_t n, cache_t* k_cache, cache_t* v_cache,
                int64_t num_slots) {
    for (int64_t i = 0; i < n; i++)
        if (slots[i] >= num_slots) return -1;
    for (int64_t i = 0; i < n; i++) {
        if (slots[i] < 0) continue;
        cache_t* kd = k_cache + slots[i] * ROW;
        cache_t* vd = v_cache + slots[i] * ROW;
        for (int64_t d = 0; d < ROW; d++) {
            kd[d] = FROM_FLOAT(cache_t, TO_FLOAT(k[i * k_stride + d]));
            vd[d] = FROM_FLOAT(cache_t, TO_FLOAT(v[i * v_stride + d]));
        }
    }
    return 0;
}
#endif
