// Every decoder layer of a Llama-family model for one decode batch, in one call.
//
// A decode step at small batch streams the model's weights through the caches once. Called from Python,
// each small op between two linear layers (a norm, the rotary and KV write, SiLU-and-mul, the attention
// wrapper) then finds its code path evicted and costs 25-40 us instead of ~5; at batch 1 that is several
// milliseconds of a ~25 ms step. Here the layer loop runs in C: the linear layers and the decode attention
// are the same kernels the Python path calls (passed in as function pointers: bf16_amx.c or bf16_gemv.c,
// and decode_attention.c), and the passes between them are the loops below, float32 inside and rounded to
// bf16 wherever the eager layers store a bf16 tensor (bit-equal to them).
//
// This file is the bf16 build (AVX512-BF16): its row passes below; the layer loop is decode_loop.h, shared with
// the float32 build (decode_step_f32.c).

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

typedef uint16_t elem_t; // bf16 bits

static inline void store_bf16(uint16_t *p, __m512 v) { _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(v)); }
static inline __m512 round_bf16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

// exp(x) for any x: the attention kernels' polynomial (simd.h), valid above 0 too; inf above ~88.7.
static inline __m512 exp_ps(__m512 x) { return vf_exp_nonpositive(_mm512_min_ps(x, _mm512_set1_ps(89.0f))); }

// rsqrt(mean(x^2) + eps) of a row, broadcast. NOTE: the sum of squares in the order of the compiled add_rmsnorm
// (fused_ops.py): two 16-lane sums over 32-element steps, added, then folded in halves.
static __m512 inv_rms(const uint16_t *x, int64_t n, float eps) {
    __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 32) {
        const __m512 a = vf_load_bf16(x + i), b = vf_load_bf16(x + i + 16);
        even = _mm512_add_ps(even, _mm512_mul_ps(a, a));
        odd = _mm512_add_ps(odd, _mm512_mul_ps(b, b));
    }
    const float sum = _mm512_reduce_add_ps(_mm512_add_ps(even, odd));
    return _mm512_set1_ps(1.0f / sqrtf(sum / (float)n + eps));
}

// out = weight * bf16(x * rsqrt(mean(x^2) + eps))
static void rmsnorm_row(const uint16_t *x, const uint16_t *weight, uint16_t *out, int64_t n, float eps) {
    const __m512 inv = inv_rms(x, n, eps);
    for (int64_t i = 0; i < n; i += 16)
        store_bf16(out + i, _mm512_mul_ps(vf_load_bf16(weight + i), round_bf16(_mm512_mul_ps(vf_load_bf16(x + i), inv))));
}

// residual = bf16(delta + residual); out = rmsnorm(residual)
static void add_rmsnorm_row(const uint16_t *delta, uint16_t *residual, const uint16_t *weight, uint16_t *out,
                            int64_t n, float eps) {
    for (int64_t i = 0; i < n; i += 16) store_bf16(residual + i, _mm512_add_ps(vf_load_bf16(delta + i), vf_load_bf16(residual + i)));
    rmsnorm_row(residual, weight, out, n, eps);
}

// The "rotate half" rotary of one head: (x1 c - x2 s, x2 c + x1 s) with the eager bf16 rounding steps
// (c and s rounded, each product rounded, the sum rounded).
static void rotate_head(const uint16_t *x, const float *cos, const float *sin, uint16_t *out, int64_t half) {
    for (int64_t i = 0; i < half; i += 16) {
        const __m512 c = round_bf16(_mm512_loadu_ps(cos + i)), s = round_bf16(_mm512_loadu_ps(sin + i));
        const __m512 x1 = vf_load_bf16(x + i), x2 = vf_load_bf16(x + half + i);
        const __m512 x1c = round_bf16(_mm512_mul_ps(x1, c)), x2s = round_bf16(_mm512_mul_ps(x2, s));
        const __m512 x2c = round_bf16(_mm512_mul_ps(x2, c)), x1s = round_bf16(_mm512_mul_ps(x1, s));
        store_bf16(out + i, _mm512_sub_ps(x1c, x2s));
        store_bf16(out + half + i, _mm512_add_ps(x2c, x1s));
    }
}

// out = bf16(silu(gate)) * up, silu(g) = g / (1 + exp(-g)) as torch computes it (exp(-g) overflows to inf
// for g < -88: silu is then -0, as in torch).
static void silu_mul_row(const uint16_t *gate_up, uint16_t *out, int64_t n) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t i = 0; i < n; i += 16) {
        const __m512 g = vf_load_bf16(gate_up + i);
        const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        store_bf16(out + i, _mm512_mul_ps(round_bf16(silu), vf_load_bf16(gate_up + n + i)));
    }
}

// Gemma's RMSNorm: out = bf16(x * rsqrt(mean(x^2) + eps) * weight1), weight1 the float32 table 1 + w; in place
// allowed (every x is read before any out is written). The sum of squares as rmsnorm_row's.
static void gemma_norm_row(const uint16_t *x, const float *weight1, uint16_t *out, int64_t n, float eps) {
    const __m512 inv = inv_rms(x, n, eps);
    for (int64_t i = 0; i < n; i += 16)
        store_bf16(out + i, _mm512_mul_ps(_mm512_mul_ps(vf_load_bf16(x + i), inv), _mm512_loadu_ps(weight1 + i)));
}

// residual = bf16(delta + residual)
static void add_row(const uint16_t *delta, uint16_t *residual, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) store_bf16(residual + i, _mm512_add_ps(vf_load_bf16(delta + i), vf_load_bf16(residual + i)));
}

// out = bf16(gelu_tanh(gate)) * up. gelu_tanh(g) = g (1 + tanh(u)) / 2 = g / (1 + exp(-2u)),
// u = sqrt(2 / pi) (g + 0.044715 g^3): the SiLU form with 2u, so no tanh is needed (and no cancellation near 0).
static void gelu_mul_row(const uint16_t *gate_up, uint16_t *out, int64_t n) {
    const __m512 one = _mm512_set1_ps(1.0f), c1 = _mm512_set1_ps(-1.5957691216057308f);
    const __m512 c3 = _mm512_set1_ps(-0.0713548162726f);
    for (int64_t i = 0; i < n; i += 16) {
        const __m512 g = vf_load_bf16(gate_up + i);
        const __m512 minus_2u = _mm512_mul_ps(g, _mm512_fmadd_ps(c3, _mm512_mul_ps(g, g), c1));
        const __m512 gelu = _mm512_div_ps(g, _mm512_add_ps(one, exp_ps(minus_2u)));
        store_bf16(out + i, _mm512_mul_ps(round_bf16(gelu), vf_load_bf16(gate_up + n + i)));
    }
}

#include "decode_loop.h"

// `lora`: the step's LoRA rows (decode_lora.h), or NULL.
int decode_step_bf16(const decode_model *m, attention_fn attention, const decode_lora *lora, uint16_t *hidden,
                     uint16_t *residual, const int64_t *positions, const attention_group *groups, int64_t bs,
                     uint16_t *work, int nthreads) {
    return decode_layers(m, attention, lora, hidden, residual, positions, groups, bs, work, nthreads);
}

// Elements of the work buffer `decode_step_bf16` needs for `bs` rows.
int64_t decode_step_bf16_work_size(const decode_model *m, int64_t bs) { return decode_work_size(m, bs); }

// SiLU(gate) * up of m fused [gate | up] rows of 2n values into m rows of n: the loop the decode step
// runs, for prefill-sized batches (models/prefill_passes.py). Returns 0; 1 if n is not a multiple of 16.
int silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t m, int64_t n, int nthreads) {
    if (n % 16) return 1;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t r = 0; r < m; r++) silu_mul_row(gate_up + r * 2 * n, out + r * n, n);
    return 0;
}

// sum = bf16(delta + residual) and normed = rmsnorm(sum) for m rows of n: the decode step's rows (bit-equal to the
// compiled add_rmsnorm), for prefill-sized batches (models/prefill_passes.py). Returns 0; 1 if n is not a multiple of
// 32.
int add_rmsnorm_bf16(const uint16_t *delta, const uint16_t *residual, const uint16_t *weight, uint16_t *normed,
                     uint16_t *sum, int64_t m, int64_t n, float eps, int nthreads) {
    if (n % 32) return 1;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t r = 0; r < m; r++) {
        memcpy(sum + r * n, residual + r * n, (size_t)n * sizeof *sum);
        add_rmsnorm_row(delta + r * n, sum + r * n, weight, normed + r * n, n, eps);
    }
    return 0;
}
