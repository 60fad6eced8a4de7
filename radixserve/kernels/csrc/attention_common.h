/* What the CPU attention kernels share: bf16 conversions, the portable row-attention loop, and the
 * naming of exported functions. Included by every kernel.
 *
 * Every source is compiled once per kernel level (native.py: portable, avx2, avx512, avx512_bf16), each
 * time with that level's -m flags and -DRS_ISA_SUFFIX=_<level>, and all the objects go into one
 * library: EXPORT(decode_attention_f32) is decode_attention_f32_avx2 in the avx2 object. Static
 * helpers stay private to their object, so each level's code uses only its own instructions.
 *
 * Conventions: scores are scale * q.k in float32; a row's softmax state is (run_max, run_sum, acc)
 * with acc = sum_t exp(score_t - run_max) * v_t; its log-sum-exp is run_max + log(run_sum), or
 * -inf when it saw no token (then its output is 0). A finished partial result (out, lse) over other
 * keys is the state (lse, 1, out): starting a row from it ("seeding") merges the two exactly. A partial
 * result that saw no key (lse -inf, out 0: a query of a window layer that sees none of cascade's shared
 * prefix) is the empty state (-inf, 0, 0), so such a row ends as if it had not been seeded at all.
 */
#ifndef RADIXSERVE_ATTENTION_COMMON_H
#define RADIXSERVE_ATTENTION_COMMON_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define CHUNK 64
#define MAX_DIM 256
#define MAX_GROUP 16
#define MAX_ROWS 16 /* query rows one call of attend_rows_* handles */

#ifndef RS_ISA_SUFFIX
#define RS_ISA_SUFFIX _portable
#endif
#define RS_JOIN2(a, b) a##b
#define RS_JOIN(a, b) RS_JOIN2(a, b)
#define EXPORT(name) RS_JOIN(name, RS_ISA_SUFFIX)

/* Asks for the cache lines of a pool row ahead of its use: a request's slots may lie anywhere in the
 * pool, where the hardware prefetcher cannot follow them. */
static inline void prefetch_row(const void *row, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch((const char *)row + o, 0, 3);
}

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

static inline float row_lse(float run_max, float run_sum) {
    return run_sum > 0.0f ? run_max + logf(run_sum) : -INFINITY;
}

/* Attends query rows ids[0..nr) (row id i: q + i * dim, out + i * dim, lse + i) of kv head h over
 * slots[0..len) of the pool, in float32. Every K and V row is read once for all nr rows. With a
 * non-NULL `limits`, row r sees only slots[0..limits[r]) (a causal mask; each limit >= 1 or a seed);
 * with a non-NULL `lows` only from slots[lows[r]] on (a sliding window; a row may see no slot at all).
 * With a non-NULL seed_lse each row starts from the partial result (seed_out, seed_lse) of the same
 * row id; lse (output) may be NULL. T: the query and output type, KT: the K/V buffers' (LOADK widens it). */
#define DEFINE_ATTEND_ROWS(NAME, T, KT, LOAD, LOADK, STORE)                                              \
    static void NAME(const T *q, const KT *k_buf, const KT *v_buf, const int64_t *ids, int64_t nr,       \
                     const int32_t *slots, int64_t len, const int32_t *limits, const int32_t *lows,      \
                     int64_t kv_heads, int64_t h, int64_t dim, float scale, const T *seed_out,           \
                     const float *seed_lse, T *out, float *lse) {                                        \
        float qf[MAX_ROWS][MAX_DIM], acc[MAX_ROWS][MAX_DIM], row[MAX_DIM];                               \
        float score[MAX_ROWS][CHUNK], run_max[MAX_ROWS], run_sum[MAX_ROWS];                              \
        for (int64_t r = 0; r < nr; r++) {                                                               \
            for (int64_t d = 0; d < dim; d++) {                                                          \
                qf[r][d] = LOAD(q[ids[r] * dim + d]) * scale;                                            \
                acc[r][d] = seed_lse != NULL ? LOAD(seed_out[ids[r] * dim + d]) : 0.0f;                  \
            }                                                                                            \
            run_max[r] = seed_lse != NULL ? seed_lse[ids[r]] : -INFINITY;                                \
            run_sum[r] = seed_lse != NULL && seed_lse[ids[r]] > -INFINITY ? 1.0f : 0.0f;                 \
        }                                                                                                \
        for (int64_t t0 = 0; t0 < len; t0 += CHUNK) {                                                    \
            const int64_t n = len - t0 < CHUNK ? len - t0 : CHUNK;                                       \
            for (int64_t t = 0; t < n; t++) {                                                            \
                const KT *krow = k_buf + ((int64_t)slots[t0 + t] * kv_heads + h) * dim;                  \
                for (int64_t d = 0; d < dim; d++) row[d] = LOADK(krow[d]);                               \
                for (int64_t r = 0; r < nr; r++) {                                                       \
                    float dot = 0.0f;                                                                    \
                    _Pragma("omp simd reduction(+ : dot)")                                               \
                    for (int64_t d = 0; d < dim; d++) dot += qf[r][d] * row[d];                          \
                    const int hidden = (limits != NULL && t0 + t >= limits[r])                           \
                                       || (lows != NULL && t0 + t < lows[r]);                            \
                    score[r][t] = hidden ? -INFINITY : dot;                                              \
                }                                                                                        \
            }                                                                                            \
            for (int64_t r = 0; r < nr; r++) {                                                           \
                float chunk_max = run_max[r];                                                            \
                for (int64_t t = 0; t < n; t++) chunk_max = score[r][t] > chunk_max ? score[r][t] : chunk_max; \
                const float base = chunk_max == -INFINITY ? 0.0f : chunk_max; /* nothing seen yet */     \
                const float rescale = expf(run_max[r] - base);                                           \
                run_sum[r] *= rescale;                                                                   \
                for (int64_t d = 0; d < dim; d++) acc[r][d] *= rescale;                                  \
                for (int64_t t = 0; t < n; t++) {                                                        \
                    score[r][t] = expf(score[r][t] - base);                                              \
                    run_sum[r] += score[r][t];                                                           \
                }                                                                                        \
                run_max[r] = chunk_max;                                                                  \
            }                                                                                            \
            for (int64_t t = 0; t < n; t++) {                                                            \
                const KT *vrow = v_buf + ((int64_t)slots[t0 + t] * kv_heads + h) * dim;                  \
                for (int64_t d = 0; d < dim; d++) row[d] = LOADK(vrow[d]);                               \
                for (int64_t r = 0; r < nr; r++) {                                                       \
                    const float p = score[r][t];                                                         \
                    _Pragma("omp simd")                                                                  \
                    for (int64_t d = 0; d < dim; d++) acc[r][d] += p * row[d];                           \
                }                                                                                        \
            }                                                                                            \
        }                                                                                                \
        for (int64_t r = 0; r < nr; r++) {                                                               \
            T *orow = out + ids[r] * dim;                                                                \
            const float inv = run_sum[r] > 0.0f ? 1.0f / run_sum[r] : 0.0f;                              \
            for (int64_t d = 0; d < dim; d++) orow[d] = STORE(acc[r][d] * inv);                          \
            if (lse != NULL) lse[ids[r]] = row_lse(run_max[r], run_sum[r]);                              \
        }                                                                                                \
    }

DEFINE_ATTEND_ROWS(attend_rows_bf16, uint16_t, uint16_t, bf16_to_f32, bf16_to_f32, f32_to_bf16)
DEFINE_ATTEND_ROWS(attend_rows_f32, float, float, f32_id, f32_id, f32_id)
/* float32 queries and output over a bf16 KV cache (--kv-cache-dtype bfloat16 under float32 compute) */
DEFINE_ATTEND_ROWS(attend_rows_f32_bf16kv, float, uint16_t, f32_id, bf16_to_f32, f32_id)

#endif
