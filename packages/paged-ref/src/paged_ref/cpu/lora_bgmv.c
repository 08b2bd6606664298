/* LoRA deltas of a step's decode rows for a CPU (BGMV): each row reads only
 * its own adapter's A and B, in place, with no gathered copy of them.
 *
 * The same result as paged_ref.lora_ops.add_lora (the definition; the tests
 * compare the two): for a row t of slot s and each stacked projection p,
 *     out[t, off_p : off_p + n_p] += B_p[s] @ (A_p[s] @ x[t])
 * with the shrink rounded to act_t as torch's GEMM rounds it, the sum in
 * float32 and rounded once. Built by lora_bgmv.py with act_t (x, out and
 * the tables: uint16_t holding bf16 bits with ACT_BF16, _Float16 or float)
 * as a constant.
 *
 * Tables: a [slots, stacked * rank, in] (lora_ops' lora_a) and e, the
 * expand matrix [slots * stacked * rank, out] (lora_ops._expand_matrix: row
 * (s, p, r) is B_p[s][:, r] in projection p's columns), so a rank row
 * expands as contiguous vectors over its projection's columns.
 *
 * Work items are chunks of up to GROUP rows of one slot, found once per step
 * by the caller (rows sorted by slot, base rows left out): within a chunk
 * each loaded vector of A and of e serves every row. The loops are written
 * in GCC vector extensions of 16 floats (one AVX-512 register; two AVX2
 * ones elsewhere) with register-held accumulators: plain loops left GCC
 * one dependent accumulator per dot product. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define GROUP 4   /* the most rows of one slot in a chunk (lora_bgmv.py's) */
#define LANES 16  /* floats in a vector */
#define DOTS 4    /* rank rows of A dotted at once (GROUP x DOTS accumulators) */
#if GROUP != 4
#error lora_bgmv's switch on a chunk's rows has GROUP cases
#endif
#define COLS 2    /* vectors of output columns expanded at once (GROUP x COLS) */

typedef float vf __attribute__((vector_size(LANES * 4)));
typedef uint32_t vu __attribute__((vector_size(LANES * 4)));

#if defined(ACT_BF16)
typedef uint16_t vh __attribute__((vector_size(LANES * 2)));
#define LOAD(v) bf16_to_float(v)
#define STORE(f) bf16_from_float(f)
static inline vf vload(const act_t *p) {
    vh h;
    memcpy(&h, p, sizeof h);
    const vu u = __builtin_convertvector(h, vu) << 16;
    vf f;
    memcpy(&f, &u, sizeof f);
    return f;
}
static inline void vstore(act_t *p, vf f) {  /* bf16_from_float, lane by lane */
    vu u;
    memcpy(&u, &f, sizeof u);
    const vu nan = (vu)((u & 0x7fffffffu) > 0x7f800000u);
    const vu rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const vh h = __builtin_convertvector((nan & ((u >> 16) | 0x40u)) | (~nan & rounded), vh);
    memcpy(p, &h, sizeof h);
}
#else
typedef act_t va __attribute__((vector_size(LANES * sizeof(act_t))));
#define LOAD(v) ((float)(v))
#define STORE(f) ((act_t)(f))
static inline vf vload(const act_t *p) {
    va v;
    memcpy(&v, p, sizeof v);
    return __builtin_convertvector(v, vf);
}
static inline void vstore(act_t *p, vf f) {
    const va v = __builtin_convertvector(f, va);
    memcpy(p, &v, sizeof v);
}
#endif

static inline float hsum(vf v) {
    float s = 0.f;
    for (int l = 0; l < LANES; l++) s += v[l];
    return s;
}

#define INLINE static inline __attribute__((always_inline))

/* The end of a shrink over rank rows j0..j0 + DOTS - 1 (both layouts): each
 * accumulator's lanes summed, plus the input features past the last whole
 * vector, rounded to act_t. */
INLINE void shrink_store(vf acc[GROUP][DOTS], const act_t *as, const act_t *const *xs, const int n,
                         int64_t sr, int64_t in, int64_t vec_end, int64_t j0, float *h) {
    for (int g = 0; g < n; g++)
        for (int d = 0; d < DOTS; d++) {
            float s = hsum(acc[g][d]);
            const act_t *aj = as + (j0 + d) * in;
            for (int64_t i = vec_end; i < in; i++) s += LOAD(aj[i]) * LOAD(xs[g][i]);
            h[g * sr + j0 + d] = LOAD(STORE(s));
        }
}

/* The rank rows from j0 on that do not fill DOTS (a rank that is not a
 * multiple of it): one scalar dot each. */
INLINE void shrink_rest(const act_t *as, const act_t *const *xs, const int n, int64_t sr, int64_t in,
                        int64_t j0, float *h) {
    for (; j0 < sr; j0++)
        for (int g = 0; g < n; g++) {
            float s = 0.f;
            for (int64_t i = 0; i < in; i++) s += LOAD(as[j0 * in + i]) * LOAD(xs[g][i]);
            h[g * sr + j0] = LOAD(STORE(s));
        }
}

#if defined(ACT_BF16)
/* bf16 in pairs: 16 pairs of neighbours (2k, 2k + 1) load as one vector of
 * uint32, the even element's float being bits << 16 and the odd one's
 * bits & 0xffff0000: one operation a vector, no widening. With AVX512-BF16
 * a pair product is one instruction (vdpbf16ps: both products, in float32,
 * summed into the accumulator). */
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif
static inline vu pload(const uint16_t *p) {
    vu u;
    memcpy(&u, p, sizeof u);
    return u;
}
static inline vf even(vu u) {
    const vu b = u << 16;
    vf f;
    memcpy(&f, &b, sizeof f);
    return f;
}
static inline vf odd(vu u) {
    const vu b = u & 0xffff0000u;
    vf f;
    memcpy(&f, &b, sizeof f);
    return f;
}
static inline vf dot2(vf acc, vu a, vu b) {  /* acc + a.even * b.even + a.odd * b.odd */
#if defined(__AVX512BF16__)
    return (vf)_mm512_dpbf16_ps((__m512)acc, (__m512bh)a, (__m512bh)b);
#else
    return acc + even(a) * even(b) + odd(a) * odd(b);
#endif
}
#define PAIR_LANES (2 * LANES)  /* bf16 elements in a vector of pairs */

/* shrink for bf16: as below, a pair of input features a lane. */
INLINE void shrink(const act_t *as, const act_t *const *xs, const int n, int64_t sr, int64_t in, float *h) {
    const int64_t vec_end = in - in % PAIR_LANES;
    int64_t j0 = 0;
    for (; j0 + DOTS <= sr; j0 += DOTS) {
        vf acc[GROUP][DOTS] = {{{0}}};
        for (int64_t i = 0; i < vec_end; i += PAIR_LANES) {
            vu av[DOTS];
            for (int d = 0; d < DOTS; d++) av[d] = pload(as + (j0 + d) * in + i);
            for (int g = 0; g < n; g++) {
                const vu xv = pload(xs[g] + i);
                for (int d = 0; d < DOTS; d++) acc[g][d] = dot2(acc[g][d], av[d], xv);
            }
        }
        shrink_store(acc, as, xs, n, sr, in, vec_end, j0, h);
    }
    shrink_rest(as, xs, n, sr, in, j0, h);
}

/* expand for bf16 from the pair layout ep [rank / 2, out, 2] of one slot
 * (lora_b's rank pairs side by side per output column): outs[g][lo:hi] +=
 * sum_r h[g * sr + r] * B[:, r]. rank is even. */
INLINE void expand(const act_t *ep, int64_t out_features, const float *h, int64_t sr, int64_t rank,
                   act_t *const *outs, const int n, int64_t lo, int64_t hi) {
    int64_t o = lo;
    for (; o + COLS * LANES <= hi; o += COLS * LANES) {
        vf acc[GROUP][COLS] = {{{0}}};
        for (int64_t r = 0; r < rank; r += 2) {
            const act_t *er = ep + (r * out_features + 2 * o);  /* pair row r / 2, column o */
            vu ev[COLS];
            for (int c = 0; c < COLS; c++) ev[c] = pload(er + c * PAIR_LANES);
            for (int g = 0; g < n; g++) {
                const uint32_t hp = (uint32_t)STORE(h[g * sr + r]) | (uint32_t)STORE(h[g * sr + r + 1]) << 16;
                const vu hv = (vu){0} + hp;
                for (int c = 0; c < COLS; c++) acc[g][c] = dot2(acc[g][c], ev[c], hv);
            }
        }
        for (int g = 0; g < n; g++)
            for (int c = 0; c < COLS; c++) {
                act_t *p = outs[g] + o + c * LANES;
                vstore(p, vload(p) + acc[g][c]);
            }
    }
    for (; o < hi; o++)
        for (int g = 0; g < n; g++) {
            float s = 0.f;
            for (int64_t r = 0; r < rank; r++)
                s += h[g * sr + r] * LOAD(ep[(r / 2) * 2 * out_features + 2 * o + r % 2]);
            outs[g][o] = STORE(LOAD(outs[g][o]) + s);
        }
}

/* One chunk of n rows of one slot: es is the slot's pair table [rank / 2, out, 2]. */
INLINE void chunk(const act_t *as, const act_t *es, const act_t *const *xs, act_t *const *outs, const int n,
                  int64_t in, int64_t out_features, int64_t stacked, int64_t rank, const int64_t *offsets,
                  float *h) {
    const int64_t sr = stacked * rank;
    shrink(as, xs, n, sr, in, h);
    for (int64_t p = 0; p < stacked; p++)
        expand(es, out_features, h + p * rank, sr, rank, outs, n, offsets[p], offsets[p + 1]);
}
#define E_SLOT(slot) ((slot) * rank * out_features)  /* the pair table: [slots, rank / 2, out, 2] */
#else
/* h[g * sr + j] = A[j] . x[g] for the chunk's n rows (a constant where it
 * is inlined, so the accumulators stay in registers), rounded to act_t. */
INLINE void shrink(const act_t *as, const act_t *const *xs, const int n, int64_t sr, int64_t in, float *h) {
    const int64_t vec_end = in - in % LANES;
    int64_t j0 = 0;
    for (; j0 + DOTS <= sr; j0 += DOTS) {
        vf acc[GROUP][DOTS] = {{{0}}};
        for (int64_t i = 0; i < vec_end; i += LANES) {
            vf av[DOTS];
            for (int d = 0; d < DOTS; d++) av[d] = vload(as + (j0 + d) * in + i);
            for (int g = 0; g < n; g++) {
                const vf xv = vload(xs[g] + i);
                for (int d = 0; d < DOTS; d++) acc[g][d] += av[d] * xv;
            }
        }
        shrink_store(acc, as, xs, n, sr, in, vec_end, j0, h);
    }
    shrink_rest(as, xs, n, sr, in, j0, h);
}

/* outs[g][lo:hi] += sum_r h[g * sr + r] * e_rows[r][lo:hi] over rank rows. */
INLINE void expand(const act_t *e0, int64_t e_stride, const float *h, int64_t sr, int64_t rank,
                   act_t *const *outs, const int n, int64_t lo, int64_t hi) {
    int64_t o = lo;
    for (; o + COLS * LANES <= hi; o += COLS * LANES) {
        vf acc[GROUP][COLS] = {{{0}}};
        for (int64_t r = 0; r < rank; r++) {
            const act_t *er = e0 + r * e_stride + o;
            vf ev[COLS];
            for (int c = 0; c < COLS; c++) ev[c] = vload(er + c * LANES);
            for (int g = 0; g < n; g++) {
                const float hv = h[g * sr + r];
                for (int c = 0; c < COLS; c++) acc[g][c] += hv * ev[c];
            }
        }
        for (int g = 0; g < n; g++)
            for (int c = 0; c < COLS; c++) {
                act_t *p = outs[g] + o + c * LANES;
                vstore(p, vload(p) + acc[g][c]);
            }
    }
    for (; o < hi; o++)
        for (int g = 0; g < n; g++) {
            float s = 0.f;
            for (int64_t r = 0; r < rank; r++) s += h[g * sr + r] * LOAD(e0[r * e_stride + o]);
            outs[g][o] = STORE(LOAD(outs[g][o]) + s);
        }
}

/* One chunk of n rows of one slot. */
INLINE void chunk(const act_t *as, const act_t *es, const act_t *const *xs, act_t *const *outs, const int n,
                  int64_t in, int64_t out_features, int64_t stacked, int64_t rank, const int64_t *offsets,
                  float *h) {
    const int64_t sr = stacked * rank;
    shrink(as, xs, n, sr, in, h);
    for (int64_t p = 0; p < stacked; p++)
        expand(es + p * rank * out_features, out_features, h + p * rank, sr, rank, outs, n, offsets[p],
               offsets[p + 1]);
}

#define E_SLOT(slot) ((slot) * sr * out_features)  /* the expand matrix's rows of the slot */
#endif

/* Rows rows[chunks[c] : chunks[c + 1]] (at most GROUP) share slot
 * row_slots[chunks[c]]. offsets[stacked + 1]: each projection's first output
 * column. Returns 0, or 1 when a thread's scratch could not be allocated
 * (nothing is added for its chunks; the caller raises). */
int lora_bgmv(const act_t *x, int64_t x_stride, act_t *out, int64_t out_stride,
              const act_t *a, const act_t *e, int64_t in, int64_t out_features,
              int64_t stacked, int64_t rank, const int64_t *offsets,
              const int32_t *rows, const int32_t *row_slots, const int32_t *chunks,
              int64_t num_chunks) {
    const int64_t sr = stacked * rank;
    int failed = 0;
#pragma omp parallel reduction(|: failed)
    {
        float *h = malloc(sizeof(float) * GROUP * sr);
        if (h == NULL) failed = 1;
#pragma omp for schedule(dynamic)
        for (int64_t c = 0; c < num_chunks; c++) {
            if (h == NULL) continue;
            const int32_t begin = chunks[c];
            const int n = chunks[c + 1] - begin;
            const int64_t slot = row_slots[begin];
            const act_t *xs[GROUP];
            act_t *outs[GROUP];
            for (int g = 0; g < n; g++) {
                xs[g] = x + (int64_t)rows[begin + g] * x_stride;
                outs[g] = out + (int64_t)rows[begin + g] * out_stride;
            }
            const act_t *as = a + slot * sr * in, *es = e + E_SLOT(slot);
            switch (n) {  /* GROUP cases, each with its constant row count */
                case 1: chunk(as, es, xs, outs, 1, in, out_features, stacked, rank, offsets, h); break;
                case 2: chunk(as, es, xs, outs, 2, in, out_features, stacked, rank, offsets, h); break;
                case 3: chunk(as, es, xs, outs, 3, in, out_features, stacked, rank, offsets, h); break;
                default: chunk(as, es, xs, outs, 4, in, out_features, stacked, rank, offsets, h); break;
            }
        }
        free(h);
    }
    return failed;
}
