// The AVX2 and AVX-VNNI section of quant_tiled.c (included there, inside its level switch; not a header of its
// own): the tiled layout's product and expansion on 256-bit vectors.
// AVX2 (and AVX-VNNI): the same layout read in 32-byte halves, 8 rows x 4 inputs each (half h of a 64-byte
// vector holds rows 8h..8h+7 of its sub-tile). With AVX-VNNI, vpdpbusd on 256 bits, as above. Without it,
// vpmaddubsw multiplies unsigned weights by signed activations and adds pairs into int16, vpmaddwd adds those
// pairs into each row's int32 lane:
//   int4: u <= 15, so each int16 lane is at most 2 * 15 * 127 and the eight of a block add up without overflow
//         before one vpmaddwd;
//   int8: u = q + 128 would overflow int16 (2 * 255 * 127), so the signed q = u ^ 0x80 is used as
//         |q| x sign(x, q), and the block's dot(u, x) is dot(q, x) + 128 * sum(x).
// Either way the integer dot per block and row is the same as vpdpbusd's, and the float steps after it are the
// AVX-512 path's, lane for lane: every level gives the same result.
#if defined(__AVXVNNI__)
#define TILED_ISA "avx_vnni"
#else
#define TILED_ISA "avx2"
#endif

#include "quant_activations.h"  // quantize_row, as quant_matmul.c rounds the activations

static inline __m256i quad8(const int8_t *xq, int64_t i) {  // 4 activations, broadcast to 8 lanes
    int32_t v;
    memcpy(&v, xq + i, 4);
    return _mm256_set1_epi32(v);
}

// The 8 weight vectors of 8 rows (half h of sub-tile s) over one block, ready for the products: int4 as
// u[j] = quad j's nibbles (j < 4: low, else high) against quad j' = (j < 4 ? 4j : 4(j - 4) + 16) of x; int8 as
// the bytes of quad j (u = q + 128; without VNNI the signed q = u ^ 0x80). Unpacked once per block, used by
// every activation row.
static inline __attribute__((always_inline)) void unpack_half(int bits, const uint8_t *w, int s, int h, __m256i *u) {
    const __m256i low = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8((char)0x80);
    for (int j = 0; j < (bits == 4 ? 4 : 8); j++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(w + (j * 4 + s) * 64 + 32 * h));
        if (bits == 4) {
            u[j] = _mm256_and_si256(v, low);
            u[j + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        } else {
#if defined(__AVXVNNI__)
            u[j] = v;
            (void)flip;
#else
            u[j] = _mm256_xor_si256(v, flip);
#endif
        }
    }
}

// The int32 dot of the unpacked 8 rows with one activation row over the block (xb: its 32 int8 values; sum:
// their integer sum).
static inline __attribute__((always_inline)) __m256i half_dot(int bits, const __m256i *u, const int8_t *xb,
                                                              int32_t sum) {
    if (bits == 4) {
#if defined(__AVXVNNI__)
        __m256i dot = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            dot = _mm256_dpbusd_avx_epi32(dot, u[j], quad8(xb, 4 * j));
            dot = _mm256_dpbusd_avx_epi32(dot, u[j + 4], quad8(xb, 4 * j + 16));
        }
        return dot;
#else
        __m256i pairs = _mm256_setzero_si256();  // int16: at most 8 * 2 * 15 * 127
        for (int j = 0; j < 4; j++) {
            pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(u[j], quad8(xb, 4 * j)));
            pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(u[j + 4], quad8(xb, 4 * j + 16)));
        }
        return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
#endif
    }
#if defined(__AVXVNNI__)
    (void)sum;
    __m256i dot = _mm256_setzero_si256();
    for (int j = 0; j < 8; j++) dot = _mm256_dpbusd_avx_epi32(dot, u[j], quad8(xb, 4 * j));
    return dot;
#else
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i dot = _mm256_set1_epi32(128 * sum);
    for (int j = 0; j < 8; j++) {
        const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(u[j]), _mm256_sign_epi8(quad8(xb, 4 * j), u[j]));
        dot = _mm256_add_epi32(dot, _mm256_madd_epi16(p, ones));
    }
    return dot;
#endif
}

typedef float tile_acc[MAX_ROWS][TILE];  // acc[r][row]: activation row r's sums for the tile's 64 rows

static inline __attribute__((always_inline)) void acc_zero(tile_acc acc, int R) {
    memset(acc, 0, sizeof(float) * (size_t)R * TILE);
}

// Record b of a tile (its 64 rows over inputs 32b .. 32b + 31) added into acc for R activation rows.
static inline __attribute__((always_inline)) void record_product(
    int bits, const uint8_t *rec, int64_t b, int64_t nb, const int8_t *xq, const float *xd, const float *xs,
    const int32_t *sums, int64_t K, int R, tile_acc acc) {
    for (int64_t i = 0; i < RECORD(bits); i += 64) _mm_prefetch((const char *)rec + PREFETCH + i, _MM_HINT_T0);
    const uint8_t *w = rec + 4 * TILE;
    for (int s = 0; s < 4; s++)
        for (int h = 0; h < 2; h++) {
            const int row = 16 * s + 8 * h;
            const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + 2 * row)));
            const __m256 min = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + 2 * TILE + 2 * row)));
            __m256i u[8];
            unpack_half(bits, w, s, h, u);
            for (int r = 0; r < R; r++) {
                const __m256i dot = half_dot(bits, u, xq + r * K + b * QK, sums[r * nb + b]);
                const __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(xd[r * nb + b]));
                __m256 a = _mm256_loadu_ps(acc[r] + row);
                a = _mm256_fmadd_ps(min, _mm256_set1_ps(xs[r * nb + b]), _mm256_fmadd_ps(t, scale, a));
                _mm256_storeu_ps(acc[r] + row, a);
            }
        }
}

// Rows r0 .. r0 + R of y for tile t, from its sums.
static inline void tile_store(tile_acc acc, int R, void *y, int y_bf16, int64_t N, int64_t r0, int64_t t) {
    const int64_t valid = N - t * TILE < TILE ? N - t * TILE : TILE;
    for (int r = 0; r < R; r++) {
        const int64_t at = (r0 + r) * N + t * TILE;
        if (y_bf16)
            for (int64_t i = 0; i < valid; i++) ((uint16_t *)y)[at + i] = f32_to_bf16(acc[r][i]);
        else
            memcpy((float *)y + at, acc[r], sizeof(float) * (size_t)valid);
    }
}

// Up to 8 values (`valid`) to out[at..], float32 or bf16 (rounded to nearest even).
static inline void store8(void *out, int bf16, int64_t at, __m256 v, int64_t valid) {
    if (!bf16) {
        if (valid == 8) _mm256_storeu_ps((float *)out + at, v);
        else { float tmp[8]; _mm256_storeu_ps(tmp, v); memcpy((float *)out + at, tmp, sizeof(float) * (size_t)valid); }
        return;
    }
    __m256i bits = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    bits = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
    if (valid == 8) _mm_storeu_si128((__m128i *)((uint16_t *)out + at), packed);
    else { uint16_t tmp[8]; _mm_storeu_si128((__m128i *)tmp, packed); memcpy((uint16_t *)out + at, tmp, 2 * (size_t)valid); }
}

// The weight's rows [n0, n1) expanded and transposed: out[K, n1 - n0] (n0 a multiple of 64), as the AVX-512
// path (value = u * scale + min, fused). Each 32-byte half (8 rows x 4 inputs) is transposed to 4 x 8 by one
// byte shuffle and one dword permute, and each input's 8 rows stored side by side.
int tiled_expand_t(int bits, const uint8_t *data, int64_t n0, int64_t n1, int64_t K, void *out, int out_bf16,
                   int nthreads) {
    if (K % QK || n0 % TILE || n1 < n0 || (bits != 4 && bits != 8)) return -1;
    const int64_t nb = K / QK, width = n1 - n0, record = RECORD(bits);
    const __m256i bytes = _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15,
                                           0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    const __m256i dwords = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7), low = _mm256_set1_epi8(0x0F);
#pragma omp parallel for num_threads(nthreads) schedule(static) collapse(2)
    for (int64_t t = n0 / TILE; t < (n1 + TILE - 1) / TILE; t++) {
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *rec = data + (t * nb + b) * record, *w = rec + 4 * TILE;
            for (int row = 0; row < TILE; row += 8) {
                const int64_t n = t * TILE + row;
                if (n >= n1) break;
                const int64_t valid = n1 - n < 8 ? n1 - n : 8;
                const int s = row / 16, h = (row % 16) / 8;
                const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + 2 * row)));
                const __m256 min = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + 2 * TILE + 2 * row)));
                for (int j = 0; j < 8; j++) {
                    __m256i v;
                    if (bits == 4) {
                        const __m256i packed = _mm256_loadu_si256((const __m256i *)(w + ((j & 3) * 4 + s) * 64 + 32 * h));
                        v = j < 4 ? _mm256_and_si256(packed, low) : _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
                    } else {
                        v = _mm256_loadu_si256((const __m256i *)(w + (j * 4 + s) * 64 + 32 * h));
                    }
                    uint8_t inputs[32];  // [input i: 8 rows]
                    _mm256_storeu_si256((__m256i *)inputs, _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(v, bytes), dwords));
                    for (int i = 0; i < 4; i++) {
                        const __m256i u = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(inputs + 8 * i)));
                        store8(out, out_bf16, (b * QK + 4 * j + i) * width + (n - n0),
                               _mm256_fmadd_ps(_mm256_cvtepi32_ps(u), scale, min), valid);
                    }
                }
            }
        }
    }
    return 0;
}
