// The tiled layout of packed weights: y[M, N] = x[M, K] @ W[N, K]^T with integer dot products that need no
// horizontal sums, and the expansion of the weight for larger products. One source for three levels: AVX-512
// VNNI (16 rows per vpdpbusd), AVX-VNNI and AVX2 (8 rows per 256-bit step; their section below).
//
// Layout (built in torch by tiled.py): tiles of 64 output rows; for each tile t and block b of 32 input
// positions, one record of RECORD(bits) bytes:
//     scale f16[64] | min f16[64] | weights
// with w = scale * u + min for an unsigned value u (int4: 0..15; int8: q + 128, and min = -128 * scale).
// Rows of a tile are four sub-tiles of 16; a 64-byte weight vector holds one sub-tile's 16 rows x 4
// consecutive inputs (a "quad"), row-major: byte 4 * row + i is input 4 * quad + i.
//   int8: vector (quad j, sub-tile s) at (j * 4 + s) * 64, j = 0..7;
//   int4: vector (j, s) at (j * 4 + s) * 64, j = 0..3: low nibbles hold quad j, high nibbles quad j + 4.
// vpdpbusd multiplies a weight vector (unsigned) by the broadcast quad of int8 activations (signed) and
// sums each row's four products into its own lane: 16 rows' partial sums per instruction.
//
// Activations are rounded to int8 per block of 32 (scale d, s = d * sum q), as in quant_matmul.c; per
// block and row: y += scale * d * dot(u, q) + min * s.
//
// Every entry returns 0, or a negative code for shapes it does not take.

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <immintrin.h>
#include <omp.h>

#define QK 32
#define TILE 64
#define MAX_ROWS 4  // activation rows per pass over a record (more rows: further passes, record in L1)
#define PREFETCH 4096
#define RECORD(bits) (4 * TILE + ((bits) == 4 ? 16 : 32) * TILE)

static inline uint16_t f32_to_bf16(float f) {  // round to nearest even
    uint32_t bits;
    memcpy(&bits, &f, 4);
    return (uint16_t)((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#define TILED_ISA "avx512_vnni"

static inline __m512 load16(const void *x, int bf16, int64_t i) {
    if (bf16) return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)x + i))), 16));
    return _mm512_loadu_ps((const float *)x + i);
}

// The same arithmetic as quant_matmul.c's scalar quantize_row (v * (127 / amax), rounded to nearest even);
// also the integer sum of each block (`sums`; the AVX2 level needs it for int8).
static void quantize_row(const void *x, int bf16, int64_t K, int8_t *q, float *d, float *s, int32_t *sums) {
    const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
    for (int64_t b = 0; b < K / QK; b++) {
        __m512 v0 = load16(x, bf16, b * QK), v1 = load16(x, bf16, b * QK + 16);
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(v0, sign), _mm512_and_ps(v1, sign)));
        __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        __m512i lo = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v0, inv)),
                                                       _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
        __m512i hi = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v1, inv)),
                                                       _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
        _mm_storeu_si128((__m128i *)(q + b * QK), _mm512_cvtepi32_epi8(lo));
        _mm_storeu_si128((__m128i *)(q + b * QK + 16), _mm512_cvtepi32_epi8(hi));
        d[b] = amax / 127.0f;
        sums[b] = _mm512_reduce_add_epi32(_mm512_add_epi32(lo, hi));
        s[b] = d[b] * (float)sums[b];
    }
}

static inline __m512i quad(const int8_t *xq, int64_t i) {  // 4 activations, broadcast to 16 lanes
    int32_t v;
    memcpy(&v, xq + i, 4);
    return _mm512_set1_epi32(v);
}

static inline void store16(void *y, int bf16, int64_t i, __m512 v, __mmask16 k) {
    if (!bf16) {
        _mm512_mask_storeu_ps((float *)y + i, k, v);
        return;
    }
    // round to nearest even (AVX-512 F/BW only: VNNI CPUs without the BF16 instructions run this too)
    __m512i bits = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    bits = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    _mm256_mask_storeu_epi16((uint16_t *)y + i, k, _mm512_cvtepi32_epi16(bits));
}

typedef __m512 tile_acc[MAX_ROWS][4];  // acc[r][s]: activation row r's sums for sub-tile s's 16 rows

static inline __attribute__((always_inline)) void acc_zero(tile_acc acc, int R) {
    for (int r = 0; r < R; r++)
        for (int s = 0; s < 4; s++) acc[r][s] = _mm512_setzero_ps();
}

// Record b of a tile (its 64 rows over inputs 32b .. 32b + 31) added into acc for R activation rows.
static inline __attribute__((always_inline)) void record_product(
    int bits, const uint8_t *rec, int64_t b, int64_t nb, const int8_t *xq, const float *xd, const float *xs,
    const int32_t *sums, int64_t K, int R, tile_acc acc) {
    (void)sums;
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int64_t i = 0; i < RECORD(bits); i += 64) _mm_prefetch((const char *)rec + PREFETCH + i, _MM_HINT_T0);
    const uint8_t *w = rec + 4 * TILE;
    for (int s = 0; s < 4; s++) {
        // NOTE: two sums per row (even and odd quads), so that the dependent vpdpbusd chain is half as long
        __m512i dot[MAX_ROWS], odd[MAX_ROWS];
        for (int r = 0; r < R; r++) dot[r] = odd[r] = _mm512_setzero_si512();
        if (bits == 4) {
            for (int j = 0; j < 4; j++) {
                __m512i v = _mm512_loadu_si512(w + (j * 4 + s) * 64);
                __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                for (int r = 0; r < R; r++) {
                    const int8_t *xb = xq + r * K + b * QK;
                    dot[r] = _mm512_dpbusd_epi32(dot[r], lo, quad(xb, 4 * j));
                    odd[r] = _mm512_dpbusd_epi32(odd[r], hi, quad(xb, 4 * j + 16));
                }
            }
        } else {
            for (int j = 0; j < 8; j += 2) {
                __m512i v0 = _mm512_loadu_si512(w + (j * 4 + s) * 64), v1 = _mm512_loadu_si512(w + (j * 4 + 4 + s) * 64);
                for (int r = 0; r < R; r++) {
                    dot[r] = _mm512_dpbusd_epi32(dot[r], v0, quad(xq + r * K + b * QK, 4 * j));
                    odd[r] = _mm512_dpbusd_epi32(odd[r], v1, quad(xq + r * K + b * QK, 4 * j + 4));
                }
            }
        }
        for (int r = 0; r < R; r++) dot[r] = _mm512_add_epi32(dot[r], odd[r]);
        __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + 32 * s)));
        __m512 min = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + 2 * TILE + 32 * s)));
        for (int r = 0; r < R; r++) {
            __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_set1_ps(xd[r * nb + b]));
            acc[r][s] = _mm512_fmadd_ps(min, _mm512_set1_ps(xs[r * nb + b]), _mm512_fmadd_ps(t, scale, acc[r][s]));
        }
    }
}

// Rows r0 .. r0 + R of y for tile t, from its sums.
static inline void tile_store(tile_acc acc, int R, void *y, int y_bf16, int64_t N, int64_t r0, int64_t t) {
    for (int s = 0; s < 4; s++) {
        const int64_t n = t * TILE + 16 * s;
        if (n >= N) break;
        const __mmask16 k = N - n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (N - n)) - 1);
        for (int r = 0; r < R; r++) store16(y, y_bf16, (r0 + r) * N + n, acc[r][s], k);
    }
}

// The weight's rows [n0, n1) expanded and transposed: out[K, n1 - n0] (n0 a multiple of 64), so that
// x @ out is the product; float32 or bfloat16. Each 64-byte vector (16 rows x 4 inputs) is transposed
// to 4 x 16 by one byte shuffle and one dword permute, and each input's 16 rows stored side by side.
int tiled_expand_t(int bits, const uint8_t *data, int64_t n0, int64_t n1, int64_t K, void *out, int out_bf16,
                   int nthreads) {
    if (K % QK || n0 % TILE || n1 < n0 || (bits != 4 && bits != 8)) return -1;
    const int64_t nb = K / QK, width = n1 - n0, record = RECORD(bits);
    const __m512i bytes = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15));
    const __m512i dwords = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    const __m512i low = _mm512_set1_epi8(0x0F);
#pragma omp parallel for num_threads(nthreads) schedule(static) collapse(2)
    for (int64_t t = n0 / TILE; t < (n1 + TILE - 1) / TILE; t++) {
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *rec = data + (t * nb + b) * record, *w = rec + 4 * TILE;
            for (int s = 0; s < 4; s++) {
                const int64_t n = t * TILE + 16 * s;
                if (n >= n1) break;
                const __mmask16 k = n1 - n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n1 - n)) - 1);
                __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + 32 * s)));
                __m512 min = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + 2 * TILE + 32 * s)));
                for (int j = 0; j < 8; j++) {
                    __m512i v;
                    if (bits == 4) {
                        __m512i packed = _mm512_loadu_si512(w + ((j & 3) * 4 + s) * 64);
                        v = j < 4 ? _mm512_and_si512(packed, low) : _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
                    } else {
                        v = _mm512_loadu_si512(w + (j * 4 + s) * 64);
                    }
                    uint8_t inputs[64];  // [input i: 16 rows]
                    _mm512_storeu_si512(inputs, _mm512_permutexvar_epi32(dwords, _mm512_shuffle_epi8(v, bytes)));
                    for (int i = 0; i < 4; i++) {
                        __m128i u = _mm_loadu_si128((const __m128i *)(inputs + 16 * i));
                        __m512 value = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(u)), scale, min);
                        store16(out, out_bf16, (b * QK + 4 * j + i) * width + (n - n0), value, k);
                    }
                }
            }
        }
    }
    return 0;
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "quant_tiled_avx2.h"
#endif

// Each level above supplies quantize_row, tile_acc with acc_zero, record_product and tile_store.

// A thread's run of tiles, nt (1 .. LOCK, a constant where inlined) tiles from `first` on read in lockstep, record b
// of each in turn, for activation rows r0 .. r0 + R: the thread reads nt streams at once (as gemv_one_row.h does
// for bf16: the memory system serves several sequential streams per core faster than one). A decode batch of a
// few rows is bound by reading the weight once. Each tile's sums run over its records in order: the same result
// as one tile at a time.
#define LOCK 4
static inline __attribute__((always_inline)) void lockstep_tiles(
    int bits, const uint8_t *data, int64_t nb, const int8_t *xq, const float *xd, const float *xs,
    const int32_t *sums, int64_t K, const int R, void *y, int y_bf16, int64_t N, int64_t r0, int64_t first,
    const int nt) {
    const int64_t record = RECORD(bits), tile_bytes = nb * record;
    tile_acc acc[LOCK] __attribute__((aligned(64)));
    for (int i = 0; i < nt; i++) acc_zero(acc[i], R);
    for (int64_t b = 0; b < nb; b++)
        for (int i = 0; i < nt; i++)
            record_product(bits, data + (first + i) * tile_bytes + b * record, b, nb, xq, xd, xs, sums, K, R, acc[i]);
    for (int i = 0; i < nt; i++) tile_store(acc[i], R, y, y_bf16, N, r0, first + i);
}

// One tile for rows r0 .. r0 + R (R <= MAX_ROWS), as a call of its own. NOTE: inlined into the lockstep loop
// below, this path ran 3-5% slower at 32 rows (AVX2 level, int4 and int8).
static __attribute__((noinline)) void tile_rows(
    int bits, const uint8_t *data, int64_t nb, const int8_t *xq, const float *xd, const float *xs,
    const int32_t *sums, int64_t K, int R, void *y, int y_bf16, int64_t N, int64_t r0, int64_t t) {
    switch (R) {  // NOTE: a constant R per call lets the compiler keep the sums in registers
        case 1: lockstep_tiles(bits, data, nb, xq, xd, xs, sums, K, 1, y, y_bf16, N, r0, t, 1); break;
        case 2: lockstep_tiles(bits, data, nb, xq, xd, xs, sums, K, 2, y, y_bf16, N, r0, t, 1); break;
        case 3: lockstep_tiles(bits, data, nb, xq, xd, xs, sums, K, 3, y, y_bf16, N, r0, t, 1); break;
        default: lockstep_tiles(bits, data, nb, xq, xd, xs, sums, K, 4, y, y_bf16, N, r0, t, 1); break;
    }
}

// Up to MAX_ROWS rows: one pass over each group, from activation row 0.
#define LOCK_TILES(R, nt) lockstep_tiles(bits, data, nb, xq, xd, xs, sums, K, R, y, y_bf16, N, 0, t0, nt)
#define LOCK_GROUP(R)                        \
    switch (nt) {                            \
        case 1: LOCK_TILES(R, 1); break;     \
        case 2: LOCK_TILES(R, 2); break;     \
        case 3: LOCK_TILES(R, 3); break;     \
        default: LOCK_TILES(R, 4); break;    \
    }

// All M rows: each thread takes a contiguous run of tiles and passes over each tile once per MAX_ROWS activation
// rows. Up to MAX_ROWS rows (one pass) it reads LOCK tiles at a time in lockstep. NOTE: above that, one tile at a
// time: the later passes then find it in L1, where a group of four tiles is read again from L2 (bench_tiled_rows.py
// measured lockstep slower by up to 8% from 8 rows on, for int8 at every level and for int4 at avx2).
static void tiled_rows_product(int bits, const uint8_t *data, int64_t nb, const int8_t *xq, const float *xd,
                               const float *xs, const int32_t *sums, int64_t K, int64_t M, void *y, int y_bf16,
                               int64_t N, int nthreads) {
    const int64_t tiles = (N + TILE - 1) / TILE;
#pragma omp parallel num_threads(nthreads)
    {
        const int64_t threads = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t lo = tiles * me / threads, hi = tiles * (me + 1) / threads;  // NOTE: near-equal runs
        if (M <= MAX_ROWS) {
            for (int64_t t0 = lo; t0 < hi; t0 += LOCK) {
                const int nt = hi - t0 < LOCK ? (int)(hi - t0) : LOCK;
                switch (M) {  // NOTE: constant rows and tiles per call keep the sums in registers where they fit
                    case 1: LOCK_GROUP(1); break;
                    case 2: LOCK_GROUP(2); break;
                    case 3: LOCK_GROUP(3); break;
                    default: LOCK_GROUP(4); break;
                }
            }
        } else {
            for (int64_t t = lo; t < hi; t++)
                for (int64_t r0 = 0; r0 < M; r0 += MAX_ROWS)
                    tile_rows(bits, data, nb, xq + r0 * K, xd + r0 * nb, xs + r0 * nb, sums + r0 * nb, K,
                              M - r0 < MAX_ROWS ? (int)(M - r0) : MAX_ROWS, y, y_bf16, N, r0, t);
        }
    }
}

// y[M, N] = x[M, K] @ W^T; data: the tiled weight of N (padded to 64) rows.
int tiled_matmul(int bits, const uint8_t *data, const void *x, int x_bf16, void *y, int y_bf16, int64_t M,
                 int64_t N, int64_t K, int nthreads) {
    if (K % QK || M < 1 || N < 1 || (bits != 4 && bits != 8)) return -1;
    const int64_t nb = K / QK;
    int8_t *xq = malloc((size_t)(M * K));
    float *xd = malloc(sizeof(float) * M * nb), *xs = malloc(sizeof(float) * M * nb);
    int32_t *sums = malloc(sizeof(int32_t) * M * nb);
    if (!xq || !xd || !xs || !sums) { free(xq); free(xd); free(xs); free(sums); return -4; }
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M >= 8)
    for (int64_t r = 0; r < M; r++)
        quantize_row((const char *)x + r * K * (x_bf16 ? 2 : 4), x_bf16, K, xq + r * K, xd + r * nb, xs + r * nb,
                     sums + r * nb);
    tiled_rows_product(bits, data, nb, xq, xd, xs, sums, K, M, y, y_bf16, N, nthreads);
    free(xq); free(xd); free(xs); free(sums);
    return 0;
}

// Rows `rows[0..count)` expanded: out[count, K] (an embedding lookup); float32 or bfloat16.
int tiled_rows(int bits, const uint8_t *data, const int64_t *rows, int64_t count, int64_t N, int64_t K, void *out,
               int out_bf16, int nthreads) {
    if (K % QK || (bits != 4 && bits != 8)) return -1;
    const int64_t nb = K / QK, record = RECORD(bits);
    int status = 0;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t c = 0; c < count; c++) {
        const int64_t n = rows[c];
        if (n < 0 || n >= N) {
#pragma omp atomic write
            status = -2;
            continue;
        }
        const int64_t t = n / TILE, s = (n % TILE) / 16, row = n % 16, lane = n % TILE;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *rec = data + (t * nb + b) * record, *w = rec + 4 * TILE;
            uint16_t sh, mh;
            memcpy(&sh, rec + 2 * lane, 2);
            memcpy(&mh, rec + 2 * TILE + 2 * lane, 2);
            const float scale = _cvtsh_ss(sh), min = _cvtsh_ss(mh);
            float v[QK];
            for (int i = 0; i < QK; i++) {
                const int q = i / 4;
                int u;
                if (bits == 4) {
                    const uint8_t byte = w[((q & 3) * 4 + s) * 64 + 4 * row + i % 4];
                    u = q < 4 ? byte & 0x0F : byte >> 4;
                } else {
                    u = w[(q * 4 + s) * 64 + 4 * row + i % 4];
                }
                v[i] = scale * (float)u + min;
            }
            for (int i = 0; i < QK; i++) {
                const int64_t at = c * K + b * QK + i;
                if (out_bf16) {
                    ((uint16_t *)out)[at] = f32_to_bf16(v[i]);
                } else {
                    ((float *)out)[at] = v[i];
                }
            }
        }
    }
    return status;
}

// The product for C callers with the decode step's linear signature (decode_loop.h): `w` is the descriptor
// {bits, address of the tiled data} (int64; models/decode_step.py builds it); a bias is added to the product
// after it is stored, as the Python path adds it.
static int tiled_linear(const int64_t *w, const void *x, const void *bias, void *y, int bf16, int64_t M, int64_t N,
                        int64_t K, int nthreads) {
    const int status = tiled_matmul((int)w[0], (const uint8_t *)(intptr_t)w[1], x, bf16, y, bf16, M, N, K, nthreads);
    if (status || !bias) return status;
    for (int64_t i = 0; i < M * N; i++) {
        if (bf16) {
            uint16_t *out = (uint16_t *)y + i;
            const uint32_t a = (uint32_t)*out << 16, b = (uint32_t)((const uint16_t *)bias)[i % N] << 16;
            float fa, fb;
            memcpy(&fa, &a, 4);
            memcpy(&fb, &b, 4);
            *out = f32_to_bf16(fa + fb);
        } else {
            ((float *)y)[i] += ((const float *)bias)[i % N];
        }
    }
    return 0;
}

int tiled_linear_f32(const int64_t *w, const float *x, const float *bias, float *y, int64_t M, int64_t N, int64_t K,
                     int nthreads) {
    return tiled_linear(w, x, bias, y, 0, M, N, K, nthreads);
}

int tiled_linear_bf16(const int64_t *w, const uint16_t *x, const uint16_t *bias, uint16_t *y, int64_t M, int64_t N,
                      int64_t K, int nthreads) {
    return tiled_linear(w, x, bias, y, 1, M, N, K, nthreads);
}

const char *tiled_isa(void) { return TILED_ISA; }
