// Matrix products for decode with bfloat16 *weights* and float32 everything else: y[M, N] = x[M, K] @ W[N, K]^T
// (+ bias), x, bias and y float32. For CPUs without bf16 products (AVX2, AVX-512 without BF16): a decode step is
// bound by reading its weights, and a bf16 weight is half the bytes of a float32 one. A bf16 value is the top
// half of a float32, so widening it is a shift (exact); the products and sums are float32 FMAs.
//
// Packed layout: tiles of TILE = 16 output rows (the last tile padded with zero rows). Within a tile, for each
// pair p of input positions (2p, 2p + 1), the 16 rows' two values lie side by side:
//     packed[t][p][r][j] = W[TILE * t + r][2 * p + j]
// so 64 bytes hold the tile's 16 rows x one pair: a shift and a mask widen them to 16 rows' W[., 2p] and
// W[., 2p + 1], and two FMAs per row of x with the broadcast x[2p], x[2p + 1] add into 16 sums, with no
// horizontal reductions; each thread reads its tiles front to back, prefetching ahead (hardware prefetch stops
// at 4 KiB pages; into L1 or L2 by the CPU, see PREFETCH_L2). Rows of x go in groups of MAX_ROWS; a tile read
// again for the next group is in cache. One row of x (batch-1 decode) walks up to ONE_ROW_LOCK tiles per thread in
// lockstep instead, over near-equal contiguous runs of tiles: several streams per core read memory faster than
// one (gemv_one_row.h, the bf16 kernels' form of the same), with the same sums in the same order.
//
// One source for every level: AVX-512F (16 lanes), AVX2 + FMA (8 lanes), or plain C without either.
// Returns 0, or -1 for shapes it does not take (K odd, M < 1, N < 1).

#include <omp.h>
#include <stdint.h>
#include <string.h>

#define TILE 16
#ifdef PREFETCH_L2 /* NOTE: chosen per CPU (platform.weight_prefetch): into L2 on Intel, where an L1 prefetch holds a
                    * line-fill buffer that the loads need */
#define PREFETCH 8192
#define PREFETCH_HINT _MM_HINT_T1
#else
#define PREFETCH 4096
#define PREFETCH_HINT _MM_HINT_T0
#endif

#if defined(__AVX512F__)
#include <immintrin.h>
#define LANES 16
#define MAX_ROWS 8
typedef __m512 V;
static inline V v_zero(void) { return _mm512_setzero_ps(); }
static inline V v_set1(float x) { return _mm512_set1_ps(x); }
static inline V v_fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
static inline void v_store(float *p, V v) { _mm512_storeu_ps(p, v); }
/* 16 rows x one pair at w -> even[0] = W[., 2p], odd[0] = W[., 2p + 1] */
static inline void widen_pair(const uint16_t *w, V *even, V *odd) {
    const __m512i v = _mm512_loadu_si512((const void *)w);
    even[0] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    odd[0] = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000)));
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LANES 8
#define MAX_ROWS 4 /* 2 x 4 sums + 4 widened weights + 2 broadcasts of 16 ymm registers */
typedef __m256 V;
static inline V v_zero(void) { return _mm256_setzero_ps(); }
static inline V v_set1(float x) { return _mm256_set1_ps(x); }
static inline V v_fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
static inline void v_store(float *p, V v) { _mm256_storeu_ps(p, v); }
static inline void widen_pair(const uint16_t *w, V *even, V *odd) {
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000);
    for (int h = 0; h < 2; h++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(w + 16 * h));
        even[h] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        odd[h] = _mm256_castsi256_ps(_mm256_and_si256(v, high));
    }
}
#endif

static inline float bf16_to_float(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static void write_rows(const float *sums, int R, const float *bias, float *y, int64_t N, int64_t n0) {
    const int64_t valid = N - n0 < TILE ? N - n0 : TILE;
    for (int r = 0; r < R; r++)
        for (int64_t i = 0; i < valid; i++) y[r * N + n0 + i] = sums[r * TILE + i] + (bias ? bias[n0 + i] : 0.0f);
}

#ifdef LANES
#define PARTS (TILE / LANES)
static inline __attribute__((always_inline)) void tile_product(const uint16_t *wt, const float *x, int64_t K, int R,
                                                               const float *bias, float *y, int64_t N, int64_t n0) {
    V acc[MAX_ROWS][PARTS];
    for (int r = 0; r < R; r++)
        for (int h = 0; h < PARTS; h++) acc[r][h] = v_zero();
    const uint16_t *w = wt;
    for (int64_t p = 0; p < K / 2; p++, w += 2 * TILE) {
        _mm_prefetch((const char *)w + PREFETCH, PREFETCH_HINT);
        V even[PARTS], odd[PARTS];
        widen_pair(w, even, odd);
        for (int r = 0; r < R; r++) {
            const V xe = v_set1(x[r * K + 2 * p]), xo = v_set1(x[r * K + 2 * p + 1]);
            for (int h = 0; h < PARTS; h++) acc[r][h] = v_fmadd(odd[h], xo, v_fmadd(even[h], xe, acc[r][h]));
        }
    }
    float sums[MAX_ROWS * TILE];
    for (int r = 0; r < R; r++)
        for (int h = 0; h < PARTS; h++) v_store(sums + r * TILE + h * LANES, acc[r][h]);
    write_rows(sums, R, bias, y, N, n0);
}

#define ONE_ROW_LOCK 4 /* tiles in lockstep: AVX2 8 sums + 4 widened weights + 2 broadcasts of 16 ymm registers */
/* NOTE: into L1, 2 KiB ahead, on every CPU: with four streams per thread this read 27.2-28.1 GB/s at the AVX2 level
 * on the AMX Xeon (AVX-512 28.1-29.3), against 25.1-25.5 with the L2 hint that suits one stream (PREFETCH_L2) */
#define ONE_ROW_PREFETCH 2048

/* nt (1 .. ONE_ROW_LOCK, a constant where inlined) tiles from `first` against one row x: tile_product's sums. */
static inline __attribute__((always_inline)) void one_row_tiles(const uint16_t *packed, const float *x, int64_t K,
                                                                const float *bias, float *y, int64_t N,
                                                                int64_t first, const int nt) {
    V acc[ONE_ROW_LOCK][PARTS];
    const uint16_t *w[ONE_ROW_LOCK];
    for (int i = 0; i < nt; i++) {
        for (int h = 0; h < PARTS; h++) acc[i][h] = v_zero();
        w[i] = packed + (first + i) * TILE * K;
    }
    for (int64_t p = 0; p < K / 2; p++) {
        const V xe = v_set1(x[2 * p]), xo = v_set1(x[2 * p + 1]);
        for (int i = 0; i < nt; i++) {
            const uint16_t *wp = w[i] + 2 * TILE * p;
            _mm_prefetch((const char *)wp + ONE_ROW_PREFETCH, _MM_HINT_T0);
            V even[PARTS], odd[PARTS];
            widen_pair(wp, even, odd);
            for (int h = 0; h < PARTS; h++) acc[i][h] = v_fmadd(odd[h], xo, v_fmadd(even[h], xe, acc[i][h]));
        }
    }
    for (int i = 0; i < nt; i++) {
        float sums[TILE];
        for (int h = 0; h < PARTS; h++) v_store(sums + h * LANES, acc[i][h]);
        write_rows(sums, 1, bias, y, N, (first + i) * TILE);
    }
}

static void one_row(const uint16_t *packed, const float *x, const float *bias, float *y, int64_t N, int64_t K,
                    int nthreads) {
    const int64_t tiles = (N + TILE - 1) / TILE;
#pragma omp parallel num_threads(nthreads)
    {
        const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t lo = tiles * t / threads, hi = tiles * (t + 1) / threads;
        for (int64_t t0 = lo; t0 < hi; t0 += ONE_ROW_LOCK) {
            switch (hi - t0 < ONE_ROW_LOCK ? (int)(hi - t0) : ONE_ROW_LOCK) {
                case 1: one_row_tiles(packed, x, K, bias, y, N, t0, 1); break;
                case 2: one_row_tiles(packed, x, K, bias, y, N, t0, 2); break;
                case 3: one_row_tiles(packed, x, K, bias, y, N, t0, 3); break;
                default: one_row_tiles(packed, x, K, bias, y, N, t0, 4); break;
            }
        }
    }
}
#else
#define MAX_ROWS 4
static void tile_product(const uint16_t *wt, const float *x, int64_t K, int R, const float *bias, float *y,
                         int64_t N, int64_t n0) {
    float sums[MAX_ROWS * TILE] = {0};
    for (int64_t p = 0; p < K / 2; p++)
        for (int i = 0; i < TILE; i++) {
            const float we = bf16_to_float(wt[(p * TILE + i) * 2]), wo = bf16_to_float(wt[(p * TILE + i) * 2 + 1]);
            for (int r = 0; r < R; r++) sums[r * TILE + i] += we * x[r * K + 2 * p] + wo * x[r * K + 2 * p + 1];
        }
    write_rows(sums, R, bias, y, N, n0);
}
#endif

int bf16w_gemv(const uint16_t *packed, const float *x, const float *bias, float *y, int64_t M, int64_t N, int64_t K,
               int nthreads) {
    if (K % 2 || M < 1 || N < 1) return -1;
#ifdef LANES
    if (M == 1) {
        one_row(packed, x, bias, y, N, K, nthreads);
        return 0;
    }
#endif
    const int64_t tiles = (N + TILE - 1) / TILE;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const uint16_t *wt = packed + t * TILE * K;
        for (int64_t m0 = 0; m0 < M; m0 += MAX_ROWS) {
            const int R = M - m0 < MAX_ROWS ? (int)(M - m0) : MAX_ROWS;
            const float *xr = x + m0 * K;
            float *yr = y + m0 * N;
            switch (R) {  // NOTE: a constant R per call lets the compiler keep the sums in registers
                case 1: tile_product(wt, xr, K, 1, bias, yr, N, t * TILE); break;
                case 2: tile_product(wt, xr, K, 2, bias, yr, N, t * TILE); break;
                case 3: tile_product(wt, xr, K, 3, bias, yr, N, t * TILE); break;
#if MAX_ROWS > 4
                case 4: tile_product(wt, xr, K, 4, bias, yr, N, t * TILE); break;
                case 5: tile_product(wt, xr, K, 5, bias, yr, N, t * TILE); break;
                case 6: tile_product(wt, xr, K, 6, bias, yr, N, t * TILE); break;
                case 7: tile_product(wt, xr, K, 7, bias, yr, N, t * TILE); break;
#endif
                default: tile_product(wt, xr, K, MAX_ROWS, bias, yr, N, t * TILE); break;
            }
        }
    }
    return 0;
}


// The packed weight widened back to float32 [N, K] (products with many rows go to a float32 GEMM, which does
// them faster than the loop above). Reads each tile front to back; writes its 16 rows as 16 streams.
int bf16w_unpack(const uint16_t *packed, float *out, int64_t N, int64_t K, int nthreads) {
    if (K % 2 || N < 1) return -1;
    const int64_t tiles = (N + TILE - 1) / TILE;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const uint32_t *pairs = (const uint32_t *)(packed + t * TILE * K);  // one pair of a row per word
        const int64_t rows = N - t * TILE < TILE ? N - t * TILE : TILE;
        for (int64_t p = 0; p < K / 2; p++)
            for (int64_t r = 0; r < rows; r++) {
                const uint32_t both = pairs[p * TILE + r];
                const uint32_t lo = both << 16, hi = both & 0xFFFF0000u;
                memcpy(out + (t * TILE + r) * K + 2 * p, &lo, 4);
                memcpy(out + (t * TILE + r) * K + 2 * p + 1, &hi, 4);
            }
    }
    return 0;
}

// The packed weight widened to float32 in oneDNN's blocked order for a linear weight, [ceil(N / 64)][K][64]
// (block b's 64 output rows side by side for each input position; layers/bf16_weights.py checks once per
// weight shape that oneDNN asks for this order), so oneDNN's product reads it without reordering it first. Four of
// this layout's 16-row tiles make one 64-row block; each 64-byte pair row of a tile becomes its 16 values of
// W[., 2p] and of W[., 2p + 1]. Rows past N (the last block's padding) are written as zeros.
int bf16w_unpack_blocked(const uint16_t *packed, float *out, int64_t N, int64_t K, int nthreads) {
    if (K % 2 || N < 1) return -1;
    const int64_t tiles = (N + TILE - 1) / TILE, blocks = (N + 63) / 64;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        float *block = out + b * K * 64;
        for (int64_t q = 0; q < 4; q++) { /* NOTE: one tile at a time, read front to back (faster than 4 at once) */
            const int64_t t = 4 * b + q;
            if (t >= tiles) { /* the last block's padding */
                for (int64_t k = 0; k < K; k++) memset(block + k * 64 + q * TILE, 0, TILE * sizeof(float));
                continue;
            }
            const uint32_t *pairs = (const uint32_t *)(packed + t * TILE * K);
            for (int64_t p = 0; p < K / 2; p++) {
                float *even = block + 2 * p * 64 + q * TILE, *odd = even + 64;
#ifdef LANES
                V e[PARTS], o[PARTS];
                widen_pair((const uint16_t *)(pairs + p * TILE), e, o);
                for (int h = 0; h < PARTS; h++) {
                    v_store(even + h * LANES, e[h]);
                    v_store(odd + h * LANES, o[h]);
                }
#else
                for (int64_t r = 0; r < TILE; r++) {
                    const uint32_t lo = pairs[p * TILE + r] << 16, hi = pairs[p * TILE + r] & 0xFFFF0000u;
                    memcpy(even + r, &lo, 4);
                    memcpy(odd + r, &hi, 4);
                }
#endif
            }
        }
    }
    return 0;
}
