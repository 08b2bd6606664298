/* One-row products with int4 and int8 weights on a CPU with AVX512 VNNI and
 * VBMI (Ice Lake and later Xeons, Zen 4): what a single stream's decode
 * step runs in every projection.
 *
 * The activations are quantized to int8 on the fly, per block of input
 * features (absmax / 127, round to nearest even), and multiplied with
 * vpdpbusd (64 byte products per instruction), as vLLM's CPU path for
 * AWQ/GPTQ does (IPEX weight-only quantization, lowp_mode INT8, per-token
 * per-input-channel-block activation scales). One step of a 2-core Xeon
 * issues about one 512-bit instruction per nanosecond: with bf16 dot
 * products (vdpbf16ps, 32 products each, weights unpacked to bf16 first) an
 * int4 weight took three times the instructions of a bf16 one and the
 * product ran below the bf16 one's bytes per second; here int4 takes 10
 * instructions per 256 weights and int8 two per 64.
 *
 * Both read the buffers QuantizedLinear keeps for aten's packed kernels (no
 * second copy of the weights); the output is rounded to bf16 once.
 *
 * int4 (aten._weight_int4pack_mm_for_cpu's AVX512 layout): columns in blocks
 * of 64; for each input feature k a block holds 32 bytes, byte d (d < 16)
 * with column d in its low nibble and column d+32 in its high one, byte 16+d
 * with columns d+16 and d+48. Codes are unsigned (q + 8); scales_zeros is
 * [K/G][N][2] bf16, (scale, zero): w = (code - 8) * scale + zero. Activation
 * blocks are the weight's groups. Rows k..k+3 of a block are 128 adjacent
 * bytes; one vpermt2b gathers each column's four bytes into a 32-bit lane.
 * Per group, with D = sum code * xq and Q = sum xq (exact integers):
 *   sum_k x_k w_k = scale * xs * (D - 8 Q) + zero * xs * Q.
 * High nibbles are masked in place, as 16 * code: D is 16 times larger there.
 *
 * int8 (aten._weight_int8pack_mm's): row-major [N][K] int8 codes, one bf16
 * scale per output, activation blocks of 128. vpdpbusd takes one unsigned
 * operand: the codes XOR 0x80 are code + 128, so per block
 *   sum_k xq_k code_k = sum_k xq_k (code_k + 128) - 128 Q.
 *
 * Output blocks are split over OpenMP threads (torch's runtime: no second pool). */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "bf16.h"

/* 16 floats to bf16 as bf16_from_float does (AVX512F only: no AVX512-BF16 needed). */
static inline __m256i bf16_from_floats(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i even = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), even)), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(r);
}

/* x (K bf16) as int8 per block of B: xq = round(x / xs), xs = absmax / 127,
 * qsum = sum of the block's xq. A block holding inf or NaN gets a NaN scale
 * (codes 0), so the outputs are NaN, as a float product's would be. */
static void quantize_blocks(const uint16_t* x, int64_t K, int64_t B, int8_t* xq, float* xs, int32_t* qsum) {
    for (int64_t b = 0; b < K / B; b++) {
        float amax = 0.0f;
        int finite = 1;
        for (int64_t k = b * B; k < (b + 1) * B; k++) {
            const float v = fabsf(bf16_to_float(x[k]));
            finite &= v <= 3.4028235e38f;  /* false for inf and NaN */
            amax = fmaxf(amax, v);
        }
        const float scale = finite ? amax / 127.0f : NAN, inv = finite && amax > 0.0f ? 127.0f / amax : 0.0f;
        int32_t sum = 0;
        for (int64_t k = b * B; k < (b + 1) * B; k++) {
            const int32_t q = finite ? (int32_t)nearbyintf(bf16_to_float(x[k]) * inv) : 0;
            xq[k] = (int8_t)(q > 127 ? 127 : q < -127 ? -127 : q);
            sum += xq[k];
        }
        xs[b] = scale;
        qsum[b] = sum;
    }
}

#ifndef STREAMS
#define STREAMS 4  /* int4 column blocks read side by side: DRAM streams in flight per thread */
#endif

/* Columns [64 b, 64 (b + S)) of y. */
static inline __attribute__((always_inline)) void int4_blocks(
    const int8_t* xq, const float* xs, const int32_t* qsum, const uint8_t* w, const uint16_t* sz,
    uint16_t* y, int64_t N, int64_t K, int64_t G, int64_t b, const int S) {
    const __m512i low = _mm512_set1_epi8(0x0F), hi_half = _mm512_set1_epi32((int)0xFFFF0000u);
    /* lane d's byte j takes byte d of row k + j (rows k, k+1 in one register,
     * k+2, k+3 in the other): columns d and d + 32; or 16 + d: d + 16, d + 48 */
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i pick_lo = _mm512_add_epi32(_mm512_mullo_epi32(lane, _mm512_set1_epi32(0x01010101)), _mm512_set1_epi32(0x60402000));
    const __m512i pick_up = _mm512_add_epi32(pick_lo, _mm512_set1_epi32(0x10101010));
    float out[STREAMS][64] __attribute__((aligned(64))) = {{0}};
    for (int64_t g = 0; g < K / G; g++) {
        __m512i acc[STREAMS][4];
        for (int s = 0; s < S; s++)
            for (int j = 0; j < 4; j++) acc[s][j] = _mm512_setzero_si512();
        for (int64_t k = g * G; k < (g + 1) * G; k += 4) {
            const __m512i xk = _mm512_set1_epi32(*(const int32_t*)(xq + k));
            for (int s = 0; s < S; s++) {
                const uint8_t* r = w + ((b + s) * K + k) * 32;
                _mm_prefetch((const char*)(r + 1024), _MM_HINT_T0);
                const __m512i rows01 = _mm512_loadu_si512(r), rows23 = _mm512_loadu_si512(r + 64);
                const __m512i lo = _mm512_permutex2var_epi8(rows01, pick_lo, rows23);
                const __m512i up = _mm512_permutex2var_epi8(rows01, pick_up, rows23);
                /* high nibbles are multiplied in place, as 16 * code (a shift saved) */
                acc[s][0] = _mm512_dpbusd_epi32(acc[s][0], _mm512_and_si512(lo, low), xk);
                acc[s][2] = _mm512_dpbusd_epi32(acc[s][2], _mm512_andnot_si512(low, lo), xk);
                acc[s][1] = _mm512_dpbusd_epi32(acc[s][1], _mm512_and_si512(up, low), xk);
                acc[s][3] = _mm512_dpbusd_epi32(acc[s][3], _mm512_andnot_si512(low, up), xk);
            }
        }
        const __m512i q8 = _mm512_set1_epi32(8 * qsum[g]), q128 = _mm512_set1_epi32(128 * qsum[g]);
        const __m512 sum_x = _mm512_set1_ps(xs[g] * (float)qsum[g]);
        const __m512 scale_x[4] = {_mm512_set1_ps(xs[g]), _mm512_set1_ps(xs[g]),
                                   _mm512_set1_ps(xs[g] / 16.0f), _mm512_set1_ps(xs[g] / 16.0f)};
        for (int s = 0; s < S; s++) {
            const uint32_t* pairs = (const uint32_t*)(sz + (g * N + (b + s) * 64) * 2);  /* (scale, zero) per column */
            for (int j = 0; j < 4; j++) {
                const __m512i p = _mm512_loadu_si512(pairs + j * 16);
                const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(p, 16));
                const __m512 zero = _mm512_castsi512_ps(_mm512_and_si512(p, hi_half));
                const __m512i centred = _mm512_sub_epi32(acc[s][j], j < 2 ? q8 : q128);  /* code - 8, times 16 for j >= 2 */
                const __m512 dot = _mm512_mul_ps(_mm512_cvtepi32_ps(centred), scale_x[j]);
                const __m512 o = _mm512_load_ps(out[s] + j * 16);
                _mm512_store_ps(out[s] + j * 16, _mm512_fmadd_ps(scale, dot, _mm512_fmadd_ps(zero, sum_x, o)));
            }
        }
    }
    for (int s = 0; s < S; s++)
        for (int j = 0; j < 4; j++)
            _mm256_storeu_si256((__m256i*)(y + (b + s) * 64 + j * 16), bf16_from_floats(_mm512_load_ps(out[s] + j * 16)));
}

/* x: K bf16; w: [N/64][K][32] bytes; sz: [K/G][N][2] bf16; y: N bf16.
 * Needs N % 64 == 0, K % G == 0, G % 4 == 0. */
void int4_gemv(const uint16_t* x, const uint8_t* w, const uint16_t* sz, uint16_t* y,
               int64_t N, int64_t K, int64_t G, int num_threads) {
    int8_t xq[K] __attribute__((aligned(64)));
    float xs[K / G];
    int32_t qsum[K / G];
    quantize_blocks(x, K, G, xq, xs, qsum);
    const int64_t blocks = N / 64, items = blocks / STREAMS;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1)
    for (int64_t i = 0; i < items; i++)
        int4_blocks(xq, xs, qsum, w, sz, y, N, K, G, i * STREAMS, STREAMS);
    for (int64_t b = items * STREAMS; b < blocks; b++)
        int4_blocks(xq, xs, qsum, w, sz, y, N, K, G, b, 1);
}

#define INT8_BLOCK 128  /* input features per activation scale */
#ifndef ROWS8
#define ROWS8 4  /* int8 rows per work item, read side by side */
#endif

/* x: K bf16; w: [N][K] int8; scales: N bf16; y: N bf16. Needs K % 128 == 0. */
void int8_gemv(const uint16_t* x, const int8_t* w, const uint16_t* scales, uint16_t* y,
               int64_t N, int64_t K, int num_threads) {
    int8_t xq[K] __attribute__((aligned(64)));
    float xs[K / INT8_BLOCK];
    int32_t qsum[K / INT8_BLOCK];
    quantize_blocks(x, K, INT8_BLOCK, xq, xs, qsum);
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const int64_t items = (N + ROWS8 - 1) / ROWS8;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1)
    for (int64_t i = 0; i < items; i++) {
        const int64_t n0 = i * ROWS8, rows = n0 + ROWS8 <= N ? ROWS8 : N - n0;
        const int8_t* r = w + n0 * K;
        __m512 out[ROWS8];
        for (int j = 0; j < ROWS8; j++) out[j] = _mm512_setzero_ps();
        for (int64_t blk = 0; blk < K / INT8_BLOCK; blk++) {
            const int64_t k = blk * INT8_BLOCK;
            const __m512i x0 = _mm512_load_si512(xq + k), x1 = _mm512_load_si512(xq + k + 64);
            const __m512 scale_x = _mm512_set1_ps(xs[blk]);
            for (int j = 0; j < ROWS8; j++) {
                if (j >= rows) break;
                const int8_t* row = r + j * K + k;
                _mm_prefetch((const char*)(row + ROWS8 * K), _MM_HINT_T0);
                _mm_prefetch((const char*)(row + ROWS8 * K + 64), _MM_HINT_T0);
                __m512i acc = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_xor_si512(_mm512_loadu_si512(row), flip), x0);
                acc = _mm512_dpbusd_epi32(acc, _mm512_xor_si512(_mm512_loadu_si512(row + 64), flip), x1);
                out[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), scale_x, out[j]);
            }
            for (int j = 0; j < rows; j++)  /* the 128 * Q correction, once per row and block */
                out[j] = _mm512_mask_sub_ps(out[j], 1, out[j], _mm512_set1_ps(128.0f * (float)qsum[blk] * xs[blk]));
        }
        for (int j = 0; j < rows; j++)
            y[n0 + j] = bf16_from_float(_mm512_reduce_add_ps(out[j]) * bf16_to_float(scales[n0 + j]));
    }
}
