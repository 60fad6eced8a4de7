/* Paged decode attention for the CPU: one query token per request, K/V read in place from the pool.
 *
 * For each (request, kv head) pair -- spread over OpenMP threads -- the kernel walks the request's
 * slots in chunks, scores the chunk for every query head of the group, and folds it into a running
 * softmax (max, sum, weighted V) in float32. Every K and V row of the context is read exactly once
 * and nothing is gathered or copied. Built and loaded by radixserve/layers/attention/native.py.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define CHUNK 64
#define MAX_DIM 256
#define MAX_GROUP 16

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7FFFu + ((u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

static inline float f32_id(float x) { return x; }

#define DEFINE_DECODE(NAME, T, LOAD, STORE)                                                              \
    int NAME(const T *q, const T *k_buf, const T *v_buf, const int32_t *kv_indices,                      \
             const int64_t *seq_lens, T *out, int64_t bs, int64_t max_len, int64_t heads,               \
             int64_t kv_heads, int64_t dim, float scale, int num_threads) {                              \
        const int64_t group = heads / kv_heads;                                                          \
        if (dim > MAX_DIM || group > MAX_GROUP || group * kv_heads != heads) return 1;                  \
        _Pragma("omp parallel for collapse(2) schedule(dynamic, 1) num_threads(num_threads)")            \
        for (int64_t b = 0; b < bs; b++) {                                                               \
            for (int64_t h = 0; h < kv_heads; h++) {                                                     \
                float qf[MAX_GROUP][MAX_DIM], acc[MAX_GROUP][MAX_DIM], row[MAX_DIM];                     \
                float score[MAX_GROUP][CHUNK], run_max[MAX_GROUP], run_sum[MAX_GROUP];                   \
                for (int64_t g = 0; g < group; g++) {                                                    \
                    const T *qrow = q + (b * heads + h * group + g) * dim;                               \
                    for (int64_t d = 0; d < dim; d++) {                                                  \
                        qf[g][d] = LOAD(qrow[d]) * scale;                                                \
                        acc[g][d] = 0.0f;                                                                \
                    }                                                                                    \
                    run_max[g] = -INFINITY;                                                              \
                    run_sum[g] = 0.0f;                                                                   \
                }                                                                                        \
                const int32_t *slots = kv_indices + b * max_len;                                         \
                const int64_t len = seq_lens[b];                                                         \
                for (int64_t t0 = 0; t0 < len; t0 += CHUNK) {                                            \
                    const int64_t n = len - t0 < CHUNK ? len - t0 : CHUNK;                               \
                    for (int64_t t = 0; t < n; t++) {                                                    \
                        const T *krow = k_buf + ((int64_t)slots[t0 + t] * kv_heads + h) * dim;           \
                        for (int64_t d = 0; d < dim; d++) row[d] = LOAD(krow[d]);                        \
                        for (int64_t g = 0; g < group; g++) {                                            \
                            float dot = 0.0f;                                                            \
                            _Pragma("omp simd reduction(+ : dot)")                                       \
                            for (int64_t d = 0; d < dim; d++) dot += qf[g][d] * row[d];                  \
                            score[g][t] = dot;                                                           \
                        }                                                                                \
                    }                                                                                    \
                    for (int64_t g = 0; g < group; g++) {                                                \
                        float chunk_max = run_max[g];                                                    \
                        for (int64_t t = 0; t < n; t++)                                                  \
                            chunk_max = score[g][t] > chunk_max ? score[g][t] : chunk_max;               \
                        const float rescale = expf(run_max[g] - chunk_max);                              \
                        run_sum[g] *= rescale;                                                           \
                        for (int64_t d = 0; d < dim; d++) acc[g][d] *= rescale;                          \
                        for (int64_t t = 0; t < n; t++) {                                                \
                            score[g][t] = expf(score[g][t] - chunk_max);                                 \
                            run_sum[g] += score[g][t];                                                   \
                        }                                                                                \
                        run_max[g] = chunk_max;                                                          \
                    }                                                                                    \
                    for (int64_t t = 0; t < n; t++) {                                                    \
                        const T *vrow = v_buf + ((int64_t)slots[t0 + t] * kv_heads + h) * dim;           \
                        for (int64_t d = 0; d < dim; d++) row[d] = LOAD(vrow[d]);                        \
                        for (int64_t g = 0; g < group; g++) {                                            \
                            const float p = score[g][t];                                                 \
                            _Pragma("omp simd")                                                          \
                            for (int64_t d = 0; d < dim; d++) acc[g][d] += p * row[d];                   \
                        }                                                                                \
                    }                                                                                    \
                }                                                                                        \
                for (int64_t g = 0; g < group; g++) {                                                    \
                    T *orow = out + (b * heads + h * group + g) * dim;                                   \
                    const float inv = run_sum[g] > 0.0f ? 1.0f / run_sum[g] : 0.0f;                      \
                    for (int64_t d = 0; d < dim; d++) orow[d] = STORE(acc[g][d] * inv);                  \
                }                                                                                        \
            }                                                                                            \
        }                                                                                                \
        return 0;                                                                                        \
    }

DEFINE_DECODE(decode_attention_bf16_generic, uint16_t, bf16_to_f32, f32_to_bf16)
DEFINE_DECODE(decode_attention_f32, float, f32_id, f32_id)

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

/* exp for x <= 0 (scores minus their running max), Cephes expf's reduction and polynomial. */
static inline __m512 exp_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* Folds one chunk of scores (n <= CHUNK) into the running max/sum; leaves exp(score - max) in place. */
static inline float softmax_chunk(float *score, int64_t n, float *run_max, float *run_sum) {
    __m512 top = _mm512_set1_ps(*run_max);
    for (int64_t t = 0; t < n; t += 16) {
        const __mmask16 m = n - t >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - t)) - 1u);
        top = _mm512_mask_max_ps(top, m, top, _mm512_maskz_loadu_ps(m, score + t));
    }
    const float chunk_max = _mm512_reduce_max_ps(top);
    const float rescale = expf(*run_max - chunk_max);
    __m512 total = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; t += 16) {
        const __mmask16 m = n - t >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - t)) - 1u);
        const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, score + t), _mm512_set1_ps(chunk_max)));
        total = _mm512_mask_add_ps(total, m, total, e);
        _mm512_mask_storeu_ps(score + t, m, e);
    }
    *run_sum = *run_sum * rescale + _mm512_reduce_add_ps(total);
    *run_max = chunk_max;
    return rescale;
}

#define MAX_HEADS 64

/* One request's kv heads [h0, h1) in bf16 with AVX-512. Each token's K (then V) rows of all those
 * heads are adjacent in the pool, so the request's slots are streamed through once. Scores come from
 * vdpbf16ps on the pool's bf16 values (exact products, float32 sums); V is widened to float32. */
static void decode_request_bf16_avx512(const uint16_t *q, const uint16_t *k_buf, const uint16_t *v_buf,
                                       const int32_t *slots, int64_t len, int64_t kv_heads, int64_t h0,
                                       int64_t h1, int64_t dim, int64_t group, float scale, uint16_t *out) {
    const int64_t pairs = dim / 32, lanes = dim / 16, rows = (h1 - h0) * group;
    __m512bh qv[MAX_HEADS][MAX_DIM / 32];
    float acc[MAX_HEADS][MAX_DIM], score[MAX_HEADS][CHUNK], run_max[MAX_HEADS], run_sum[MAX_HEADS];
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t j = 0; j < pairs; j++) qv[r][j] = (__m512bh)_mm512_loadu_si512(q + r * dim + 32 * j);
        for (int64_t d = 0; d < dim; d++) acc[r][d] = 0.0f;
        run_max[r] = -INFINITY;
        run_sum[r] = 0.0f;
    }
    for (int64_t t0 = 0; t0 < len; t0 += CHUNK) {
        const int64_t n = len - t0 < CHUNK ? len - t0 : CHUNK;
        for (int64_t t = 0; t < n; t++) {
            const uint16_t *krow = k_buf + ((int64_t)slots[t0 + t] * kv_heads + h0) * dim;
            for (int64_t h = 0; h < h1 - h0; h++) {
                __m512bh kv[MAX_DIM / 32];
                for (int64_t j = 0; j < pairs; j++) kv[j] = (__m512bh)_mm512_loadu_si512(krow + h * dim + 32 * j);
                for (int64_t g = 0; g < group; g++) {
                    __m512 sum = _mm512_setzero_ps();
                    for (int64_t j = 0; j < pairs; j++) sum = _mm512_dpbf16_ps(sum, qv[h * group + g][j], kv[j]);
                    score[h * group + g][t] = _mm512_reduce_add_ps(sum) * scale;
                }
            }
        }
        for (int64_t r = 0; r < rows; r++) {
            const float rescale = softmax_chunk(score[r], n, &run_max[r], &run_sum[r]);
            for (int64_t d = 0; d < dim; d++) acc[r][d] *= rescale;
        }
        for (int64_t t = 0; t < n; t++) {
            const uint16_t *vrow = v_buf + ((int64_t)slots[t0 + t] * kv_heads + h0) * dim;
            for (int64_t h = 0; h < h1 - h0; h++) {
                for (int64_t j = 0; j < lanes; j++) {
                    const __m256i raw = _mm256_loadu_si256((const __m256i *)(vrow + h * dim + 16 * j));
                    const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
                    for (int64_t g = 0; g < group; g++) {
                        float *a = acc[h * group + g] + 16 * j;
                        const __m512 p = _mm512_set1_ps(score[h * group + g][t]);
                        _mm512_storeu_ps(a, _mm512_fmadd_ps(p, v, _mm512_loadu_ps(a)));
                    }
                }
            }
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        const float inv = run_sum[r] > 0.0f ? 1.0f / run_sum[r] : 0.0f;
        for (int64_t d = 0; d < dim; d++) out[r * dim + d] = f32_to_bf16(acc[r][d] * inv);
    }
}
#endif

int decode_attention_bf16(const uint16_t *q, const uint16_t *k_buf, const uint16_t *v_buf,
                          const int32_t *kv_indices, const int64_t *seq_lens, uint16_t *out, int64_t bs,
                          int64_t max_len, int64_t heads, int64_t kv_heads, int64_t dim, float scale,
                          int num_threads) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    const int64_t group = heads / kv_heads;
    if (dim % 32 == 0 && dim <= MAX_DIM && heads <= MAX_HEADS && group * kv_heads == heads) {
        /* NOTE: whole requests per thread when there are enough of them (one pass over each request's
         * slots); otherwise (request, kv head) pairs, so a lone request still uses every thread. */
        const int64_t split = bs >= num_threads ? 1 : kv_heads;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
        for (int64_t unit = 0; unit < bs * split; unit++) {
            const int64_t b = unit / split, h0 = (unit % split) * (kv_heads / split);
            const int64_t h1 = split == 1 ? kv_heads : h0 + 1;
            decode_request_bf16_avx512(q + (b * heads + h0 * group) * dim, k_buf, v_buf, kv_indices + b * max_len,
                                       seq_lens[b], kv_heads, h0, h1, dim, group, scale,
                                       out + (b * heads + h0 * group) * dim);
        }
        return 0;
    }
#endif
    return decode_attention_bf16_generic(q, k_buf, v_buf, kv_indices, seq_lens, out, bs, max_len, heads, kv_heads,
                                         dim, scale, num_threads);
}
