// Matrix products on AMX tiles, of 1-32 rows (bf16_amx_gemm, decode) or any number (bf16_amx_gemm_large,
// prefill chunks where oneDNN measured slower): y[M, N] = x[M, K] @ W[N, K]^T (+ bias), bfloat16 in and
// out, float32 accumulation; W in the GEMV's packed layout (bf16_gemv.c).
//
// That layout is already what a B tile wants. For a 64-row tile of W and an input pair p, the 64 rows'
// (W[., 2p], W[., 2p + 1]) lie side by side in 256 bytes, so 16 consecutive pairs of 16 consecutive rows
// are 16 rows of 64 bytes at a stride of 256: one tile load, B[pair][2 * row + j] as tdpbf16ps expects.
// A tiles are 16 rows of x, 32 inputs each, read in place. Each thread takes whole 64-row tiles of W,
// in two halves of 32 output rows: per half and per 32 inputs, two A tiles (rows 0-15, 16-31 of x), two
// B tiles and four C tiles (float32 sums). At these row counts the time is reading W, which tdpbf16ps
// leaves idle most of the time; a software prefetch runs one 32-input step ahead. The large product runs
// the same per-tile code on each 32-row block of x, in work items of CHUNK_ROWS rows x one tile, so both
// threads have work at every row count (oneDNN falls back to one thread for some shapes near 1,000 rows).
//
// Linux gives a process AMX state only on request (arch_prctl ARCH_REQ_XCOMP_PERM): amx_request() does it
// once. Returns 0, -1 for shapes it does not take (K % 32, M outside 1..32), -2 without AMX permission.

#define _GNU_SOURCE
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "amx_tiles.h"
#include "gemv_one_row.h"

#define TILE 64        // W rows per packed tile (bf16_gemv.c)
#define PAIR_BYTES 256 // one input pair of a packed tile: 64 rows x 2 bf16

// Up to 16 rows of x: tmm0-3 C (W rows +0, +16, +32, +48 of the tile), tmm4 A, tmm6/7 B, one pass
// over the tile. 17-32 rows: two passes of 32 W rows, tmm0-3 C (x rows 0-15 | 16-31) x (W rows +0 | +16),
// tmm4/5 A (x rows 0-15 | 16-31), tmm6/7 B.
static void configure(int64_t m) {
    const uint8_t low = m < 16 ? (uint8_t)m : 16, high = m > 16 ? (uint8_t)(m - 16) : (uint8_t)m;
    const uint8_t rows[8] = {low, low, m > 16 ? high : low, m > 16 ? high : low, low, high, 16, 16};
    configure_tiles(rows, 8);
}

static inline void prefetch_pairs(const char *p, int lines_per_row) { // 16 pair rows
    for (int row = 0; row < 16; row++)
        for (int l = 0; l < lines_per_row; l++) _mm_prefetch(p + row * PAIR_BYTES + 64 * l, _MM_HINT_T0);
}

// 32 output rows n0.. of one half: sums[32 x rows][32 columns] -> y, with bias, rounded to bf16.
static void store_half(const float *sums, const uint16_t *bias, uint16_t *y, int64_t m, int64_t n, int64_t n0) {
    for (int64_t j = 0; j < 32; j += 16) {
        if (n0 + j >= n) break;
        const int64_t left = n - n0 - j;
        const __mmask16 k = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
        __m512 b = _mm512_setzero_ps();
        if (bias)
            b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, bias + n0 + j)), 16));
        for (int64_t r = 0; r < m; r++) {
            const __m512 s = _mm512_add_ps(_mm512_loadu_ps(sums + r * 32 + j), b);
            _mm256_mask_storeu_epi16(y + r * n + n0 + j, k, (__m256i)_mm512_cvtneps_pbh(s));
        }
    }
}

// One packed tile (64 W rows at n0 = t * TILE) against up to 16 rows of x: 4 C tiles, one pass.
static void one_pass_tile(const char *wt, const uint16_t *x, const uint16_t *bias, uint16_t *y, int64_t m, int64_t n,
                          int64_t k, int64_t n0, float *sums) {
    const int64_t steps = k / 32, x_stride = k * 2;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t s = 0; s < steps; s++) {
        const char *ws = wt + s * 16 * PAIR_BYTES;
        prefetch_pairs(ws + 16 * PAIR_BYTES, 4); // the next step (past the tile: the next tile)
        _tile_loadd(4, x + s * 32, x_stride);
        _tile_loadd(6, ws, PAIR_BYTES);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, ws + 64, PAIR_BYTES);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(6, ws + 128, PAIR_BYTES);
        _tile_dpbf16ps(2, 4, 6);
        _tile_loadd(7, ws + 192, PAIR_BYTES);
        _tile_dpbf16ps(3, 4, 7);
    }
    _tile_stored(0, sums, 32 * 4);
    _tile_stored(1, sums + 16, 32 * 4);
    store_half(sums, bias, y, m, n, n0);
    if (n0 + 32 < n) {
        _tile_stored(2, sums, 32 * 4);
        _tile_stored(3, sums + 16, 32 * 4);
        store_half(sums, bias, y, m, n, n0 + 32);
    }
}

// One packed tile against 17-32 rows of x: two passes of 32 W rows, 2 x 2 C tiles each.
static void two_pass_tile(const char *wt, const uint16_t *x, const uint16_t *bias, uint16_t *y, int64_t m, int64_t n,
                          int64_t k, int64_t n0, float *sums) {
    const int64_t steps = k / 32, x_stride = k * 2;
    for (int half = 0; half < 2; half++) {
        if (n0 + half * 32 >= n) break;
        const char *w = wt + half * 32 * 4; // 32 rows x one pair = 128 bytes into each pair row
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t s = 0; s < steps; s++) {
            const char *ws = w + s * 16 * PAIR_BYTES;
            // NOTE: the first pass brings whole pair rows in, so the second reads them from L2
            prefetch_pairs(wt + (s + 1) * 16 * PAIR_BYTES, half ? 0 : 4);
            _tile_loadd(4, x + s * 32, x_stride);
            _tile_loadd(6, ws, PAIR_BYTES);
            _tile_loadd(7, ws + 64, PAIR_BYTES);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_loadd(5, x + 16 * k + s * 32, x_stride);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, sums, 32 * 4);
        _tile_stored(1, sums + 16, 32 * 4);
        _tile_stored(2, sums + 16 * 32, 32 * 4);
        _tile_stored(3, sums + 16 * 32 + 16, 32 * 4);
        store_half(sums, bias, y, m, n, n0 + half * 32);
    }
}

static inline void tile_rows(const char *wt, const uint16_t *x, const uint16_t *bias, uint16_t *y, int64_t m,
                             int64_t n, int64_t k, int64_t n0, float *sums) {
    (m <= 16 ? one_pass_tile : two_pass_tile)(wt, x, bias, y, m, n, k, n0, sums);
}

#define CHUNK_ROWS 256 // rows of x per work item of the large product: its x block stays in L2 across tiles

// Any number of rows: work items of CHUNK_ROWS rows x one packed tile, each 32-row block of the chunk
// against the tile (one pass up to 16 rows, else 2 x 2 C tiles; the tile's W rows stay in L2 across the
// chunk's blocks).
int bf16_amx_gemm_large(const uint16_t *packed, const uint16_t *x, const uint16_t *bias, uint16_t *y, int64_t m,
                        int64_t n, int64_t k, int nthreads) {
    if (k % 32 || m < 1 || n < 1) return -1;
    const int64_t tiles = (n + TILE - 1) / TILE, chunks = (m + CHUNK_ROWS - 1) / CHUNK_ROWS;
#pragma omp parallel num_threads(nthreads)
    {
        int64_t configured = 0;
        float sums[32 * 32];
#pragma omp for schedule(static)
        for (int64_t item = 0; item < chunks * tiles; item++) {
            const int64_t c = item / tiles, t = item % tiles;
            const char *wt = (const char *)(packed + t * TILE * k);
            for (int64_t r = c * CHUNK_ROWS; r < m && r < (c + 1) * CHUNK_ROWS; r += 32) {
                const int64_t rows = m - r < 32 ? m - r : 32;
                if (rows != configured) configure(rows), configured = rows;
                tile_rows(wt, x + r * k, bias, y + r * n, rows, n, k, t * TILE, sums);
            }
        }
        _tile_release();
    }
    return 0;
}

// 1-32 rows (decode): one chunk of the large product, whose work items are then the packed tiles.
int bf16_amx_gemm(const uint16_t *packed, const uint16_t *x, const uint16_t *bias, uint16_t *y, int64_t m,
                  int64_t n, int64_t k, int nthreads) {
    if (m > 32) return -1;
    if (m == 1 && n > 0 && k % 2 == 0) { /* NOTE: one row reads faster as dot products in several streams */
        gemv_one_row(packed, x, bias, y, n, k, nthreads);
        return 0;
    }
    return bf16_amx_gemm_large(packed, x, bias, y, m, n, k, nthreads);
}
