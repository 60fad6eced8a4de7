// Matrix products with packed low-bit weights: y[M, N] = x[M, K] @ W[N, K]^T.
//
// Weight formats (blocks of 32 along K, as GGUF's Q8_0 / Q4_0 / Q4_1):
//   int8: q int8 [N, K], scale f16 [N, G] with G = K / 32 (one scale per block) or G = 1 (one per
//         output channel); w = scale * q. NOTE: q lies in [-127, 127] (the AVX2 path relies on it).
//   int4: q uint8 [N, K / 2], scale f16 [N, K / 32], min f16 [N, K / 32]; byte j of a block holds
//         element j in its low nibble and element j + 16 in its high nibble; w = scale * q + min.
//
// Small M (decode): the activations are quantized per block of 32 to int8 (scale d, and s = d * sum q),
// then each weight row is dotted against up to four activation rows with integer dot products:
// AVX-512 VNNI (vpdpbusd, two blocks at a time), AVX2 (maddubs/madd, or AVX-VNNI when compiled with
// it), or portable C. Per block: int4 contributes scale * d * sum(q_w * q_x) + min * s, int8
// scale * d * sum(q_w * q_x).
// Large M (prefill): `dequant_*` expands the weights to float32 or bfloat16 rows and the caller
// multiplies with a dense GEMM.
//
// Every entry returns 0, or a negative code for shapes it does not take.

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define QK 32
#define MAX_ROWS 4

static inline float f16_to_f32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0) {
        if (man == 0) { bits = sign; }
        else {  // subnormal: renormalise
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 0x3FF) << 13);
        }
    } else if (exp == 31) { bits = sign | 0x7F800000u | (man << 13); }
    else { bits = sign | ((exp + 127 - 15) << 23) | (man << 13); }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

static inline float bf16_to_f32(uint16_t b) {
    uint32_t bits = (uint32_t)b << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    uint32_t rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16;  // round to nearest even
    uint32_t nan = (bits >> 16) | 0x40;                               // keep NaN a (quiet) NaN
    return (uint16_t)((bits & 0x7FFFFFFFu) > 0x7F800000u ? nan : rounded);
}

// ---- activations: one row of K values -> int8 blocks, d[b], s[b] = d[b] * sum(q) ----

#include "quant_activations.h"

// ---- per (weight row, activation row) block factors ----

// The weight row's block scales (and int4 mins) as float32: ws[nb], wm[nb].
static inline void row_scales(const uint16_t *scale, const uint16_t *mins, int64_t groups, int64_t nb,
                              float *ws, float *wm) {
    int64_t b = 0;
    if (groups == 1) {
        float w = f16_to_f32(scale[0]);
        for (; b < nb; b++) ws[b] = w;
    } else {
#if defined(__AVX512F__)
        for (; b + 16 <= nb; b += 16)
            _mm512_storeu_ps(ws + b, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scale + b))));
#endif
        for (; b < nb; b++) ws[b] = f16_to_f32(scale[b]);
    }
    if (mins) {
        b = 0;
#if defined(__AVX512F__)
        for (; b + 16 <= nb; b += 16)
            _mm512_storeu_ps(wm + b, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mins + b))));
#endif
        for (; b < nb; b++) wm[b] = f16_to_f32(mins[b]);
    }
}

// c[b] = ws[b] * d[b]; returns sum over blocks of wm[b] * s[b] (int4; 0 without mins).
static inline float block_factors(const float *ws, const float *wm, int64_t nb, const float *d, const float *s,
                                  float *c) {
    float m = 0.0f;
    int64_t b = 0;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    for (; b + 16 <= nb; b += 16) {
        _mm512_storeu_ps(c + b, _mm512_mul_ps(_mm512_loadu_ps(ws + b), _mm512_loadu_ps(d + b)));
        if (wm) acc = _mm512_fmadd_ps(_mm512_loadu_ps(wm + b), _mm512_loadu_ps(s + b), acc);
    }
    if (b < nb) {
        __mmask16 k = (__mmask16)((1u << (nb - b)) - 1);
        _mm512_mask_storeu_ps(c + b, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, ws + b), _mm512_maskz_loadu_ps(k, d + b)));
        if (wm) acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, wm + b), _mm512_maskz_loadu_ps(k, s + b), acc);
        b = nb;
    }
    m = _mm512_reduce_add_ps(acc);
#endif
    for (; b < nb; b++) {
        c[b] = ws[b] * d[b];
        if (wm) m += wm[b] * s[b];
    }
    return m;
}

// ---- dot products of one weight row with R activation rows ----

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define QM_ISA "avx512_vnni"

static inline __m512 pair_scale(const float *c) {  // [c0 x 8, c1 x 8]
    const __m512i idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    __m128 two = _mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)c));
    return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(two));
}

static inline __attribute__((always_inline)) void dot_int4(
    const uint8_t *w, int64_t nb, const int8_t *const *xq, float *const *c, int R, float *out) {
    __m512 acc[MAX_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    const __m256i low = _mm256_set1_epi8(0x0F);
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(w + b * QK / 2));  // [blk b | blk b+1], 16 bytes each
        __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        __m512i wv = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);  // [lo b, lo b+1, hi b, hi b+1]
        wv = _mm512_shuffle_i64x2(wv, wv, _MM_SHUFFLE(3, 1, 2, 0));           // [lo b, hi b, lo b+1, hi b+1]
        for (int r = 0; r < R; r++) {
            __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, _mm512_loadu_si512(xq[r] + b * QK));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), pair_scale(c[r] + b), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = _mm512_reduce_add_ps(acc[r]);
    for (; b < nb; b++) {  // an odd last block
        for (int r = 0; r < R; r++) {
            int sum = 0;
            for (int j = 0; j < QK / 2; j++) {
                uint8_t byte = w[b * QK / 2 + j];
                sum += (byte & 0x0F) * xq[r][b * QK + j] + (byte >> 4) * xq[r][b * QK + j + QK / 2];
            }
            out[r] += c[r][b] * (float)sum;
        }
    }
}

static inline __attribute__((always_inline)) void dot_int8(
    const int8_t *w, int64_t nb, const int8_t *const *xq, float *const *c, int R, float *out) {
    // vpdpbusd takes unsigned x signed bytes: w ^ 0x80 = w + 128 (unsigned), and the extra 128 * sum(x)
    // is taken off with a second vpdpbusd of 128s against x.
    __m512 acc[MAX_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        __m512i wv = _mm512_xor_si512(_mm512_loadu_si512(w + b * QK), flip);
        for (int r = 0; r < R; r++) {
            __m512i xv = _mm512_loadu_si512(xq[r] + b * QK);
            __m512i p = _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, xv),
                                         _mm512_dpbusd_epi32(_mm512_setzero_si512(), flip, xv));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), pair_scale(c[r] + b), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = _mm512_reduce_add_ps(acc[r]);
    for (; b < nb; b++) {
        for (int r = 0; r < R; r++) {
            int sum = 0;
            for (int j = 0; j < QK; j++) sum += w[b * QK + j] * xq[r][b * QK + j];
            out[r] += c[r][b] * (float)sum;
        }
    }
}

#elif defined(__AVX2__) && defined(__FMA__)
#if defined(__AVXVNNI__)
#define QM_ISA "avx_vnni"
#define DOT_U8_S8(u, s) _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), (u), (s))
#else
#define QM_ISA "avx2"
#define DOT_U8_S8(u, s) _mm256_madd_epi16(_mm256_maddubs_epi16((u), (s)), _mm256_set1_epi16(1))
#endif

static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __attribute__((always_inline)) void dot_int4(
    const uint8_t *w, int64_t nb, const int8_t *const *xq, float *const *c, int R, float *out) {
    __m256 acc[MAX_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    const __m128i low = _mm_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; b++) {
        __m128i v = _mm_loadu_si128((const __m128i *)(w + b * QK / 2));
        __m256i wv = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low), _mm_and_si128(v, low));
        for (int r = 0; r < R; r++) {
            // NOTE: maddubs cannot saturate here: 15 * 127 * 2 < 32767.
            __m256i p = DOT_U8_S8(wv, _mm256_loadu_si256((const __m256i *)(xq[r] + b * QK)));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(c[r][b]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum256(acc[r]);
}

static inline __attribute__((always_inline)) void dot_int8(
    const int8_t *w, int64_t nb, const int8_t *const *xq, float *const *c, int R, float *out) {
    // |x| (unsigned) times w carrying x's sign; exact because both lie in [-127, 127].
    __m256 acc[MAX_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i wv = _mm256_loadu_si256((const __m256i *)(w + b * QK));
        for (int r = 0; r < R; r++) {
            __m256i xv = _mm256_loadu_si256((const __m256i *)(xq[r] + b * QK));
            __m256i p = DOT_U8_S8(_mm256_sign_epi8(xv, xv), _mm256_sign_epi8(wv, xv));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(c[r][b]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum256(acc[r]);
}

#else
#define QM_ISA "portable"

static inline void dot_int4(const uint8_t *w, int64_t nb, const int8_t *const *xq, float *const *c, int R,
                            float *out) {
    for (int r = 0; r < R; r++) {
        float total = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            int sum = 0;
            for (int j = 0; j < QK / 2; j++) {
                uint8_t byte = w[b * QK / 2 + j];
                sum += (byte & 0x0F) * xq[r][b * QK + j] + (byte >> 4) * xq[r][b * QK + j + QK / 2];
            }
            total += c[r][b] * (float)sum;
        }
        out[r] = total;
    }
}

static inline void dot_int8(const int8_t *w, int64_t nb, const int8_t *const *xq, float *const *c, int R,
                            float *out) {
    for (int r = 0; r < R; r++) {
        float total = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            int sum = 0;
            for (int j = 0; j < QK; j++) sum += w[b * QK + j] * xq[r][b * QK + j];
            total += c[r][b] * (float)sum;
        }
        out[r] = total;
    }
}
#endif

const char *quant_isa(void) { return QM_ISA; }

static inline void store_y(void *y, int bf16, int64_t i, float v) {
    if (bf16) ((uint16_t *)y)[i] = f32_to_bf16(v);
    else ((float *)y)[i] = v;
}

// Weights are read once per product, front to back; the hardware prefetcher stops at each 4 KiB page, so
// the row PREFETCH bytes ahead is requested here (measured ~2x faster on weights that come from memory).
#define PREFETCH 4096

static inline void prefetch_ahead(const char *row, int64_t row_bytes) {
    for (int64_t i = 0; i < row_bytes; i += 64) __builtin_prefetch(row + PREFETCH + i, 0, 3);
}

// One weight row n against activation rows r0 .. r0 + R - 1.
static inline __attribute__((always_inline)) void row_block(
    int bits, const void *w_row, const float *ws, const float *wm, int64_t nb,
    const int8_t *xq, const float *xd, const float *xs, int64_t K, int64_t r0, int R, float *cbuf,
    float *out) {
    const int8_t *xr[MAX_ROWS];
    float *cr[MAX_ROWS], m[MAX_ROWS];
    for (int r = 0; r < R; r++) {
        xr[r] = xq + (r0 + r) * K;
        cr[r] = cbuf + r * nb;
        m[r] = block_factors(ws, wm, nb, xd + (r0 + r) * nb, xs + (r0 + r) * nb, cr[r]);
    }
    if (bits == 4) dot_int4((const uint8_t *)w_row, nb, xr, cr, R, out);
    else dot_int8((const int8_t *)w_row, nb, xr, cr, R, out);
    for (int r = 0; r < R; r++) out[r] += m[r];
}

// y[M, N] = x[M, K] @ dequant(W)^T. bits 4 or 8; groups = scales per row (K / 32, or 1 for int8).
int quant_matmul(int bits, const void *w, const uint16_t *scale, const uint16_t *mins, int64_t groups,
                 const void *x, int x_bf16, void *y, int y_bf16, int64_t M, int64_t N, int64_t K, int nthreads) {
    if (K % QK || M < 1 || N < 1 || (bits != 4 && bits != 8)) return -1;
    int64_t nb = K / QK;
    if (groups != nb && !(bits == 8 && groups == 1)) return -2;
    if (bits == 4 && !mins) return -3;
    int8_t *xq = aligned_alloc(64, (size_t)((M * K + 127) / 64 * 64));
    float *xd = malloc(sizeof(float) * M * nb), *xs = malloc(sizeof(float) * M * nb);
    if (!xq || !xd || !xs) { free(xq); free(xd); free(xs); return -4; }
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M >= 8)
    for (int64_t r = 0; r < M; r++)
        quantize_row((const char *)x + r * K * (x_bf16 ? 2 : 4), x_bf16, K, xq + r * K, xd + r * nb, xs + r * nb,
                     NULL);
    int64_t row_bytes = bits == 4 ? K / 2 : K;
    int status = 0;
#pragma omp parallel num_threads(nthreads)
    {
        float *cbuf = malloc(sizeof(float) * (MAX_ROWS + 2) * nb);
        if (!cbuf) {
#pragma omp atomic write
            status = -4;
        }
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            if (!cbuf) continue;
            const char *w_row = (const char *)w + n * row_bytes;
            prefetch_ahead(w_row, row_bytes);
            float *ws = cbuf + MAX_ROWS * nb, *wm = mins ? ws + nb : NULL;
            row_scales(scale + n * groups, mins ? mins + n * nb : NULL, groups, nb, ws, wm);
            float out[MAX_ROWS];
            int64_t r0 = 0;
            for (; r0 + MAX_ROWS <= M; r0 += MAX_ROWS) {
                row_block(bits, w_row, ws, wm, nb, xq, xd, xs, K, r0, MAX_ROWS, cbuf, out);
                for (int r = 0; r < MAX_ROWS; r++) store_y(y, y_bf16, (r0 + r) * N + n, out[r]);
            }
            int rest = (int)(M - r0);
            if (rest == 1) row_block(bits, w_row, ws, wm, nb, xq, xd, xs, K, r0, 1, cbuf, out);
            else if (rest == 2) row_block(bits, w_row, ws, wm, nb, xq, xd, xs, K, r0, 2, cbuf, out);
            else if (rest == 3) row_block(bits, w_row, ws, wm, nb, xq, xd, xs, K, r0, 3, cbuf, out);
            for (int r = 0; r < rest; r++) store_y(y, y_bf16, (r0 + r) * N + n, out[r]);
        }
        free(cbuf);
    }
    free(xq); free(xd); free(xs);
    return status;
}

// ---- dequantization of rows [n0, n1) into out[(n1 - n0), K] (float32 or bfloat16) ----

#if defined(__AVX512F__) && defined(__AVX512BW__)
static inline void put16(void *out, int bf16, int64_t i, __m512 v) {
    if (!bf16) { _mm512_storeu_ps((float *)out + i, v); return; }
    __m512i bits = _mm512_castps_si512(v);  // round to nearest even (weights are finite)
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    bits = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    _mm256_storeu_si256((__m256i *)((uint16_t *)out + i), _mm512_cvtepi32_epi16(bits));
}

static inline void dequant_block(int bits, const void *q, float sc, float mn, void *out, int bf16, int64_t i) {
    __m512 vs = _mm512_set1_ps(sc), vm = _mm512_set1_ps(mn);
    if (bits == 4) {
        __m128i v = _mm_loadu_si128((const __m128i *)q), low = _mm_set1_epi8(0x0F);
        __m128i lo = _mm_and_si128(v, low), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low);
        put16(out, bf16, i, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), vs, vm));
        put16(out, bf16, i + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)), vs, vm));
    } else {
        __m256i v = _mm256_loadu_si256((const __m256i *)q);
        put16(out, bf16, i, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(v))), vs));
        put16(out, bf16, i + 16, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(v, 1))), vs));
    }
}
#else
static inline void dequant_block(int bits, const void *q, float sc, float mn, void *out, int bf16, int64_t i) {
    float v[QK];
    if (bits == 4) {
        for (int j = 0; j < QK / 2; j++) {
            v[j] = sc * (float)(((const uint8_t *)q)[j] & 0x0F) + mn;
            v[j + QK / 2] = sc * (float)(((const uint8_t *)q)[j] >> 4) + mn;
        }
    } else {
        for (int j = 0; j < QK; j++) v[j] = sc * (float)((const int8_t *)q)[j];
    }
    if (bf16) { for (int j = 0; j < QK; j++) ((uint16_t *)out)[i + j] = f32_to_bf16(v[j]); }
    else memcpy((float *)out + i, v, sizeof(float) * QK);
}
#endif

int dequant_rows(int bits, const void *w, const uint16_t *scale, const uint16_t *mins, int64_t groups,
                 int64_t n0, int64_t n1, int64_t K, void *out, int out_bf16, int nthreads) {
    if (K % QK || (bits != 4 && bits != 8) || n1 < n0) return -1;
    int64_t nb = K / QK;
    if (groups != nb && !(bits == 8 && groups == 1)) return -2;
    if (bits == 4 && !mins) return -3;
    int64_t row_bytes = bits == 4 ? K / 2 : K;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = n0; n < n1; n++) {
        for (int64_t b = 0; b < nb; b++) {
            float sc = f16_to_f32(scale[n * groups + (groups == 1 ? 0 : b)]);
            float mn = bits == 4 ? f16_to_f32(mins[n * nb + b]) : 0.0f;
            dequant_block(bits, (const char *)w + n * row_bytes + b * QK * bits / 8, sc, mn, out, out_bf16,
                          (n - n0) * K + b * QK);
        }
    }
    return 0;
}
