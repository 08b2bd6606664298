/* One-row products with weight-only int4 and int8 weights, for a CPU with
 * AVX512-BF16: what a single stream's decode step runs in every projection.
 *
 * Both read the buffers QuantizedLinear already keeps for aten's packed
 * kernels (no second copy of the weights), and compute what those kernels
 * compute: bf16 activations, weights dequantized exactly, products summed in
 * float32, one bf16 rounding of each output.
 *
 * int4 (aten._weight_int4pack_mm_for_cpu's AVX512 layout): columns in blocks
 * of 64; for each input feature k a block holds 32 bytes, byte d (d < 16)
 * with column d in its low nibble and column d+32 in its high one, byte 16+d
 * with columns d+16 and d+48. Codes are unsigned (q + 8); scales_zeros is
 * [K/G][N][2] bf16, (scale, zero): w = (code - 8) * scale + zero.
 * The two rows k, k+1 of a block are 64 adjacent bytes; a code c becomes the
 * bf16 number 128 + c by OR-ing it into 0x4300 (exact: bf16 steps by 1
 * between 128 and 256), so each 32-bit lane holds a column's (k, k+1) pair
 * and one vdpbf16ps multiplies it by the activations' pair. Per group:
 *   sum_k x_k w_k = scale * (sum_k x_k (128 + c_k) - 136 * sum_k x_k) + zero * sum_k x_k.
 *
 * int8 (aten._weight_int8pack_mm's): row-major [N][K] int8 codes and one bf16
 * scale per output; each row's dot product in float32 (codes converted
 * exactly), four rows at a time so each activation vector is loaded once.
 *
 * Output blocks are split over OpenMP threads (torch's runtime: no second pool). */
#include <immintrin.h>
#include <stdint.h>

static inline float bf16_to_float(uint16_t x) {
    union { uint32_t u; float f; } bits = { .u = (uint32_t)x << 16 };
    return bits.f;
}

static inline uint16_t bf16_from_float(float f) {  /* round to nearest even, as torch */
    union { float f; uint32_t u; } bits = { .f = f };
    if ((bits.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits.u >> 16) | 0x40);  /* NaN */
    return (uint16_t)((bits.u + 0x7fffu + ((bits.u >> 16) & 1u)) >> 16);
}

static inline __m256i bf16_from_floats(__m512 v) {  /* 16 floats to bf16, nearest even */
    return (__m256i)_mm512_cvtneps_pbh(v);
}


#ifndef STREAMS
#define STREAMS 4  /* column blocks read in lockstep: DRAM streams in flight per thread */
#endif
#ifndef PREFETCH
#define PREFETCH 8  /* row pairs ahead */
#endif

/* Columns [64 b, 64 (b + S)) of y: S blocks read side by side. */
static inline __attribute__((always_inline)) void int4_blocks(
    const uint32_t* xpair, const float* xsum, const uint8_t* w, const uint16_t* sz, uint16_t* y,
    int64_t N, int64_t K, int64_t G, int64_t b, const int S) {
    const __m512i nibble = _mm512_set1_epi32(0x000F000F), bias = _mm512_set1_epi32(0x43004300);
    const __m512i hi = _mm512_set1_epi32((int)0xFFFF0000u);
    float out[STREAMS][64] __attribute__((aligned(64))) = {{0}};
    for (int64_t g = 0; g < K / G; g++) {
        __m512 acc[STREAMS][4];
        for (int s = 0; s < S; s++)
            for (int j = 0; j < 4; j++) acc[s][j] = _mm512_setzero_ps();
        for (int64_t k = g * G; k < (g + 1) * G; k += 2) {
            const __m512bh xk = (__m512bh)_mm512_set1_epi32((int)xpair[k / 2]);
            for (int s = 0; s < S; s++) {
                const uint8_t* r = w + ((b + s) * K + k) * 32;
                _mm_prefetch((const char*)(r + PREFETCH * 64), _MM_HINT_T0);
                /* lane d: row k's byte | row k+1's byte << 16 */
                __m512i lo = _mm512_or_si512(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)r)),
                                             _mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(r + 32))), 16));
                __m512i up = _mm512_or_si512(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(r + 16))),
                                             _mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(r + 48))), 16));
                /* 0xEA: (a & b) | c */
                acc[s][0] = _mm512_dpbf16_ps(acc[s][0], (__m512bh)_mm512_ternarylogic_epi32(lo, nibble, bias, 0xEA), xk);
                acc[s][2] = _mm512_dpbf16_ps(acc[s][2], (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi32(lo, 4), nibble, bias, 0xEA), xk);
                acc[s][1] = _mm512_dpbf16_ps(acc[s][1], (__m512bh)_mm512_ternarylogic_epi32(up, nibble, bias, 0xEA), xk);
                acc[s][3] = _mm512_dpbf16_ps(acc[s][3], (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi32(up, 4), nibble, bias, 0xEA), xk);
            }
        }
        const __m512 sx = _mm512_set1_ps(xsum[g]), offset = _mm512_set1_ps(136.0f * xsum[g]);
        for (int s = 0; s < S; s++) {
            const uint32_t* pairs = (const uint32_t*)(sz + (g * N + (b + s) * 64) * 2);  /* (scale, zero) per column */
            for (int j = 0; j < 4; j++) {
                __m512i p = _mm512_loadu_si512(pairs + j * 16);
                __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(p, 16));
                __m512 zero = _mm512_castsi512_ps(_mm512_and_si512(p, hi));
                __m512 o = _mm512_load_ps(out[s] + j * 16);
                _mm512_store_ps(out[s] + j * 16, _mm512_fmadd_ps(scale, _mm512_sub_ps(acc[s][j], offset), _mm512_fmadd_ps(zero, sx, o)));
            }
        }
    }
    for (int s = 0; s < S; s++)
        for (int j = 0; j < 4; j++)
            _mm256_storeu_si256((__m256i*)(y + (b + s) * 64 + j * 16), bf16_from_floats(_mm512_load_ps(out[s] + j * 16)));
}

/* x: K bf16; w: [N/64][K][32] bytes; sz: [K/G][N][2] bf16; y: N bf16.
 * Needs N % 64 == 0, K % G == 0, G even. */
void int4_gemv(const uint16_t* x, const uint8_t* w, const uint16_t* sz, uint16_t* y,
               int64_t N, int64_t K, int64_t G, int num_threads) {
    const int64_t groups = K / G, blocks = N / 64;
    float xsum[groups];  /* sum of each group's activations (as bf16 values, in float) */
    for (int64_t g = 0; g < groups; g++) {
        float s = 0.0f;
        for (int64_t k = g * G; k < (g + 1) * G; k++) s += bf16_to_float(x[k]);
        xsum[g] = s;
    }
    const uint32_t* xpair = (const uint32_t*)x;  /* (x_k, x_k+1) in one lane */
    const int64_t items = blocks / STREAMS;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t i = 0; i < items; i++)
        int4_blocks(xpair, xsum, w, sz, y, N, K, G, i * STREAMS, STREAMS);
    for (int64_t b = items * STREAMS; b < blocks; b++)
        int4_blocks(xpair, xsum, w, sz, y, N, K, G, b, 1);
}

#ifndef ROWS8
#define ROWS8 8  /* int8 rows per work item, read side by side */
#endif

/* x: K bf16; w: [N][K] int8; scales: N bf16; y: N bf16. Needs K % 16 == 0. */
void int8_gemv(const uint16_t* x, const int8_t* w, const uint16_t* scales, uint16_t* y,
               int64_t N, int64_t K, int num_threads) {
    float xf[K] __attribute__((aligned(64)));
    for (int64_t k = 0; k < K; k++) xf[k] = bf16_to_float(x[k]);
    const int64_t items = N / ROWS8;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t i = 0; i <= items; i++) {
        const int64_t n0 = i * ROWS8, rows = i < items ? ROWS8 : N - n0;  /* the last item: the rest */
        const int8_t* r = w + n0 * K;
        __m512 acc[ROWS8];
        for (int j = 0; j < ROWS8; j++) acc[j] = _mm512_setzero_ps();
        if (rows == ROWS8) {
            for (int64_t k = 0; k < K; k += 16) {
                const __m512 xv = _mm512_load_ps(xf + k);
                for (int j = 0; j < ROWS8; j++) {
                    _mm_prefetch((const char*)(r + (j + ROWS8) * K + k), _MM_HINT_T0);
                    __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(r + j * K + k))));
                    acc[j] = _mm512_fmadd_ps(wv, xv, acc[j]);
                }
            }
        } else {
            for (int j = 0; j < rows; j++)
                for (int64_t k = 0; k < K; k += 16)
                    acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(r + j * K + k)))),
                                             _mm512_load_ps(xf + k), acc[j]);
        }
        for (int j = 0; j < rows; j++)
            y[n0 + j] = bf16_from_float(_mm512_reduce_add_ps(acc[j]) * bf16_to_float(scales[n0 + j]));
    }
}
