// The one-call decode step (decode_loop.h) for float32 models: every decoder layer of a decode batch in one
// call, on the CPUs where `--dtype auto` computes in float32 (AVX2 + FMA, AVX-512 without BF16). The linear
// layers are the kernels the Python path calls (bf16 weights: bf16w_gemv.c; int4/int8: quant_tiled.c) and the
// attention is the float32 decode kernel (decode_attention.c); the passes between them are the loops below,
// one source for the AVX2 and AVX-512 builds (simd.h's `vf`: 8 or 16 float32 lanes).
//
// NOTE: not bit-equal to the Python layers, whose passes inductor compiles: its exp (SiLU) and its order of
// the RMSNorm sum of squares differ from these in the last bits of a float32; the results agree to float32
// rounding (tests/test_decode_step_f32.py). The bf16 build matches its Python layers bit for bit, because
// there every pass rounds to bf16.

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

#ifndef SIMD_WIDTH
#error "decode_step_f32.c needs a vector level (AVX2 + FMA or AVX-512)"
#endif

typedef float elem_t;
#define DECODE_KV_BF16 /* decode_loop.h: the KV cache may be bf16 (decode_model.kv_bf16) */

// exp(x) for any x: the attention kernels' polynomial (simd.h), valid above 0 too; inf above ~88.7.
static inline vf exp_any(vf x) { return vf_exp_nonpositive(vf_min(x, vf_set1(89.0f))); }

// rsqrt(mean(x^2) + eps) of a row, broadcast.
static vf inv_rms(const float *x, int64_t n, float eps) {
    vf even = vf_zero(), odd = vf_zero();
    for (int64_t i = 0; i < n; i += 2 * SIMD_WIDTH) {
        const vf a = vf_load(x + i), b = vf_load(x + i + SIMD_WIDTH);
        even = vf_fmadd(a, a, even);
        odd = vf_fmadd(b, b, odd);
    }
    return vf_set1(1.0f / sqrtf(vf_hsum(vf_add(even, odd)) / (float)n + eps));
}

// out = weight * (x * rsqrt(mean(x^2) + eps)), as layers/layernorm.py's rms_norm in float32.
static void rmsnorm_row(const float *x, const float *weight, float *out, int64_t n, float eps) {
    const vf inv = inv_rms(x, n, eps);
    for (int64_t i = 0; i < n; i += SIMD_WIDTH) vf_store(out + i, vf_mul(vf_load(weight + i), vf_mul(vf_load(x + i), inv)));
}

// residual += delta; out = rmsnorm(residual)
static void add_rmsnorm_row(const float *delta, float *residual, const float *weight, float *out, int64_t n, float eps) {
    for (int64_t i = 0; i < n; i += SIMD_WIDTH) vf_store(residual + i, vf_add(vf_load(delta + i), vf_load(residual + i)));
    rmsnorm_row(residual, weight, out, n, eps);
}

// The "rotate half" rotary of one head: (x1 c - x2 s, x2 c + x1 s).
static void rotate_head(const float *x, const float *cos, const float *sin, float *out, int64_t half) {
    for (int64_t i = 0; i < half; i += SIMD_WIDTH) {
        const vf c = vf_load(cos + i), s = vf_load(sin + i), x1 = vf_load(x + i), x2 = vf_load(x + half + i);
        vf_store(out + i, vf_sub(vf_mul(x1, c), vf_mul(x2, s)));
        vf_store(out + half + i, vf_add(vf_mul(x2, c), vf_mul(x1, s)));
    }
}

// out = silu(gate) * up, silu(g) = g / (1 + exp(-g)) (-0 for g < -88, as in torch).
static void silu_mul_row(const float *gate_up, float *out, int64_t n) {
    const vf one = vf_set1(1.0f);
    for (int64_t i = 0; i < n; i += SIMD_WIDTH) {
        const vf g = vf_load(gate_up + i);
        const vf silu = vf_div(g, vf_add(one, exp_any(vf_sub(vf_zero(), g))));
        vf_store(out + i, vf_mul(silu, vf_load(gate_up + n + i)));
    }
}

// Gemma's RMSNorm: out = x * rsqrt(mean(x^2) + eps) * weight1, weight1 = 1 + w; in place allowed.
static void gemma_norm_row(const float *x, const float *weight1, float *out, int64_t n, float eps) {
    const vf inv = inv_rms(x, n, eps);
    for (int64_t i = 0; i < n; i += SIMD_WIDTH) vf_store(out + i, vf_mul(vf_mul(vf_load(x + i), inv), vf_load(weight1 + i)));
}

// residual += delta
static void add_row(const float *delta, float *residual, int64_t n) {
    for (int64_t i = 0; i < n; i += SIMD_WIDTH) vf_store(residual + i, vf_add(vf_load(delta + i), vf_load(residual + i)));
}

// out = gelu_tanh(gate) * up, gelu_tanh(g) = g / (1 + exp(-2u)), u = sqrt(2 / pi) (g + 0.044715 g^3).
static void gelu_mul_row(const float *gate_up, float *out, int64_t n) {
    const vf one = vf_set1(1.0f), c1 = vf_set1(-1.5957691216057308f), c3 = vf_set1(-0.0713548162726f);
    for (int64_t i = 0; i < n; i += SIMD_WIDTH) {
        const vf g = vf_load(gate_up + i);
        const vf gelu = vf_div(g, vf_add(one, exp_any(vf_mul(g, vf_fmadd(c3, vf_mul(g, g), c1)))));
        vf_store(out + i, vf_mul(gelu, vf_load(gate_up + n + i)));
    }
}

#include "decode_loop.h"

// `lora`: the step's LoRA rows (decode_lora.h), or NULL.
int decode_step_f32(const decode_model *m, attention_fn attention, const decode_lora *lora, float *hidden,
                    float *residual, const int64_t *positions, const attention_group *groups, int64_t bs, float *work,
                    int nthreads) {
    return decode_layers(m, attention, lora, hidden, residual, positions, groups, bs, work, nthreads);
}

// Elements of the work buffer `decode_step_f32` needs for `bs` rows.
int64_t decode_step_f32_work_size(const decode_model *m, int64_t bs) { return decode_work_size(m, bs); }

// The step's SiLU-and-mul and add + RMSNorm over m rows of a prefill batch (models/prefill_passes.py), so that a
// prefill chunk rounds as the decode step does. Return 0; 1 if n is not a multiple of 32 (nothing written).
int silu_mul_f32(const float *gate_up, float *out, int64_t m, int64_t n, int nthreads) {
    if (n % 32) return 1;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t r = 0; r < m; r++) silu_mul_row(gate_up + r * 2 * n, out + r * n, n);
    return 0;
}

// sum = delta + residual, normed = rmsnorm(sum)
int add_rmsnorm_f32(const float *delta, const float *residual, const float *weight, float *normed, float *sum,
                    int64_t m, int64_t n, float eps, int nthreads) {
    if (n % 32) return 1;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t r = 0; r < m; r++) {
        const float *d = delta + r * n, *res = residual + r * n;
        float *s = sum + r * n;
        for (int64_t i = 0; i < n; i += SIMD_WIDTH) vf_store(s + i, vf_add(vf_load(d + i), vf_load(res + i)));
        rmsnorm_row(s, weight, normed + r * n, n, eps);
    }
    return 0;
}
