/* The block shared by the prefix and extend kernels: LANES (= SIMD_WIDTH: 16 on AVX-512, 8 on AVX2)
 * query rows of one kv head, one row per vector lane, attended over a run of pool slots. Each K and V
 * row is read once for all the rows; a lane may see only a leading part of the slots (a causal
 * mask). The online softmax runs across the lanes, so no score needs a horizontal sum.
 *
 * float32: one FMA per dim for scores and for V (a K or V element broadcast against the lanes).
 * bf16 on AVX2 or AVX-512 without BF16: each chunk's K and V rows are widened to float32 once, then
 * the float32 code runs. bf16 with AVX-512 BF16 (dim % 32 == 0): a score is one vdpbf16ps per bf16
 * pair of the head dim (exact products, float32 sums); the weights (rounded to bf16, as torch's CPU
 * flash attention does) meet V two tokens per vdpbf16ps, summed in float32.
 */
#ifndef RADIXSERVE_ATTENTION_LANES_H
#define RADIXSERVE_ATTENTION_LANES_H

#include "simd.h"

#ifdef SIMD_WIDTH
#define LANES SIMD_WIDTH /* query rows per block, one per lane */
#define TOKENS 8         /* tokens scored together: independent FMA chains */
#define DBLOCK (SIMD_WIDTH == 16 ? 16 : 8) /* columns of acc held in registers (of 32 or 16) as V streams by */

/* Folds one chunk of scores into the lanes' running (max, sum) and rescales acc; leaves the weights
 * exp(score - max) in scores. Lane r sees token t of the chunk only if low[r] <= t0 + t < limit[r]. A lane
 * that has seen nothing keeps (max -inf, sum 0, acc 0): exp_nonpositive turns the NaN of -inf - -inf into
 * its clamp, ~1e-38, which multiplies zeros or is masked to 0. */
static inline void softmax_lanes(vf *scores, int64_t n, int64_t t0, vi low, vi limit, int masked, vf *run_max,
                                 vf *run_sum, vf *acc, int64_t dim) {
    if (masked) {
        for (int64_t t = 0; t < n; t++)
            scores[t] = vf_select(vm_within(t0 + t, low, limit), scores[t], vf_set1(-INFINITY));
    }
    vf top = *run_max;
    for (int64_t t = 0; t < n; t++) top = vf_max(top, scores[t]);
    const vf rescale = vf_exp_nonpositive(vf_sub(*run_max, top));
    vf sum = vf_mul(*run_sum, rescale);
    for (int64_t d = 0; d < dim; d++) acc[d] = vf_mul(acc[d], rescale);
    for (int64_t t = 0; t < n; t++) {
        scores[t] = vf_exp_nonpositive(vf_sub(scores[t], top));
        if (masked) /* NOTE: exp_nonpositive clamps, so exp(-inf) is not 0 until masked here */
            scores[t] = vf_select(vm_within(t0 + t, low, limit), scores[t], vf_zero());
        sum = vf_add(sum, scores[t]);
    }
    *run_sum = sum;
    *run_max = top;
}

/* lane r of scores[t] = scale * q_r . rows[t] (float32 rows of the head dim). */
static inline void score_rows(const vf *qt, const float *const *rows, int64_t n, int64_t dim, float scale,
                              vf *scores) {
    for (int64_t t = 0; t < n; t += TOKENS) {
        const float *k[TOKENS];
        for (int64_t i = 0; i < TOKENS; i++) k[i] = rows[t + i < n ? t + i : n - 1];
        vf sum[TOKENS];
        for (int64_t i = 0; i < TOKENS; i++) sum[i] = vf_zero();
        for (int64_t d = 0; d < dim; d++) {
            const vf qd = qt[d];
            for (int64_t i = 0; i < TOKENS; i++) sum[i] = vf_fmadd(qd, vf_set1(k[i][d]), sum[i]);
        }
        for (int64_t i = 0; i < TOKENS && t + i < n; i++) scores[t + i] = vf_mul(sum[i], vf_set1(scale));
    }
}

/* acc[d] += sum_t weights[t] * rows[t][d] over the chunk's n tokens. Full blocks of DBLOCK columns have a
 * constant trip count, so their accumulators stay in registers (a variable one had the compiler test and
 * branch around every FMA); a last partial block takes the general loop. */
static inline void accumulate_rows(const vf *weights, const float *const *rows, int64_t n, int64_t dim, vf *acc) {
    int64_t d0 = 0;
    for (; d0 + DBLOCK <= dim; d0 += DBLOCK) {
        vf a[DBLOCK];
        for (int64_t dd = 0; dd < DBLOCK; dd++) a[dd] = acc[d0 + dd];
        for (int64_t t = 0; t < n; t++) {
            const float *v = rows[t] + d0;
            for (int64_t dd = 0; dd < DBLOCK; dd++) a[dd] = vf_fmadd(weights[t], vf_set1(v[dd]), a[dd]);
        }
        for (int64_t dd = 0; dd < DBLOCK; dd++) acc[d0 + dd] = a[dd];
    }
    for (; d0 < dim; d0++) {
        vf a = acc[d0];
        for (int64_t t = 0; t < n; t++) a = vf_fmadd(weights[t], vf_set1(rows[t][d0]), a);
        acc[d0] = a;
    }
}

static inline void pool_rows_f32(const float *buf, const int32_t *slots, int64_t n, int64_t kv_heads, int64_t h,
                                 int64_t dim, const float **rows) {
    for (int64_t t = 0; t < n; t++) rows[t] = buf + ((int64_t)slots[t] * kv_heads + h) * dim;
}

/* bf16 pool rows widened into wide[t] (float32). */
static inline void pool_rows_bf16(const uint16_t *buf, const int32_t *slots, int64_t n, int64_t kv_heads, int64_t h,
                                  int64_t dim, float (*wide)[MAX_DIM], const float **rows) {
    for (int64_t t = 0; t < n; t++) {
        const uint16_t *src = buf + ((int64_t)slots[t] * kv_heads + h) * dim;
        int64_t d = 0;
        for (; d + SIMD_WIDTH <= dim; d += SIMD_WIDTH) vf_store(wide[t] + d, vf_load_bf16(src + d));
        for (; d < dim; d++) wide[t][d] = bf16_to_f32(src[d]);
        rows[t] = wide[t];
    }
}

static inline void score_chunk_f32(const vf *qt, const float *k_buf, const int32_t *slots, int64_t n,
                                   int64_t kv_heads, int64_t h, int64_t dim, float scale, vf *scores) {
    const float *rows[CHUNK];
    pool_rows_f32(k_buf, slots, n, kv_heads, h, dim, rows);
    score_rows(qt, rows, n, dim, scale, scores);
}

static inline void accumulate_chunk_f32(const vf *weights, const float *v_buf, const int32_t *slots, int64_t n,
                                        int64_t kv_heads, int64_t h, int64_t dim, vf *acc) {
    const float *rows[CHUNK];
    pool_rows_f32(v_buf, slots, n, kv_heads, h, dim, rows);
    accumulate_rows(weights, rows, n, dim, acc);
}

static inline void score_chunk_bf16_wide(const vf *qt, const uint16_t *k_buf, const int32_t *slots, int64_t n,
                                         int64_t kv_heads, int64_t h, int64_t dim, float scale, vf *scores) {
    float wide[CHUNK][MAX_DIM];
    const float *rows[CHUNK];
    pool_rows_bf16(k_buf, slots, n, kv_heads, h, dim, wide, rows);
    score_rows(qt, rows, n, dim, scale, scores);
}

static inline void accumulate_chunk_bf16_wide(const vf *weights, const uint16_t *v_buf, const int32_t *slots,
                                              int64_t n, int64_t kv_heads, int64_t h, int64_t dim, vf *acc) {
    float wide[CHUNK][MAX_DIM];
    const float *rows[CHUNK];
    pool_rows_bf16(v_buf, slots, n, kv_heads, h, dim, wide, rows);
    accumulate_rows(weights, rows, n, dim, acc);
}

/* qt[d], lane r = row r's q[d] in float32 (rows past nr repeat the last one). */
#define DEFINE_LOAD_Q(NAME, T, LOAD)                                                                     \
    static inline void NAME(vf *qt, const T *q, const int64_t *ids, int64_t nr, int64_t dim) {           \
        float lane[LANES];                                                                               \
        for (int64_t d = 0; d < dim; d++) {                                                              \
            for (int64_t r = 0; r < LANES; r++) lane[r] = LOAD(q[ids[r < nr ? r : nr - 1] * dim + d]);   \
            qt[d] = vf_load(lane);                                                                       \
        }                                                                                                \
    }
DEFINE_LOAD_Q(load_q_f32, float, f32_id)
DEFINE_LOAD_Q(load_q_bf16_wide, uint16_t, bf16_to_f32)

/* qt[j], lane r = row r's bf16 pair (2j, 2j + 1) of q, j < dim / 2. */
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

/* Rows ids[0..nr) (nr <= LANES) of kv head h over slots[0..len). limits (NULL: none): row r sees
 * slots[0..limits[r]), limits ascending with r; lows (NULL: none) likewise from slots[lows[r]] on (a
 * sliding window), lows ascending. Seeding and outputs as attend_rows_*. T: the query and output
 * type, KT: the K/V buffers'. QT: the type LOAD_Q fills (one vector per dim, or per bf16 pair for
 * vdpbf16ps). */
#define DEFINE_ATTEND_LANES(NAME, T, KT, QT, LOAD_Q, SCORE, ACCUMULATE, LOAD, STORE)                     \
    static void NAME(const T *q, const KT *k_buf, const KT *v_buf, const int64_t *ids, int64_t nr,       \
                     const int32_t *slots, int64_t len, const int32_t *limits, const int32_t *lows,      \
                     int64_t kv_heads,                                                                   \
                     int64_t h, int64_t dim, float scale, const T *seed_out, const float *seed_lse,      \
                     T *out, float *lse) {                                                               \
        QT qt[MAX_DIM];                                                                                  \
        vf acc[MAX_DIM], scores[CHUNK];                                                                  \
        float lanes[LANES];                                                                              \
        int32_t limit[LANES], low[LANES];                                                                \
        LOAD_Q(qt, q, ids, nr, dim);                                                                     \
        for (int64_t d = 0; d < dim; d++) {                                                              \
            for (int64_t r = 0; r < LANES && seed_lse != NULL; r++)                                      \
                lanes[r] = LOAD(seed_out[ids[r < nr ? r : nr - 1] * dim + d]);                           \
            acc[d] = seed_lse != NULL ? vf_load(lanes) : vf_zero();                                      \
        }                                                                                                \
        for (int64_t r = 0; r < LANES; r++) {                                                            \
            lanes[r] = seed_lse != NULL ? seed_lse[ids[r < nr ? r : nr - 1]] : -INFINITY;                \
            limit[r] = limits != NULL ? limits[r < nr ? r : nr - 1] : (int32_t)len;                      \
            low[r] = lows != NULL ? lows[r < nr ? r : nr - 1] : 0;                                       \
        }                                                                                                \
        vf run_max = vf_load(lanes);                                                                     \
        vf run_sum = vf_set1(seed_lse != NULL ? 1.0f : 0.0f);                                            \
        const vi limit_v = vi_load(limit), low_v = vi_load(low);                                         \
        for (int64_t t0 = 0; t0 < len; t0 += CHUNK) {                                                    \
            const int64_t n = len - t0 < CHUNK ? len - t0 : CHUNK;                                       \
            SCORE(qt, k_buf, slots + t0, n, kv_heads, h, dim, scale, scores);                            \
            const int masked = t0 + n > limit[0] || t0 < low[LANES - 1];                                 \
            softmax_lanes(scores, n, t0, low_v, limit_v, masked, &run_max, &run_sum, acc, dim);          \
            ACCUMULATE(scores, v_buf, slots + t0, n, kv_heads, h, dim, acc);                             \
        }                                                                                                \
        float sums[LANES], maxes[LANES];                                                                 \
        vf_store(sums, run_sum);                                                                         \
        vf_store(maxes, run_max);                                                                        \
        for (int64_t d = 0; d < dim; d++) {                                                              \
            vf_store(lanes, acc[d]);                                                                     \
            for (int64_t r = 0; r < nr; r++)                                                           \
                out[ids[r] * dim + d] = STORE(sums[r] > 0.0f ? lanes[r] / sums[r] : 0.0f);               \
        }                                                                                                \
        for (int64_t r = 0; r < nr && lse != NULL; r++) lse[ids[r]] = row_lse(maxes[r], sums[r]);        \
    }

DEFINE_ATTEND_LANES(attend_lanes_f32, float, float, vf, load_q_f32, score_chunk_f32, accumulate_chunk_f32, f32_id,
                    f32_id)
DEFINE_ATTEND_LANES(attend_lanes_bf16_wide, uint16_t, uint16_t, vf, load_q_bf16_wide, score_chunk_bf16_wide,
                    accumulate_chunk_bf16_wide, bf16_to_f32, f32_to_bf16)
/* bf16 queries and output over K/V already widened to float32 (extend_attention.c's scratch copy) */
DEFINE_ATTEND_LANES(attend_lanes_bf16_f32kv, uint16_t, float, vf, load_q_bf16_wide, score_chunk_f32,
                    accumulate_chunk_f32, bf16_to_f32, f32_to_bf16)
#ifdef HAVE_AVX512_BF16
DEFINE_ATTEND_LANES(attend_lanes_bf16_dp, uint16_t, uint16_t, __m512i, load_q_bf16, score_chunk_bf16,
                    accumulate_chunk_bf16, bf16_to_f32, f32_to_bf16)
#endif
#endif

#endif
