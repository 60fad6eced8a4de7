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
// Work is split into groups of up to RG rows of one segment. Shrink: one job per (group, AR rank rows), dot
// products over K of the group's rows with those rows of A_s, SR x AR sums in registers (each vector of A
// read once for SR rows, each of x once for AR rank rows). Expand: one job per (group,
// block of CB output columns): per vector of columns, the sum over r of t[i, r] * Bt_s[r, cols] for the
// group's rows, Bt_s read once per group. Both loops are OpenMP-parallel; the expand jobs write disjoint
// parts of y (a row is in one segment). float32 throughout, or bfloat16 x, A, Bt and y (bf16 != 0) with
// float32 sums and t, y rounded to nearest even once; bf16 rows of x are widened to float32 once per call
// (otherwise every rank row would convert them again).
//
// One source for every level: AVX-512F (16 lanes), AVX2 + FMA (8 lanes), or plain C. Returns 0; -1 for
// shapes it does not take; -2 when its scratch memory cannot be allocated.

#include <stdint.h>
#include <stdlib.h>

#include "simd.h"

#define RG 4  /* rows per group */
#define CB 64 /* output columns per expand job */
#define AR 4  /* rank rows per shrink block */
#if defined(SIMD_WIDTH) && SIMD_WIDTH == 16
#define SR 4 /* rows per shrink block: 16 sums + 4 vectors of A + 1 of x, of 32 zmm registers */
#else
#define SR 2 /* 8 sums + 4 vectors of A + 1 of x, of 16 ymm registers */
#endif

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

// t[j * ts + i] = x[rows[j]] . a[i] for n <= SR rows and nr <= AR rank rows (a[i] at a + i * K), x float32
// (the caller widened bf16 rows), a float32 or bf16. NOTE: always inlined with constant n, nr and bf16, so the
// n x nr sums stay in registers.
static inline __attribute__((always_inline)) void shrink_block(const float *x, const int64_t *rows, int n,
                                                               const void *a, int nr, int64_t K, int bf16,
                                                               float *t, int64_t ts) {
    float sums[SR][AR] = {{0}};
    int64_t k = 0;
#ifdef SIMD_WIDTH
    vf acc[SR][AR];
    for (int j = 0; j < n; j++)
        for (int i = 0; i < nr; i++) acc[j][i] = vf_zero();
    for (; k + SIMD_WIDTH <= K; k += SIMD_WIDTH) {
        vf av[AR];
        for (int i = 0; i < nr; i++) av[i] = loadv(a, i * K + k, bf16);
        for (int j = 0; j < n; j++) {
            const vf xv = vf_load(x + rows[j] * K + k);
            for (int i = 0; i < nr; i++) acc[j][i] = vf_fmadd(xv, av[i], acc[j][i]);
        }
    }
    for (int j = 0; j < n; j++)
        for (int i = 0; i < nr; i++) sums[j][i] = vf_hsum(acc[j][i]);
#endif
    for (; k < K; k++)
        for (int j = 0; j < n; j++)
            for (int i = 0; i < nr; i++) sums[j][i] += x[rows[j] * K + k] * load1(a, i * K + k, bf16);
    for (int j = 0; j < n; j++)
        for (int i = 0; i < nr; i++) t[j * ts + i] = sums[j][i];
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

// Rank rows r0 .. r0 + nr (nr <= AR) of segment A for every row of a group, SR rows at a time.
static void shrink_job(const float *x, const int64_t *index, const group_t *g, const void *a, int64_t r0, int nr,
                       int64_t K, int bf16, float *t, int64_t ts) {
    const void *ar = bf16 ? (const void *)((const uint16_t *)a + r0 * K) : (const void *)((const float *)a + r0 * K);
    for (int64_t p = 0; p < g->count; p += SR) {
        const int64_t *rows = index + g->start + p;
        float *tp = t + (g->start + p) * ts + r0;
        const int n = g->count - p < SR ? (int)(g->count - p) : SR;
        if (n == SR && nr == AR) {
            if (bf16)
                shrink_block(x, rows, SR, ar, AR, K, 1, tp, ts);
            else
                shrink_block(x, rows, SR, ar, AR, K, 0, tp, ts);
        } else if (bf16) {
            shrink_block(x, rows, n, ar, nr, K, 1, tp, ts);
        } else {
            shrink_block(x, rows, n, ar, nr, K, 0, tp, ts);
        }
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
    // bf16: the rows of x widened to float32 once (position i of the index at xf + i * K), so that the shrink
    // converts only A, not x again for every rank row
    const int64_t total = offsets[nseg];
    float *xf = bf16 ? malloc(sizeof(float) * total * K) : NULL;
    int64_t *pos = bf16 ? malloc(sizeof(int64_t) * total) : NULL;
    if (bf16 && (xf == NULL || pos == NULL)) {
        free(groups);
        free(t);
        free(xf);
        free(pos);
        return -2;
    }
    const int64_t blocks = (N + CB - 1) / CB;
#pragma omp parallel num_threads(nthreads)
    {
        if (bf16) {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < total; i++) {
                const uint16_t *src = (const uint16_t *)x + index[i] * K;
                for (int64_t k = 0; k < K; k++) xf[i * K + k] = bf16_to_f32(src[k]);
                pos[i] = i;
            }
        }
#pragma omp for schedule(static) collapse(2)
        for (int64_t gi = 0; gi < ngroups; gi++)
            for (int64_t r0 = 0; r0 < rmax; r0 += AR) {
                const int64_t s = groups[gi].seg;
                if (r0 >= ranks[s]) continue;
                const int nr = ranks[s] - r0 < AR ? (int)(ranks[s] - r0) : AR;
                if (bf16)
                    shrink_job(xf, pos, &groups[gi], a[s], r0, nr, K, 1, t, rmax);
                else
                    shrink_job((const float *)x, index, &groups[gi], a[s], r0, nr, K, 0, t, rmax);
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
    free(xf);
    free(pos);
    return 0;
}
