// Matrix products for decode with float32 weights: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), all float32, the
// weight in its own row-major layout (no packed copy: the prefill products read the same tensor through
// F.linear). A decode step reads every weight once, so the kernel streams NB weight rows at a time front to
// back and multiplies each vector of them into the RB rows of x it holds in registers; the NB x RB sums are
// reduced once, at the end of the rows. A weight block (NB rows) read again for the next group of x rows is in
// cache.
//
// One source for every level: AVX-512F (16 lanes, 4 x 4 sums), AVX2 + FMA (8 lanes, 4 x 2 sums: 16 ymm
// registers), or plain C. Returns 0, or -1 for shapes it does not take (M, N or K < 1).

#include <stdint.h>

#include "simd.h"

#define NB 4 /* weight rows per block */

#ifdef SIMD_WIDTH
#if SIMD_WIDTH == 16
#define RB 4 /* 16 sums + 4 weight vectors + 1 of x: 21 of 32 zmm registers */
#else
#define RB 2 /* 8 sums + 4 weight vectors + 1 of x: 13 of 16 ymm registers */
#endif

// The nb x R block of y at (m0, n0). NOTE: always inlined with constant nb and R, so the sums stay in registers.
static inline __attribute__((always_inline)) void block_product(const float *w, const float *x, int64_t K, int nb,
                                                                int R, const float *bias, float *y, int64_t N) {
    vf acc[RB][NB];
    for (int r = 0; r < R; r++)
        for (int i = 0; i < nb; i++) acc[r][i] = vf_zero();
    int64_t k = 0;
    for (; k + SIMD_WIDTH <= K; k += SIMD_WIDTH) {
        vf wv[NB];
        for (int i = 0; i < nb; i++) wv[i] = vf_load(w + i * K + k);
        for (int r = 0; r < R; r++) {
            const vf xv = vf_load(x + r * K + k);
            for (int i = 0; i < nb; i++) acc[r][i] = vf_fmadd(wv[i], xv, acc[r][i]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int i = 0; i < nb; i++) {
            float sum = vf_hsum(acc[r][i]);
            for (int64_t t = k; t < K; t++) sum += w[i * K + t] * x[r * K + t];
            y[r * N + i] = sum + (bias ? bias[i] : 0.0f);
        }
}
#else
#define RB 4
static void block_product(const float *w, const float *x, int64_t K, int nb, int R, const float *bias, float *y,
                          int64_t N) {
    for (int r = 0; r < R; r++)
        for (int i = 0; i < nb; i++) {
            float sum = 0.0f;
            for (int64_t t = 0; t < K; t++) sum += w[i * K + t] * x[r * K + t];
            y[r * N + i] = sum + (bias ? bias[i] : 0.0f);
        }
}
#endif

// Every group of RB rows of x against one block of nb weight rows (the last group may be shorter).
#define ROWS_CASE(NBV, RV) block_product(wb, xr, K, NBV, RV, bb, yr, N)
static void block_rows(const float *wb, const float *x, int64_t M, int64_t K, int nb, const float *bb, float *yb,
                       int64_t N) {
    for (int64_t m0 = 0; m0 < M; m0 += RB) {
        const int R = M - m0 < RB ? (int)(M - m0) : RB;
        const float *xr = x + m0 * K;
        float *yr = yb + m0 * N;
        if (nb == NB && R == RB) {
            ROWS_CASE(NB, RB);
        } else if (nb == NB) {
            switch (R) {  // R < RB here
#if RB > 2
                case 3: ROWS_CASE(NB, 3); break;
                case 2: ROWS_CASE(NB, 2); break;
#endif
                default: ROWS_CASE(NB, 1); break;
            }
        } else {
            for (int i = 0; i < nb; i++) {  // the last block of N % NB rows, one row at a time
                const float *wi = wb + i * K, *bi = bb ? bb + i : 0;
                float *yi = yr + i;
                switch (R) {
#if RB > 2
                    case 3: block_product(wi, xr, K, 1, 3, bi, yi, N); break;
                    case 2: block_product(wi, xr, K, 1, 2, bi, yi, N); break;
#endif
                    case 1: block_product(wi, xr, K, 1, 1, bi, yi, N); break;
                    default: block_product(wi, xr, K, 1, RB, bi, yi, N); break;
                }
            }
        }
    }
}

int f32_gemv(const float *w, const float *x, const float *bias, float *y, int64_t M, int64_t N, int64_t K,
             int nthreads) {
    if (M < 1 || N < 1 || K < 1) return -1;
    const int64_t blocks = (N + NB - 1) / NB;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t n0 = b * NB;
        const int nb = N - n0 < NB ? (int)(N - n0) : NB;
        block_rows(w + n0 * K, x, M, K, nb, bias ? bias + n0 : 0, y + n0, N);
    }
    return 0;
}
