/* bf16 products of 1 to 8 rows on a CPU with AVX512-BF16 (Zen 4 and later,
 * Cooper Lake and later Xeons): one stream's decode step, a speculative
 * verify step, a draft model's passes, a few streams' decode.
 *
 * At a few rows a product is a read of the weights: each weight is used once
 * per row. oneDNN's packed matmul spent ~23 us a call on a 256-wide layer at
 * 5 rows (2-core EPYC, one thread), mostly fixed cost; inductor's GEMM
 * template converts every bf16 weight to float32 before an FMA. Here
 * vdpbf16ps multiplies 32 bf16 pairs per instruction straight from the
 * weights, each weight vector loaded once and used for every row.
 *
 * Layout (few_row_pack): the weight [N][K] row-major becomes blocks of 16
 * outputs, [N/16][K/2][16][2]: for each pair of input features, the 16
 * outputs' two weights side by side (vdpbf16ps's operand order), N padded
 * with zero outputs to a multiple of 16 (K must be even). Row m's
 * feature pair (x[2i], x[2i+1]) is broadcast as one 32-bit lane. Each output
 * sums its products in float32 in input order, the same for every row count:
 * a row's result does not depend on how many rows share the call. Outputs are
 * rounded to bf16 once, as torch's bf16 matmul does.
 *
 * Blocks of outputs are split over OpenMP threads (torch's runtime). */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

void few_row_pack(const uint16_t* w, uint16_t* out, int64_t N, int64_t K) {
    const int64_t pairs = K / 2, blocks = (N + 15) / 16;
    memset(out, 0, (size_t)(blocks * pairs * 32) * sizeof(uint16_t));
    for (int64_t n = 0; n < N; n++)
        for (int64_t k = 0; k < K; k++)
            out[((n / 16 * pairs + k / 2) * 16 + n % 16) * 2 + k % 2] = w[n * K + k];
}

/* Rows 0..M-1, output blocks b0..b0+NB-1: NB * M accumulators in registers,
 * NB weight vectors loaded per feature pair. */
#define TILE(M, NB)                                                                              \
    static void tile_##M##_##NB(const uint16_t* x, int64_t ldx, const uint16_t* wp, uint16_t* out, \
                                int64_t N, int64_t pairs, int64_t b0) {                          \
        __m512 acc[M][NB];                                                                       \
        for (int m = 0; m < M; m++)                                                              \
            for (int b = 0; b < NB; b++) acc[m][b] = _mm512_setzero_ps();                        \
        const uint16_t* w = wp + b0 * pairs * 32;                                                \
        for (int64_t i = 0; i < pairs; i++) {                                                    \
            __m512bh wv[NB];                                                                     \
            for (int b = 0; b < NB; b++) wv[b] = (__m512bh)_mm512_loadu_si512(w + (b * pairs + i) * 32); \
            for (int m = 0; m < M; m++) {                                                        \
                int32_t pair;                                                                    \
                memcpy(&pair, x + m * ldx + 2 * i, sizeof pair);                                 \
                const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);                          \
                for (int b = 0; b < NB; b++) acc[m][b] = _mm512_dpbf16_ps(acc[m][b], xv, wv[b]); \
            }                                                                                    \
        }                                                                                        \
        for (int b = 0; b < NB; b++) {                                                           \
            const int64_t n0 = (b0 + b) * 16, left = N - n0;                                     \
            const __mmask16 keep = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1); \
            for (int m = 0; m < M; m++)                                                          \
                _mm256_mask_storeu_epi16(out + m * N + n0, keep, (__m256i)_mm512_cvtneps_pbh(acc[m][b])); \
        }                                                                                        \
    }

/* Four blocks side by side up to 4 rows (16 accumulators), two above: enough
 * independent sums to hide vdpbf16ps's latency, within 32 registers. */
TILE(1, 4) TILE(2, 4) TILE(3, 4) TILE(4, 4) TILE(5, 2) TILE(6, 2) TILE(7, 2) TILE(8, 2)
TILE(1, 1) TILE(2, 1) TILE(3, 1) TILE(4, 1) TILE(5, 1) TILE(6, 1) TILE(7, 1) TILE(8, 1)

typedef void (*tile_fn)(const uint16_t*, int64_t, const uint16_t*, uint16_t*, int64_t, int64_t, int64_t);
static const tile_fn WIDE[9] = {0, tile_1_4, tile_2_4, tile_3_4, tile_4_4, tile_5_2, tile_6_2, tile_7_2, tile_8_2};
static const tile_fn SINGLE[9] = {0, tile_1_1, tile_2_1, tile_3_1, tile_4_1, tile_5_1, tile_6_1, tile_7_1, tile_8_1};

/* out [M][N] bf16 = x [M][K] (row stride ldx) times the packed weight;
 * 1 <= M <= 8, K even. */
void few_row_gemm(const uint16_t* x, int64_t ldx, const uint16_t* wp, uint16_t* out, int64_t M, int64_t N,
                  int64_t K, int threads) {
    const int64_t pairs = K / 2, blocks = (N + 15) / 16;
    const int nb = M <= 4 ? 4 : 2;
    const int64_t wide = blocks / nb;
    const tile_fn tile = WIDE[M], single = SINGLE[M];
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && wide >= 4)
    for (int64_t t = 0; t < wide; t++) tile(x, ldx, wp, out, N, pairs, t * nb);
    for (int64_t b = wide * nb; b < blocks; b++) single(x, ldx, wp, out, N, pairs, b);
}
