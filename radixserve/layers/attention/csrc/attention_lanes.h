/* The AVX-512 block shared by the prefix and extend kernels: 16 query rows of one kv head, one row
 * per vector lane, attended over a run of pool slots. Each K and V row is read once for all 16 rows;
 * a lane may see only a leading part of the slots (a causal mask). The online softmax runs across
 * the lanes, so no score needs a horizontal sum.
 *
 * bf16 (AVX-512 BF16): a score is one vdpbf16ps per bf16 pair of the head dim (exact products,
 * float32 sums); the weights (rounded to bf16, as torch's CPU flash attention does) meet V two tokens
 * per vdpbf16ps, summed in float32. float32 (AVX-512F): one FMA per dim for scores and for V.
 */
#ifndef RADIXSERVE_ATTENTION_LANES_H
#define RADIXSERVE_ATTENTION_LANES_H

#include "attention_common.h"

#ifdef HAVE_AVX512
#define LANES MAX_ROWS /* query rows per block, one per lane */
#define TOKENS 8       /* tokens scored together: independent FMA chains */

/* Lanes whose rows see key t (t < their limit). */
static inline __mmask16 lanes_seeing(int64_t t, __m512i limit) {
    return _mm512_cmplt_epi32_mask(_mm512_set1_epi32((int)t), limit);
}

/* Folds one chunk of scores into the lanes' running (max, sum) and rescales acc; leaves the weights
 * exp(score - max) in scores. Lane r sees token t of the chunk only if t0 + t < limit[r]. */
static inline void softmax_lanes(__m512 *scores, int64_t n, int64_t t0, __m512i limit, int masked,
                                 __m512 *run_max, __m512 *run_sum, __m512 *acc, int64_t dim) {
    if (masked) {
        for (int64_t t = 0; t < n; t++)
            scores[t] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), lanes_seeing(t0 + t, limit), scores[t]);
    }
    __m512 top = *run_max;
    for (int64_t t = 0; t < n; t++) top = _mm512_max_ps(top, scores[t]);
    const __m512 rescale = exp_nonpositive(_mm512_sub_ps(*run_max, top));
    __m512 sum = _mm512_mul_ps(*run_sum, rescale);
    for (int64_t d = 0; d < dim; d++) acc[d] = _mm512_mul_ps(acc[d], rescale);
    for (int64_t t = 0; t < n; t++) {
        scores[t] = exp_nonpositive(_mm512_sub_ps(scores[t], top));
        if (masked) /* NOTE: exp_nonpositive clamps, so exp(-inf) is not 0 until masked here */
            scores[t] = _mm512_maskz_mov_ps(lanes_seeing(t0 + t, limit), scores[t]);
        sum = _mm512_add_ps(sum, scores[t]);
    }
    *run_sum = sum;
    *run_max = top;
}

/* float32: lane r of qt[d] is row r's q[d]; lane r of scores[t] = scale * q_r . k_t. */
static inline void score_chunk_f32(const __m512i *qt, const float *k_buf, const int32_t *slots, int64_t n,
                                   int64_t kv_heads, int64_t h, int64_t dim, float scale, __m512 *scores) {
    for (int64_t t = 0; t < n; t += TOKENS) {
        const float *krow[TOKENS];
        for (int64_t i = 0; i < TOKENS; i++)
            krow[i] = k_buf + ((int64_t)slots[t + i < n ? t + i : n - 1] * kv_heads + h) * dim;
        __m512 sum[TOKENS];
        for (int64_t i = 0; i < TOKENS; i++) sum[i] = _mm512_setzero_ps();
        for (int64_t d = 0; d < dim; d++) {
            const __m512 qd = _mm512_castsi512_ps(qt[d]);
            for (int64_t i = 0; i < TOKENS; i++) sum[i] = _mm512_fmadd_ps(qd, _mm512_set1_ps(krow[i][d]), sum[i]);
        }
        for (int64_t i = 0; i < TOKENS && t + i < n; i++) scores[t + i] = _mm512_mul_ps(sum[i], _mm512_set1_ps(scale));
    }
}

/* float32: acc[d] += sum_t weights[t] * v_t[d] over the chunk's n tokens. */
static inline void accumulate_chunk_f32(const __m512 *weights, const float *v_buf, const int32_t *slots, int64_t n,
                                        int64_t kv_heads, int64_t h, int64_t dim, __m512 *acc) {
    const float *vrow[CHUNK];
    for (int64_t t = 0; t < n; t++) vrow[t] = v_buf + ((int64_t)slots[t] * kv_heads + h) * dim;
    for (int64_t d0 = 0; d0 < dim; d0 += 16) {
        const int64_t w = dim - d0 < 16 ? dim - d0 : 16;
        __m512 a[16];
        for (int64_t dd = 0; dd < w; dd++) a[dd] = acc[d0 + dd];
        for (int64_t t = 0; t < n; t++) {
            const float *v = vrow[t] + d0;
            for (int64_t dd = 0; dd < w; dd++) a[dd] = _mm512_fmadd_ps(weights[t], _mm512_set1_ps(v[dd]), a[dd]);
        }
        for (int64_t dd = 0; dd < w; dd++) acc[d0 + dd] = a[dd];
    }
}

/* qt[j] for a block's rows: bf16, lane r = row r's pair (2j, 2j + 1), j < dim / 2; float32, row r's q[j]. */
static inline void load_q_f32(__m512i *qt, const float *q, const int64_t *ids, int64_t nr, int64_t dim) {
    float lane[LANES];
    for (int64_t d = 0; d < dim; d++) {
        for (int64_t r = 0; r < LANES; r++) lane[r] = q[ids[r < nr ? r : nr - 1] * dim + d];
        qt[d] = _mm512_castps_si512(_mm512_loadu_ps(lane));
    }
}

#ifdef HAVE_AVX512_BF16
static inline void load_q_bf16(__m512i *qt, const uint16_t *q, const int64_t *ids, int64_t nr, int64_t dim) {
    uint32_t pair[LANES];
    for (int64_t j = 0; j < dim / 2; j++) {
        for (int64_t r = 0; r < LANES; r++) memcpy(&pair[r], q + ids[r < nr ? r : nr - 1] * dim + 2 * j, 4);
        qt[j] = _mm512_loadu_si512(pair);
    }
}

/* Lane r of scores[t] = scale * q_r . k_t for tokens t0 .. t0 + n of the chunk. */
static inline void score_chunk_bf16(const __m512i *qt, const uint16_t *k_buf, const int32_t *slots, int64_t n,
                               int64_t kv_heads, int64_t h, int64_t dim, float scale, __m512 *scores) {
    for (int64_t t = 0; t < n; t += TOKENS) {
        const uint32_t *krow[TOKENS];
        for (int64_t i = 0; i < TOKENS; i++) {
            const int64_t slot = slots[t + i < n ? t + i : n - 1];
            krow[i] = (const uint32_t *)(k_buf + (slot * kv_heads + h) * dim);
        }
        __m512 sum[TOKENS];
        for (int64_t i = 0; i < TOKENS; i++) sum[i] = _mm512_setzero_ps();
        for (int64_t j = 0; j < dim / 2; j++) {
            const __m512bh qj = (__m512bh)qt[j];
            for (int64_t i = 0; i < TOKENS; i++)
                sum[i] = _mm512_dpbf16_ps(sum[i], qj, (__m512bh)_mm512_set1_epi32((int)krow[i][j]));
        }
        for (int64_t i = 0; i < TOKENS && t + i < n; i++) scores[t + i] = _mm512_mul_ps(sum[i], _mm512_set1_ps(scale));
    }
}

/* acc[d] += sum_t weights[t] * v_t[d] over the chunk's n tokens, two tokens per vdpbf16ps: lane r of
 * wpair[p] holds row r's bf16 weights of tokens 2p and 2p + 1, word d of vpair[p] their V values at d. */
static inline void accumulate_chunk_bf16(const __m512 *weights, const uint16_t *v_buf, const int32_t *slots, int64_t n,
                                    int64_t kv_heads, int64_t h, int64_t dim, __m512 *acc) {
    static const uint16_t lo_words[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                          8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    const __m512i lo = _mm512_loadu_si512(lo_words), hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    uint32_t vpair[CHUNK / 2][MAX_DIM];
    __m512i wpair[CHUNK / 2];
    const int64_t pairs = (n + 1) / 2;
    for (int64_t p = 0; p < pairs; p++) {
        const uint16_t *a = v_buf + ((int64_t)slots[2 * p] * kv_heads + h) * dim;
        const int has_b = 2 * p + 1 < n;
        const uint16_t *b = has_b ? v_buf + ((int64_t)slots[2 * p + 1] * kv_heads + h) * dim : NULL;
        for (int64_t d = 0; d < dim; d += 32) {
            const __m512i va = _mm512_loadu_si512(a + d), vb = has_b ? _mm512_loadu_si512(b + d) : _mm512_setzero_si512();
            _mm512_storeu_si512(vpair[p] + d, _mm512_permutex2var_epi16(va, lo, vb));
            _mm512_storeu_si512(vpair[p] + d + 16, _mm512_permutex2var_epi16(va, hi, vb));
        }
        const __m512i wa = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(weights[2 * p]));
        const __m512i wb = has_b ? _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(weights[2 * p + 1]))
                                 : _mm512_setzero_si512();
        wpair[p] = _mm512_or_si512(wa, _mm512_slli_epi32(wb, 16));
    }
    for (int64_t d0 = 0; d0 < dim; d0 += 16) {
        __m512 a[16];
        for (int64_t dd = 0; dd < 16; dd++) a[dd] = acc[d0 + dd];
        for (int64_t p = 0; p < pairs; p++) {
            const __m512bh w = (__m512bh)wpair[p];
            for (int64_t dd = 0; dd < 16; dd++)
                a[dd] = _mm512_dpbf16_ps(a[dd], w, (__m512bh)_mm512_set1_epi32((int)vpair[p][d0 + dd]));
        }
        for (int64_t dd = 0; dd < 16; dd++) acc[d0 + dd] = a[dd];
    }
}
#endif

/* Rows ids[0..nr) (nr <= 16) of kv head h over slots[0..len). limits (NULL: none): row r sees
 * slots[0..limits[r]), limits ascending with r. Seeding and outputs as attend_rows_*. bf16 needs
 * dim % 32 == 0. */
#define DEFINE_ATTEND_LANES(NAME, T, LOAD_Q, SCORE, ACCUMULATE, LOAD, STORE)                             \
    static void NAME(const T *q, const T *k_buf, const T *v_buf, const int64_t *ids, int64_t nr,         \
                     const int32_t *slots, int64_t len, const int32_t *limits, int64_t kv_heads,         \
                     int64_t h, int64_t dim, float scale, const T *seed_out, const float *seed_lse,      \
                     T *out, float *lse) {                                                               \
        __m512i qt[MAX_DIM];                                                                             \
        __m512 acc[MAX_DIM], scores[CHUNK];                                                              \
        float lanes[LANES];                                                                              \
        int32_t limit[LANES];                                                                            \
        LOAD_Q(qt, q, ids, nr, dim);                                                                     \
        for (int64_t d = 0; d < dim; d++) {                                                              \
            for (int64_t r = 0; r < LANES && seed_lse != NULL; r++)                                      \
                lanes[r] = LOAD(seed_out[ids[r < nr ? r : nr - 1] * dim + d]);                           \
            acc[d] = seed_lse != NULL ? _mm512_loadu_ps(lanes) : _mm512_setzero_ps();                    \
        }                                                                                                \
        for (int64_t r = 0; r < LANES; r++) {                                                            \
            lanes[r] = seed_lse != NULL ? seed_lse[ids[r < nr ? r : nr - 1]] : -INFINITY;                \
            limit[r] = limits != NULL ? limits[r < nr ? r : nr - 1] : (int32_t)len;                      \
        }                                                                                                \
        __m512 run_max = _mm512_loadu_ps(lanes);                                                         \
        __m512 run_sum = _mm512_set1_ps(seed_lse != NULL ? 1.0f : 0.0f);                                 \
        const __m512i limit_v = _mm512_loadu_si512(limit);                                               \
        for (int64_t t0 = 0; t0 < len; t0 += CHUNK) {                                                    \
            const int64_t n = len - t0 < CHUNK ? len - t0 : CHUNK;                                       \
            SCORE(qt, k_buf, slots + t0, n, kv_heads, h, dim, scale, scores);                            \
            softmax_lanes(scores, n, t0, limit_v, t0 + n > limit[0], &run_max, &run_sum, acc, dim);      \
            ACCUMULATE(scores, v_buf, slots + t0, n, kv_heads, h, dim, acc);                             \
        }                                                                                                \
        float sums[LANES], maxes[LANES];                                                                 \
        _mm512_storeu_ps(sums, run_sum);                                                                 \
        _mm512_storeu_ps(maxes, run_max);                                                                \
        for (int64_t d = 0; d < dim; d++) {                                                              \
            _mm512_storeu_ps(lanes, acc[d]);                                                             \
            for (int64_t r = 0; r < nr; r++) out[ids[r] * dim + d] = STORE(lanes[r] / sums[r]);          \
        }                                                                                                \
        for (int64_t r = 0; r < nr && lse != NULL; r++) lse[ids[r]] = row_lse(maxes[r], sums[r]);        \
    }

DEFINE_ATTEND_LANES(attend_lanes_f32, float, load_q_f32, score_chunk_f32, accumulate_chunk_f32, f32_id, f32_id)
#ifdef HAVE_AVX512_BF16
DEFINE_ATTEND_LANES(attend_lanes_bf16, uint16_t, load_q_bf16, score_chunk_bf16, accumulate_chunk_bf16, bf16_to_f32,
                    f32_to_bf16)
#endif
#endif

#endif
