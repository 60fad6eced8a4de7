// The LoRA products of a mixed batch on the CPU (lora/layers.py): rows grouped in segments, one adapter per
// segment, each segment's delta added to the base product y that the layer computed for every row:
//
//   shrink  t[i, :R]  = x[row_i] @ A_s^T          A_s  [R, K]  (the adapter's packed shrink matrix)
//   expand  y[row_i] += t[i, :R] @ B_s^T          Bt_s [R, N]  (its packed expand matrix, transposed; the
//                                                               scaling is already in it)
//
// for every position i of the row index whose segment is s. Rows of the base model are in no segment and
// are left as they are; a segment of rank 0 (its adapter does not target this layer) is skipped.
//
// Work is split into groups of up to RG rows of one segment. Shrink: one job per (group, rank row r), a dot
// product over K of the group's rows with A_s[r] (A_s[r] read once for RG rows). Expand: one job per (group,
// block of CB output columns): per vector of columns, the sum over r of t[i, r] * Bt_s[r, cols] for the
// group's rows, Bt_s read once per group. Both loops are OpenMP-parallel; the expand jobs write disjoint
// parts of y (a row is in one segment). float32 throughout, or bfloat16 x, A, Bt and y (bf16 != 0) with
// float32 sums and t, y rounded to nearest even once.
//
// One source for every level: AVX-512F (16 lanes), AVX2 + FMA (8 lanes), or plain C. Returns 0; -1 for
// shapes it does not take; -2 when its scratch memory cannot be allocated.

#include <stdint.h>
#include <stdlib.h>

#include "simd.h"

#define RG 4  /* rows per group */
#define CB 64 /* output columns per expand job */

typedef struct {
    int64_t seg, start, count; /* positions start .. start + count of the row index, all of segment seg */
} group_t;

static inline float load1(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store1(void *p, int64_t i, float v, int bf16) {
    if (bf16)
        ((uint16_t *)p)[i] = f32_to_bf16(v);
    else
        ((float *)p)[i] = v;
}

#ifdef SIMD_WIDTH
static inline __attribute__((always_inline)) vf loadv(const void *p, int64_t i, int bf16) {
    return bf16 ? vf_load_bf16((const uint16_t *)p + i) : vf_load((const float *)p + i);
}
#endif

// t[j * ts] = x[rows[j]] . a_row for the n rows of a group. NOTE: always inlined with constant n and bf16.
static inline __attribute__((always_inline)) void shrink_group(const void *x, const int64_t *rows, int n,
                                                               const void *a_row, int64_t K, int bf16, float *t,
                                                               int64_t ts) {
    float sums[RG] = {0};
    int64_t k = 0;
#ifdef SIMD_WIDTH
    vf acc[RG];
    for (int j = 0; j < n; j++) acc[j] = vf_zero();
    for (; k + SIMD_WIDTH <= K; k += SIMD_WIDTH) {
        const vf av = loadv(a_row, k, bf16);
        for (int j = 0; j < n; j++) acc[j] = vf_fmadd(loadv(x, rows[j] * K + k, bf16), av, acc[j]);
    }
    for (int j = 0; j < n; j++) sums[j] = vf_hsum(acc[j]);
#endif
    for (; k < K; k++) {
        const float a = load1(a_row, k, bf16);
        for (int j = 0; j < n; j++) sums[j] += load1(x, rows[j] * K + k, bf16) * a;
    }
    for (int j = 0; j < n; j++) t[j * ts] = sums[j];
}

// y[rows[j], n0:n1] += t[j, :R] @ Bt[:, n0:n1] for the n rows of a group.
static inline __attribute__((always_inline)) void expand_group(void *y, const int64_t *rows, int n,
                                                               const float *t, int64_t ts, const void *bt,
                                                               int64_t R, int64_t N, int64_t n0, int64_t n1,
                                                               int bf16) {
    int64_t c = n0;
#ifdef SIMD_WIDTH
    for (; c + SIMD_WIDTH <= n1; c += SIMD_WIDTH) {
        vf acc[RG];
        for (int j = 0; j < n; j++) acc[j] = loadv(y, rows[j] * N + c, bf16);
        for (int64_t r = 0; r < R; r++) {
            const vf bv = loadv(bt, r * N + c, bf16);
            for (int j = 0; j < n; j++) acc[j] = vf_fmadd(vf_set1(t[j * ts + r]), bv, acc[j]);
        }
        for (int j = 0; j < n; j++) {
            if (bf16) {
                float out[SIMD_WIDTH];
                vf_store(out, acc[j]);
                for (int l = 0; l < SIMD_WIDTH; l++) store1(y, rows[j] * N + c + l, out[l], 1);
            } else {
                vf_store((float *)y + rows[j] * N + c, acc[j]);
            }
        }
    }
#endif
    for (; c < n1; c++)
        for (int j = 0; j < n; j++) {
            float sum = load1(y, rows[j] * N + c, bf16);
            for (int64_t r = 0; r < R; r++) sum += t[j * ts + r] * load1(bt, r * N + c, bf16);
            store1(y, rows[j] * N + c, sum, bf16);
        }
}

static void shrink_job(const void *x, const int64_t *index, const group_t *g, const void *a, int64_t r, int64_t K,
                       int bf16, float *t, int64_t ts) {
    const int64_t *rows = index + g->start;
    float *tg = t + g->start * ts + r;
    const void *a_row = bf16 ? (const void *)((const uint16_t *)a + r * K) : (const void *)((const float *)a + r * K);
    if (g->count == RG) {
        if (bf16)
            shrink_group(x, rows, RG, a_row, K, 1, tg, ts);
        else
            shrink_group(x, rows, RG, a_row, K, 0, tg, ts);
    } else {
        if (bf16)
            shrink_group(x, rows, (int)g->count, a_row, K, 1, tg, ts);
        else
            shrink_group(x, rows, (int)g->count, a_row, K, 0, tg, ts);
    }
}

static void expand_job(void *y, const int64_t *index, const group_t *g, const float *t, int64_t ts, const void *bt,
                       int64_t R, int64_t N, int64_t n0, int64_t n1, int bf16) {
    const int64_t *rows = index + g->start;
    const float *tg = t + g->start * ts;
    if (g->count == RG) {
        if (bf16)
            expand_group(y, rows, RG, tg, ts, bt, R, N, n0, n1, 1);
        else
            expand_group(y, rows, RG, tg, ts, bt, R, N, n0, n1, 0);
    } else {
        if (bf16)
            expand_group(y, rows, (int)g->count, tg, ts, bt, R, N, n0, n1, 1);
        else
            expand_group(y, rows, (int)g->count, tg, ts, bt, R, N, n0, n1, 0);
    }
}

// x [M, K], y [M, N] (row-major, float32 or bf16); index: the rows of every segment, segment s at positions
// offsets[s] .. offsets[s + 1]; a[s]: A_s [ranks[s], K]; bt[s]: Bt_s [ranks[s], N]; ranks[s] == 0: skipped.
int lora_sgmv(const void *x, void *y, int64_t K, int64_t N, int bf16, const int64_t *index, const int64_t *offsets,
              int64_t nseg, const void *const *a, const void *const *bt, const int64_t *ranks, int nthreads) {
    if (K < 1 || N < 1 || nseg < 0) return -1;
    int64_t rmax = 0, ngroups = 0;
    for (int64_t s = 0; s < nseg; s++) {
        const int64_t rows = offsets[s + 1] - offsets[s];
        if (ranks[s] < 0 || rows < 0) return -1;
        if (ranks[s] == 0 || rows == 0) continue;
        rmax = ranks[s] > rmax ? ranks[s] : rmax;
        ngroups += (rows + RG - 1) / RG;
    }
    if (ngroups == 0) return 0;
    group_t *groups = malloc(sizeof(group_t) * ngroups);
    float *t = malloc(sizeof(float) * offsets[nseg] * rmax);
    if (groups == NULL || t == NULL) {
        free(groups);
        free(t);
        return -2;
    }
    int64_t g = 0;
    for (int64_t s = 0; s < nseg; s++) {
        if (ranks[s] == 0) continue;
        for (int64_t p = offsets[s]; p < offsets[s + 1]; p += RG) {
            groups[g].seg = s;
            groups[g].start = p;
            groups[g].count = offsets[s + 1] - p < RG ? offsets[s + 1] - p : RG;
            g++;
        }
    }
    const int64_t blocks = (N + CB - 1) / CB;
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static) collapse(2)
        for (int64_t gi = 0; gi < ngroups; gi++)
            for (int64_t r = 0; r < rmax; r++) {
                const int64_t s = groups[gi].seg;
                if (r < ranks[s]) shrink_job(x, index, &groups[gi], a[s], r, K, bf16, t, rmax);
            }
        // NOTE: the implicit barrier of the loop above: every t is written before any is read
#pragma omp for schedule(static) collapse(2)
        for (int64_t gi = 0; gi < ngroups; gi++)
            for (int64_t b = 0; b < blocks; b++) {
                const int64_t s = groups[gi].seg, n0 = b * CB, n1 = n0 + CB < N ? n0 + CB : N;
                expand_job(y, index, &groups[gi], t, rmax, bt[s], ranks[s], N, n0, n1, bf16);
            }
    }
    free(groups);
    free(t);
    return 0;
}
