/* One vector interface over the two x86 vector levels the kernels are written for, so that each kernel
 * is written once: `vf` holds SIMD_WIDTH float32 lanes (AVX-512: 16, AVX2 + FMA: 8). The level is the
 * one the object is compiled for (native.py passes its -m flags); without either, SIMD_WIDTH is not
 * defined and the kernels use the portable loop of attention_common.h.
 *
 * exp for x <= 0 is Cephes expf's range reduction and polynomial; 2^n is applied with scalef
 * (AVX-512) or by building the exponent bits (AVX2; n >= -126 after the clamp, so 2^n is normal).
 */
#ifndef RADIXSERVE_SIMD_H
#define RADIXSERVE_SIMD_H

#include "attention_common.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#include <immintrin.h>
#define SIMD_WIDTH 16
typedef __m512 vf;
typedef __m512i vi;
typedef __mmask16 vmask;

static inline vf vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf vf_set1(float x) { return _mm512_set1_ps(x); }
static inline vf vf_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void vf_store(float *p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf vf_load_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vf_max(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf vf_min(vf a, vf b) { return _mm512_min_ps(a, b); }
static inline vf vf_div(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline vf vf_fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vf_fnmadd(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }
static inline float vf_hsum(vf v) { return _mm512_reduce_add_ps(v); }
static inline float vf_hmax(vf v) { return _mm512_reduce_max_ps(v); }
static inline vf vf_round(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf vf_times_pow2(vf p, vf n) { return _mm512_scalef_ps(p, n); }
static inline vi vi_load(const int32_t *p) { return _mm512_loadu_si512(p); }
/* Lanes r with t < limit[r]. */
static inline vmask vm_before(int64_t t, vi limit) { return _mm512_cmplt_epi32_mask(_mm512_set1_epi32((int)t), limit); }
/* Lanes r with low[r] <= t < limit[r]. */
static inline vmask vm_within(int64_t t, vi low, vi limit) {
    const __m512i tv = _mm512_set1_epi32((int)t);
    return _mm512_cmplt_epi32_mask(tv, limit) & _mm512_cmpge_epi32_mask(tv, low);
}
/* Lanes r < k. */
static inline vmask vm_first(int64_t k) { return k >= 16 ? (vmask)0xFFFF : (vmask)((1u << k) - 1u); }
static inline vf vf_select(vmask m, vf a, vf b) { return _mm512_mask_mov_ps(b, m, a); } /* m ? a : b */

/* out[i] = sum of v[i]'s lanes, i < 8. */
static inline void vf_sums8(const vf *v, float *out) {
    __m256 h[8];
    for (int i = 0; i < 8; i++) h[i] = _mm256_add_ps(_mm512_castps512_ps256(v[i]), _mm512_extractf32x8_ps(v[i], 1));
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3]));
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(h[4], h[5]), _mm256_hadd_ps(h[6], h[7]));
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31)));
}

/* Lane i = OP over v[i]'s sixteen lanes, for sixteen vectors at once: a transposing tree of 15
 * shuffle-and-OP steps instead of sixteen horizontal reductions. */
#define DEFINE_FOLD16(NAME, OP)                                                                            \
    static inline __m512 NAME(const __m512 *v) {                                                          \
        __m512 r8[8], r4[4], r2[2];                                                                       \
        for (int i = 0; i < 8; i++) /* lanes 0-7: v[2i] folded to 8 partials; 8-15: v[2i + 1] */         \
            r8[i] = OP(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44), _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE)); \
        for (int i = 0; i < 4; i++) /* 128-bit lane k: 4 partials of v[4i + k] */                          \
            r4[i] = OP(_mm512_shuffle_f32x4(r8[2 * i], r8[2 * i + 1], 0x88), _mm512_shuffle_f32x4(r8[2 * i], r8[2 * i + 1], 0xDD)); \
        for (int i = 0; i < 2; i++) /* lane k: 2 partials each of v[8i + k], v[8i + 4 + k] */              \
            r2[i] = OP(_mm512_shuffle_ps(r4[2 * i], r4[2 * i + 1], 0x88), _mm512_shuffle_ps(r4[2 * i], r4[2 * i + 1], 0xDD)); \
        /* position 4k + j holds v[k + 4j]'s result */                                                     \
        const __m512 w = OP(_mm512_shuffle_ps(r2[0], r2[1], 0x88), _mm512_shuffle_ps(r2[0], r2[1], 0xDD)); \
        return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), w); \
    }
DEFINE_FOLD16(vf_sum16, _mm512_add_ps)
DEFINE_FOLD16(vf_max16, _mm512_max_ps)

#if defined(__AVX512BF16__)
#define HAVE_AVX512_BF16 1 /* vdpbf16ps: bf16 pairs multiplied exactly, summed in float32 */
#endif

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SIMD_WIDTH 8
typedef __m256 vf;
typedef __m256i vi;
typedef __m256 vmask; /* all-ones lanes */

static inline vf vf_zero(void) { return _mm256_setzero_ps(); }
static inline vf vf_set1(float x) { return _mm256_set1_ps(x); }
static inline vf vf_load(const float *p) { return _mm256_loadu_ps(p); }
static inline void vf_store(float *p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf vf_load_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline vf vf_add(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vf_max(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline vf vf_min(vf a, vf b) { return _mm256_min_ps(a, b); }
static inline vf vf_div(vf a, vf b) { return _mm256_div_ps(a, b); }
static inline vf vf_fmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vf_fnmadd(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
static inline float vf_hsum(vf v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}
static inline float vf_hmax(vf v) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}
static inline vf vf_round(vf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf vf_times_pow2(vf p, vf n) {
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
static inline vi vi_load(const int32_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline vmask vm_before(int64_t t, vi limit) {
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(limit, _mm256_set1_epi32((int)t)));
}
static inline vmask vm_within(int64_t t, vi low, vi limit) {
    const __m256i tv = _mm256_set1_epi32((int)t);
    return _mm256_castsi256_ps(_mm256_andnot_si256(_mm256_cmpgt_epi32(low, tv), _mm256_cmpgt_epi32(limit, tv)));
}
static inline vmask vm_first(int64_t k) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)k), lane));
}
static inline vf vf_select(vmask m, vf a, vf b) { return _mm256_blendv_ps(b, a, m); } /* m ? a : b */

static inline void vf_sums8(const vf *v, float *out) {
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31)));
}
#endif

#ifdef SIMD_WIDTH
/* exp(x) for x <= 0 (scores minus their running max); below -87 it returns ~1e-38, not 0. */
static inline vf vf_exp_nonpositive(vf x) {
    x = vf_max(x, vf_set1(-87.0f));
    const vf n = vf_round(vf_mul(x, vf_set1(1.44269504088896341f)));
    vf r = vf_fnmadd(n, vf_set1(0.693359375f), x);
    r = vf_fnmadd(n, vf_set1(-2.12194440e-4f), r);
    vf p = vf_set1(1.9875691500e-4f);
    p = vf_fmadd(p, r, vf_set1(1.3981999507e-3f));
    p = vf_fmadd(p, r, vf_set1(8.3334519073e-3f));
    p = vf_fmadd(p, r, vf_set1(4.1665795894e-2f));
    p = vf_fmadd(p, r, vf_set1(1.6666665459e-1f));
    p = vf_fmadd(p, r, vf_set1(5.0000001201e-1f));
    p = vf_fmadd(p, vf_mul(r, r), vf_add(r, vf_set1(1.0f)));
    return vf_times_pow2(p, n);
}

/* Folds one row's chunk of scores (n <= CHUNK; the array holds CHUNK + SIMD_WIDTH floats) into its
 * running max and sum; leaves exp(score - max) in place and returns the factor for the old acc. */
static inline float softmax_chunk(float *score, int64_t n, float *run_max, float *run_sum) {
    vf top = vf_set1(*run_max);
    for (int64_t t = 0; t < n; t += SIMD_WIDTH)
        top = vf_max(top, vf_select(vm_first(n - t), vf_load(score + t), vf_set1(-INFINITY)));
    const float chunk_max = vf_hmax(top);
    const float rescale = expf(*run_max - chunk_max);
    vf total = vf_zero();
    for (int64_t t = 0; t < n; t += SIMD_WIDTH) {
        const vf e = vf_select(vm_first(n - t), vf_exp_nonpositive(vf_sub(vf_load(score + t), vf_set1(chunk_max))),
                               vf_zero());
        total = vf_add(total, e);
        vf_store(score + t, e);
    }
    *run_sum = *run_sum * rescale + vf_hsum(total);
    *run_max = chunk_max;
    return rescale;
}
#endif

#endif
