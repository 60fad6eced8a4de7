/* Decode attention for one unit (a request's kv heads [h0, h1), `group` query rows each) on AVX-512,
 * sixteen tokens at a time. Included by decode_attention.c where SIMD_WIDTH == 16.
 *
 * Scores: for one query row, sixteen K rows are dotted into sixteen accumulators, which a transposing
 * tree (`vf_sum16`, simd.h) folds into one vector of sixteen scores: no horizontal sum per token.
 * Values: the softmax weights of a chunk are applied with every accumulator of a head in registers,
 * `VCOLS` of the head dim's 16-lane columns at a time, so each V row is widened once per column block.
 * Prefetch: while a block of K rows is scored, the same block's V rows (read right after the chunk's
 * scores) and the K rows a chunk ahead are requested; on a pool read from DRAM this mattered more than
 * any arithmetic (the hardware prefetcher alone left the kernel waiting on memory).
 * The unit's shape (group, dim) is a compile-time constant in the common cases (DECODE_SHAPES), which
 * lets the compiler keep those accumulators in registers; other shapes run the same code with runtime
 * loops.
 */
#ifndef RADIXSERVE_DECODE_AVX512_H
#define RADIXSERVE_DECODE_AVX512_H

#define BLOCK 16 /* tokens scored together */

#define VCOLS(group, nv) ((group) * (nv) <= 24 ? (nv) : ((24 / (group)) > 0 ? 24 / (group) : 1))

/* NAME(..., group, nv): one unit; T the query and output element type, KT the pool's, QV the type of a
 * query's pre-loaded vectors (QSTEPS(nv) of them), QLOAD(p, c) its c-th vector from the query row p (scaled
 * by `scale` when SCALE_Q), KDOT(acc, qv, krow, c) one step of the dot product, LOADV(p) 16 pool values
 * widened to float. */
#define DEFINE_DECODE_512(NAME, T, KT, QV, QSTEPS, QLOAD, SCALE_Q, KDOT, LOADV, LOAD, STORE)              \
    static inline __attribute__((always_inline)) void NAME(                                               \
        const T *q, const KT *k_buf, const KT *v_buf, const int32_t *slots, int64_t len, int64_t kv_heads, \
        int64_t h0, int64_t h1, float scale, const T *seed_out, const float *seed_lse, T *out,            \
        float *out_lse, const int64_t group, const int64_t nv) {                                          \
        const int64_t dim = nv * 16, rows = (h1 - h0) * group, steps = QSTEPS(nv);                        \
        const int64_t vcols = VCOLS(group, nv), row_bytes = (h1 - h0) * dim * (int64_t)sizeof(KT);        \
        QV qv[MAX_HEADS][MAX_DIM / 16];                                                                   \
        float acc[MAX_HEADS][MAX_DIM], score[MAX_HEADS][CHUNK], run_max[MAX_HEADS], run_sum[MAX_HEADS];   \
        const float post = SCALE_Q ? 1.0f : scale;                                                        \
        for (int64_t r = 0; r < rows; r++) {                                                              \
            for (int64_t c = 0; c < steps; c++) qv[r][c] = QLOAD(q + r * dim, c, scale);                  \
            for (int64_t d = 0; d < dim; d++) acc[r][d] = seed_lse != NULL ? LOAD(seed_out[r * dim + d]) : 0.0f; \
            run_max[r] = seed_lse != NULL ? seed_lse[r] : -INFINITY;                                      \
            run_sum[r] = seed_lse != NULL && seed_lse[r] > -INFINITY ? 1.0f : 0.0f;                       \
        }                                                                                                 \
        for (int64_t t0 = 0; t0 < len; t0 += CHUNK) {                                                     \
            const int64_t n = len - t0 < CHUNK ? len - t0 : CHUNK;                                        \
            const KT *rows_k[CHUNK], *rows_v[CHUNK];                                                      \
            for (int64_t t = 0; t < CHUNK; t++) {                                                         \
                const int64_t base = (int64_t)slots[t0 + (t < n ? t : n - 1)] * kv_heads + h0;            \
                rows_k[t] = k_buf + base * dim; /* past n: the last token again, masked by softmax_chunk */ \
                rows_v[t] = v_buf + base * dim;                                                           \
            }                                                                                             \
            for (int64_t t = 0; t < n; t += BLOCK) {                                                      \
                for (int64_t i = t0 + t; i < t0 + t + BLOCK && i < len; i++) { /* V: needed after the scores */ \
                    prefetch_row(v_buf + ((int64_t)slots[i] * kv_heads + h0) * dim, row_bytes);                \
                    if (i + CHUNK < len)                                                                \
                        prefetch_row(k_buf + ((int64_t)slots[i + CHUNK] * kv_heads + h0) * dim, row_bytes);   \
                }                                                                                         \
                for (int64_t h = 0; h < h1 - h0; h++) {                                                   \
                    for (int64_t g = 0; g < group; g++) {                                                 \
                        const int64_t r = h * group + g;                                                  \
                        __m512 s[BLOCK];                                                                  \
                        for (int i = 0; i < BLOCK; i++) s[i] = _mm512_setzero_ps();                       \
                        for (int64_t c = 0; c < steps; c++)                                               \
                            for (int i = 0; i < BLOCK; i++) s[i] = KDOT(s[i], qv[r][c], rows_k[t + i] + h * dim, c); \
                        _mm512_storeu_ps(score[r] + t, _mm512_mul_ps(vf_sum16(s), _mm512_set1_ps(post)));   \
                    }                                                                                     \
                }                                                                                         \
            }                                                                                             \
            for (int64_t r = 0; r < rows; r++) {                                                          \
                const float rescale = softmax_chunk(score[r], n, &run_max[r], &run_sum[r]);               \
                for (int64_t d = 0; d < dim; d++) acc[r][d] *= rescale;                                   \
            }                                                                                             \
            for (int64_t h = 0; h < h1 - h0; h++) {                                                       \
                const int64_t r0 = h * group;                                                             \
                for (int64_t c0 = 0; c0 < nv; c0 += vcols) {                                              \
                    __m512 a[24];                                                                         \
                    const int64_t cols = nv - c0 < vcols ? nv - c0 : vcols;                               \
                    for (int64_t g = 0; g < group; g++)                                                   \
                        for (int64_t c = 0; c < cols; c++) a[g * vcols + c] = _mm512_loadu_ps(acc[r0 + g] + 16 * (c0 + c)); \
                    for (int64_t t = 0; t < n; t++) {                                                     \
                        const KT *vrow = rows_v[t] + h * dim + 16 * c0;                                   \
                        for (int64_t c = 0; c < cols; c++) {                                              \
                            const __m512 v = LOADV(vrow + 16 * c);                                        \
                            for (int64_t g = 0; g < group; g++)                                           \
                                a[g * vcols + c] = _mm512_fmadd_ps(_mm512_set1_ps(score[r0 + g][t]), v, a[g * vcols + c]); \
                        }                                                                                 \
                    }                                                                                     \
                    for (int64_t g = 0; g < group; g++)                                                   \
                        for (int64_t c = 0; c < cols; c++) _mm512_storeu_ps(acc[r0 + g] + 16 * (c0 + c), a[g * vcols + c]); \
                }                                                                                         \
            }                                                                                             \
        }                                                                                                 \
        for (int64_t r = 0; r < rows; r++) {                                                              \
            const float inv = run_sum[r] > 0.0f ? 1.0f / run_sum[r] : 0.0f;                               \
            for (int64_t d = 0; d < dim; d++) out[r * dim + d] = STORE(acc[r][d] * inv);                  \
            if (out_lse != NULL) out_lse[r] = run_sum[r] > 0.0f ? run_max[r] + logf(run_sum[r]) : -INFINITY; \
        }                                                                                                 \
    }

/* The unit's (group, nv) as constants for the shapes models have, else at run time. */
#define DECODE_SHAPES(FN, group, nv, ...)                                                                  \
    switch ((group) * 100 + (nv)) {                                                                        \
    case 104: FN(__VA_ARGS__, 1, 4); break;                                                                \
    case 204: FN(__VA_ARGS__, 2, 4); break;                                                                \
    case 304: FN(__VA_ARGS__, 3, 4); break;                                                                \
    case 404: FN(__VA_ARGS__, 4, 4); break;                                                                \
    case 704: FN(__VA_ARGS__, 7, 4); break;                                                                \
    case 804: FN(__VA_ARGS__, 8, 4); break;                                                                \
    case 108: FN(__VA_ARGS__, 1, 8); break;                                                                \
    case 208: FN(__VA_ARGS__, 2, 8); break;                                                                \
    case 408: FN(__VA_ARGS__, 4, 8); break;                                                                \
    case 508: FN(__VA_ARGS__, 5, 8); break;                                                                \
    case 708: FN(__VA_ARGS__, 7, 8); break;                                                                \
    case 808: FN(__VA_ARGS__, 8, 8); break;                                                                \
    case 308: FN(__VA_ARGS__, 3, 8); break;                                                                \
    case 608: FN(__VA_ARGS__, 6, 8); break;                                                                \
    case 216: FN(__VA_ARGS__, 2, 16); break;                                                               \
    case 416: FN(__VA_ARGS__, 4, 16); break;                                                               \
    default: FN(__VA_ARGS__, group, nv); break;                                                            \
    }

#define F32_STEPS(nv) (nv)
#define F32_QLOAD(p, c, scale) _mm512_mul_ps(_mm512_loadu_ps((p) + 16 * (c)), _mm512_set1_ps(scale))
#define F32_KDOT(acc, qc, krow, c) _mm512_fmadd_ps(qc, _mm512_loadu_ps((krow) + 16 * (c)), acc)
#define BF16W_QLOAD(p, c, scale) _mm512_mul_ps(vf_load_bf16((p) + 16 * (c)), _mm512_set1_ps(scale))
#define BF16W_KDOT(acc, qc, krow, c) _mm512_fmadd_ps(qc, vf_load_bf16((krow) + 16 * (c)), acc)

DEFINE_DECODE_512(decode_unit_f32, float, float, __m512, F32_STEPS, F32_QLOAD, 1, F32_KDOT, _mm512_loadu_ps, f32_id,
                  f32_id)
DEFINE_DECODE_512(decode_unit_bf16w, uint16_t, uint16_t, __m512, F32_STEPS, BF16W_QLOAD, 1, BF16W_KDOT, vf_load_bf16,
                  bf16_to_f32, f32_to_bf16)
/* float32 queries over a bf16 KV cache (--kv-cache-dtype bfloat16): K and V widened as they are loaded */
DEFINE_DECODE_512(decode_unit_f32_bf16kv, float, uint16_t, __m512, F32_STEPS, F32_QLOAD, 1, BF16W_KDOT, vf_load_bf16,
                  f32_id, f32_id)

#ifdef HAVE_AVX512_BF16
/* bf16 pairs of q and k multiplied exactly by vdpbf16ps (q unscaled: the scale is applied to the sums). */
#define BF16_STEPS(nv) ((nv) / 2)
#define BF16_QLOAD(p, c, scale) ((__m512bh)_mm512_loadu_si512((p) + 32 * (c)))
#define BF16_KDOT(acc, qc, krow, c) _mm512_dpbf16_ps(acc, qc, (__m512bh)_mm512_loadu_si512((krow) + 32 * (c)))
DEFINE_DECODE_512(decode_unit_bf16dp, uint16_t, uint16_t, __m512bh, BF16_STEPS, BF16_QLOAD, 0, BF16_KDOT, vf_load_bf16,
                  bf16_to_f32, f32_to_bf16)
#endif

#endif
