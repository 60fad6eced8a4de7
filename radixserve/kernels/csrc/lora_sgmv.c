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
// read once for SR rows, each of x once for AR rank rows). Expand: one job per (group, CB output columns),
// the sum over r of t[i, r] * Bt_s[r, cols] for the group's rows, RG rows x CV column vectors of sums in
// registers (each vector of Bt_s read once for the group). Both loops are OpenMP-parallel; the expand jobs
// write disjoint parts of y (a row is in one segment). float32 throughout, or bfloat16 x, A, Bt and y
// (bf16 != 0) with float32 sums and t, y rounded to nearest even once; bf16 rows of x are widened to
// float32 once per call (otherwise every rank row would convert them again).
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
#define CV 4 /* column vectors per expand block (one 64-column job): 16 sums + 4 of Bt + 1 of t */
#else
#define SR 2 /* 8 sums + 4 vectors of A + 1 of x, of 16 ymm registers */
#define CV 2 /* 8 sums + 2 of Bt + 1 of t */
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

#if defined(SIMD_WIDTH) && SIMD_WIDTH == 16
// The 16 lanes rounded to bf16 (nearest even, as f32_to_bf16) and stored.
static inline void store_bf16(uint16_t *p, vf v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(r));
}
#elif defined(SIMD_WIDTH)
static inline void store_bf16(uint16_t *p, vf v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
    // NOTE: every lane is below 65536, so the saturating pack is exact
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}
#endif

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

#ifdef SIMD_WIDTH
// y[rows[j], c : c + nv * SIMD_WIDTH] += t[j, :R] @ Bt[:, those columns] for n <= RG rows, nv <= CV vectors of
// columns: n x nv sums in registers, each vector of Bt read once for the n rows. NOTE: always inlined with
// constant n, nv and bf16.
static inline __attribute__((always_inline)) void expand_block(void *y, const int64_t *rows, int n, int nv,
                                                               const float *t, int64_t ts, const void *bt,
                                                               int64_t R, int64_t N, int64_t c, int bf16) {
    vf acc[RG][CV];
    for (int j = 0; j < n; j++)
        for (int v = 0; v < nv; v++) acc[j][v] = loadv(y, rows[j] * N + c + v * SIMD_WIDTH, bf16);
    for (int64_t r = 0; r < R; r++) {
        vf bv[CV];
        for (int v = 0; v < nv; v++) bv[v] = loadv(bt, r * N + c + v * SIMD_WIDTH, bf16);
        for (int j = 0; j < n; j++) {
            const vf tv = vf_set1(t[j * ts + r]);
            for (int v = 0; v < nv; v++) acc[j][v] = vf_fmadd(tv, bv[v], acc[j][v]);
        }
    }
    for (int j = 0; j < n; j++)
        for (int v = 0; v < nv; v++) {
            const int64_t at = rows[j] * N + c + v * SIMD_WIDTH;
            if (bf16) {
                store_bf16((uint16_t *)y + at, acc[j][v]);
            } else {
                vf_store((float *)y + at, acc[j][v]);
            }
        }
}
#endif

// y[rows[j], n0:n1] += t[j, :R] @ Bt[:, n0:n1] for the n rows of a group.
static inline __attribute__((always_inline)) void expand_group(void *y, const int64_t *rows, int n,
                                                               const float *t, int64_t ts, const void *bt,
                                                               int64_t R, int64_t N, int64_t n0, int64_t n1,
                                                               int bf16) {
    int64_t c = n0;
#ifdef SIMD_WIDTH
    for (; c + CV * SIMD_WIDTH <= n1; c += CV * SIMD_WIDTH) {
        if (n == RG)
            expand_block(y, rows, RG, CV, t, ts, bt, R, N, c, bf16);
        else
            expand_block(y, rows, n, CV, t, ts, bt, R, N, c, bf16);
    }
    for (; c + SIMD_WIDTH <= n1; c += SIMD_WIDTH) expand_block(y, rows, n, 1, t, ts, bt, R, N, c, bf16);
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
        // NOTE: column blocks outside: a thread's consecutive jobs reuse one block of Bt (R x CB) from cache
#pragma omp for schedule(static) collapse(2)
        for (int64_t b = 0; b < blocks; b++)
            for (int64_t gi = 0; gi < ngroups; gi++) {
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
