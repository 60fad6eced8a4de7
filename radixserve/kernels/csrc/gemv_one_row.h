/* One row of x against the GEMV's packed layout (bf16_gemv.c): y[1, N] = x[1, K] @ W[N, K]^T (+ bias), bf16 in
 * and out, float32 sums; a decode step at batch 1, whose time is reading the weight once. Included by bf16_gemv.c
 * (AVX512-BF16) and bf16_amx.c (AMX CPUs, where the tiles would do 16 times the needed work for one row and read
 * the weight no faster), which call it for M == 1.
 *
 * Each thread takes a contiguous run of 64-row tiles and walks ONE_ROW_LOCK of them in lockstep, one input pair
 * at a time (one vdpbf16ps per 16 output rows), so it reads that many streams at once, each prefetched
 * ONE_ROW_PREFETCH bytes ahead. NOTE: measured on a 2-core Xeon with AMX (docs/cpu_fast_path.md), one stream per
 * thread read a decode step's weights at 22-23 GB/s, four at 27-28 (a plain read loop: 24-26 against 29-30); the
 * memory system serves several sequential streams per core better than one. Each output's sum runs over the
 * pairs in order, as in bf16_gemv.c's tile_dp. */
#ifndef RADIXSERVE_GEMV_ONE_ROW_H
#define RADIXSERVE_GEMV_ONE_ROW_H

#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#define ONE_ROW_TILE 64      /* output rows per packed tile */
#define ONE_ROW_LOCK 4       /* tiles read in lockstep: 16 float32 sums in registers */
#define ONE_ROW_PREFETCH 1024

/* nt (1 .. ONE_ROW_LOCK, a constant where inlined) tiles from `first` against x, written to y (rows n0 ..). */
static inline __attribute__((always_inline)) void one_row_tiles(const uint16_t *packed, const uint16_t *x,
                                                                const uint16_t *bias, uint16_t *y, int64_t N,
                                                                int64_t K, int64_t first, const int nt) {
    const int64_t pairs = K / 2;
    __m512 acc[ONE_ROW_LOCK][4];
    const __m512i *w[ONE_ROW_LOCK];
    for (int i = 0; i < nt; i++) {
        for (int j = 0; j < 4; j++) acc[i][j] = _mm512_setzero_ps();
        w[i] = (const __m512i *)(packed + (first + i) * ONE_ROW_TILE * K);
    }
    for (int64_t p = 0; p < pairs; p++) {
        int32_t pair; /* NOTE: memcpy, as x (a bf16 tensor) need not be 4-byte aligned */
        memcpy(&pair, x + 2 * p, sizeof pair);
        const __m512bh xr = (__m512bh)_mm512_set1_epi32(pair);
        for (int i = 0; i < nt; i++) {
            const __m512i *wp = w[i] + 4 * p; /* 16 rows x one pair per 64 bytes */
            for (int l = 0; l < 4; l++) _mm_prefetch((const char *)wp + ONE_ROW_PREFETCH + 64 * l, _MM_HINT_T0);
            for (int j = 0; j < 4; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xr, (__m512bh)_mm512_loadu_si512(wp + j));
        }
    }
    for (int i = 0; i < nt; i++)
        for (int j = 0; j < 4; j++) {
            const int64_t n = (first + i) * ONE_ROW_TILE + 16 * j;
            if (n >= N) break;
            const __mmask16 k = N - n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (N - n)) - 1);
            __m512 b = _mm512_setzero_ps(); /* NOTE: added even when zero, as bf16_gemv.c's tiles do (-0 + 0 = +0) */
            if (bias) b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, bias + n)), 16));
            _mm256_mask_storeu_epi16(y + n, k, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[i][j], b)));
        }
}

static void gemv_one_row(const uint16_t *packed, const uint16_t *x, const uint16_t *bias, uint16_t *y, int64_t N,
                         int64_t K, int nthreads) {
    const int64_t tiles = (N + ONE_ROW_TILE - 1) / ONE_ROW_TILE;
#pragma omp parallel num_threads(nthreads)
    {
        const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t lo = tiles * t / threads, hi = tiles * (t + 1) / threads; /* NOTE: near-equal runs */
        for (int64_t t0 = lo; t0 < hi; t0 += ONE_ROW_LOCK) {
            switch (hi - t0 < ONE_ROW_LOCK ? (int)(hi - t0) : ONE_ROW_LOCK) {
                case 1: one_row_tiles(packed, x, bias, y, N, K, t0, 1); break;
                case 2: one_row_tiles(packed, x, bias, y, N, K, t0, 2); break;
                case 3: one_row_tiles(packed, x, bias, y, N, K, t0, 3); break;
                default: one_row_tiles(packed, x, bias, y, N, K, t0, 4); break;
            }
        }
    }
}

#endif
