// Products for decode batches: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), bfloat16 in and out, float32 sums, for
// 1 to DP_MAX_M rows on CPUs with AVX512-BF16 (where the CPU has AMX, bf16_amx.c takes these rows instead).
//
// Packed layout: tiles of TILE = 64 output rows (the last tile padded with zero rows). Within a tile, for each
// pair p of input positions (2p, 2p + 1), the 64 rows' two values lie side by side:
//     packed[t][p][r][j] = W[TILE * t + r][2 * p + j]
// (oneDNN's AB16b64a2b on these CPUs, whose buffer we then read in place), so one 64-byte load holds 16 output
// rows x one pair: the operand of one vdpbf16ps against a row of x's pair (x[2p], x[2p + 1]) broadcast as one
// 32-bit value: exact products, float32 sums, no widening and no horizontal reduction.
//
// A block of up to DP_ROWS rows and one 64-output tile keeps DP_ROWS x 4 float32 sums in registers, so each
// load of the weight meets every row of the block. The tile's input pairs are walked in slices of DP_SLICE
// pairs: a slice (DP_SLICE x 256 bytes) read from memory by the first block of rows is still in L2 for the
// next blocks; partial sums wait in a per-tile float32 buffer between slices. Rows are split into near-equal
// blocks (32 rows: 6, 6, 5, 5, 5, 5), so no block runs nearly empty. The first block prefetches PREFETCH bytes
// ahead (hardware prefetch stops at 4 KiB pages: on a 2-core AVX512-BF16 Xeon this read large weights ~2x
// faster). NOTE: on the Zen 4 EPYC measured (docs/cpu_fast_path.md), this form took 0.7-1.16x the time of
// the earlier widen-and-FMA GEMV at 1-4 rows and 0.5-0.67x at 16-32, and 0.66-0.90x oneDNN's at 8-32 rows at
// the default model's shapes (benchmarks/bench_decode_linear.py), so it serves every decode batch size there.
//
// Returns 0, or -1 for shapes it does not take (K odd, M < 1 or M > DP_MAX_M).

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>

#include "gemv_one_row.h"

#define TILE 64
#define PREFETCH 4096
#define DP_ROWS 6
#define DP_SLICE 1024
#define DP_MAX_M 64

static inline __attribute__((always_inline)) void tile_dp(const __m512i *w, const uint16_t *x, int64_t K2,
                                                          int64_t pairs, int R, float *sums, int first, int fetch) {
    __m512 acc[DP_ROWS][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(sums + r * 64 + 16 * j);
    for (int64_t p = 0; p < pairs; p++, w += 4) {
        __m512bh b[4];
        for (int j = 0; j < 4; j++) {
            if (fetch) _mm_prefetch((const char *)(w + j) + PREFETCH, _MM_HINT_T0);
            b[j] = (__m512bh)_mm512_loadu_si512(w + j);
        }
        for (int r = 0; r < R; r++) {
            int32_t pair;  // NOTE: memcpy, as x (a bf16 tensor) need not be 4-byte aligned
            memcpy(&pair, x + 2 * (r * K2 + p), sizeof pair);
            const __m512bh xr = (__m512bh)_mm512_set1_epi32(pair);
            for (int j = 0; j < 4; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xr, b[j]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++) _mm512_storeu_ps(sums + r * 64 + 16 * j, acc[r][j]);
}

int bf16_gemv(const uint16_t *packed, const uint16_t *x, const uint16_t *bias, uint16_t *y, int64_t M, int64_t N,
              int64_t K, int nthreads) {
    if (K % 2 || M < 1 || M > DP_MAX_M || N < 1) return -1;
    if (M == 1) { /* several tiles in lockstep (gemv_one_row.h): the same sums, read faster */
        gemv_one_row(packed, x, bias, y, N, K, nthreads);
        return 0;
    }
    const int64_t tiles = (N + TILE - 1) / TILE, K2 = K / 2, blocks = (M + DP_ROWS - 1) / DP_ROWS;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        float sums[DP_MAX_M * TILE];
        const __m512i *wt = (const __m512i *)(packed + t * TILE * K);
        for (int64_t p0 = 0; p0 < K2; p0 += DP_SLICE) {
            const int64_t pairs = K2 - p0 < DP_SLICE ? K2 - p0 : DP_SLICE;
            for (int64_t b = 0, m0 = 0; b < blocks; b++) {
                const int64_t rows = (M - m0 + (blocks - b) - 1) / (blocks - b);
                const uint16_t *xr = x + 2 * (m0 * K2 + p0);  // row m's pair p: x[m][2p], x[m][2p + 1]
                float *s = sums + m0 * TILE;
                const int first = p0 == 0, fetch = b == 0;
                switch ((int)rows) {
                    case 1: tile_dp(wt + p0 * 4, xr, K2, pairs, 1, s, first, fetch); break;
                    case 2: tile_dp(wt + p0 * 4, xr, K2, pairs, 2, s, first, fetch); break;
                    case 3: tile_dp(wt + p0 * 4, xr, K2, pairs, 3, s, first, fetch); break;
                    case 4: tile_dp(wt + p0 * 4, xr, K2, pairs, 4, s, first, fetch); break;
                    case 5: tile_dp(wt + p0 * 4, xr, K2, pairs, 5, s, first, fetch); break;
                    default: tile_dp(wt + p0 * 4, xr, K2, pairs, 6, s, first, fetch); break;
                }
                m0 += rows;
            }
        }
        for (int j = 0; j < 4; j++) {
            const int64_t n = t * TILE + 16 * j;
            if (n >= N) break;
            const __mmask16 k = N - n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (N - n)) - 1);
            __m512 bv = _mm512_setzero_ps();
            if (bias) bv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, bias + n)), 16));
            for (int64_t m = 0; m < M; m++) {
                const __m256bh out = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_loadu_ps(sums + m * TILE + 16 * j), bv));
                _mm256_mask_storeu_epi16(y + m * N + n, k, (__m256i)out);
            }
        }
    }
    return 0;
}
