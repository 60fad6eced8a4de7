/* Shared-prefix attention for the CPU (part (a) of cascade attention): every query token of a batch
 * attends, unmasked, over one run of slots that all its requests share -- the batch's common prefix.
 *
 * Work is split into units of 16 query rows of one kv head (row j of head h is query token j / group,
 * head h * group + j % group), spread over OpenMP threads. A unit streams the prefix's K and V rows of
 * its head once, in place from the pool, so the prefix is read once per 16 query rows instead of
 * once per request. The AVX-512 BF16 path keeps the 16 rows in the 16 lanes of each vector: a score
 * is one vdpbf16ps per bf16 pair of the head dim (exact products, float32 sums) with no horizontal
 * sum, the online softmax runs across the lanes, and the weights (rounded to bf16, as torch's CPU
 * flash attention does) meet V two tokens per vdpbf16ps, summed in float32. Writes the
 * normalised output and each row's log-sum-exp (float32 [num_tokens, heads]).
 */
#include "attention_common.h"

#define LANES MAX_ROWS /* query rows per unit */

/* The pool ids (token * heads + head) of a unit's rows j0 .. j0 + nr of kv head h. */
static inline void unit_rows(int64_t *ids, int64_t j0, int64_t nr, int64_t h, int64_t group, int64_t heads) {
    for (int64_t r = 0; r < nr; r++) ids[r] = ((j0 + r) / group) * heads + h * group + (j0 + r) % group;
}

#define DEFINE_PREFIX(NAME, T, ATTEND_ROWS)                                                              \
    int NAME(const T *q, const T *k_buf, const T *v_buf, const int32_t *slots, T *out, float *lse,       \
             int64_t num_tokens, int64_t prefix_len, int64_t heads, int64_t kv_heads, int64_t dim,       \
             float scale, int num_threads) {                                                             \
        const int64_t group = heads / kv_heads, rows = num_tokens * (heads / kv_heads);                  \
        if (dim > MAX_DIM || group * kv_heads != heads) return 1;                                        \
        const int64_t blocks = (rows + LANES - 1) / LANES;                                               \
        _Pragma("omp parallel for schedule(dynamic, 1) num_threads(num_threads)")                        \
        for (int64_t unit = 0; unit < kv_heads * blocks; unit++) {                                       \
            const int64_t h = unit / blocks, j0 = (unit % blocks) * LANES;                               \
            const int64_t nr = rows - j0 < LANES ? rows - j0 : LANES;                                    \
            int64_t ids[LANES];                                                                          \
            unit_rows(ids, j0, nr, h, group, heads);                                                     \
            ATTEND_ROWS(q, k_buf, v_buf, ids, nr, slots, prefix_len, kv_heads, h, dim, scale, NULL, NULL, out, \
                        lse);                                                                    \
        }                                                                                                \
        return 0;                                                                                        \
    }

DEFINE_PREFIX(prefix_attention_bf16_generic, uint16_t, attend_rows_bf16)
DEFINE_PREFIX(prefix_attention_f32, float, attend_rows_f32)

#ifdef HAVE_AVX512_BF16
#define TOKENS 8 /* tokens scored together: independent vdpbf16ps chains */

/* Lane r of scores[t] = scale * q_r . k_t for tokens t0 .. t0 + n of the chunk. */
static inline void score_chunk(const __m512i *qt, const uint16_t *k_buf, const int32_t *slots, int64_t n,
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
static inline void accumulate_chunk(const __m512 *weights, const uint16_t *v_buf, const int32_t *slots, int64_t n,
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

/* Rows ids[0..nr) (nr <= 16) of kv head h over slots[0..len); dim % 32 == 0. */
static void prefix_block_bf16_avx512(const uint16_t *q, const uint16_t *k_buf, const uint16_t *v_buf,
                                     const int64_t *ids, int64_t nr, const int32_t *slots, int64_t len,
                                     int64_t kv_heads, int64_t h, int64_t dim, float scale, uint16_t *out,
                                     float *lse) {
    __m512i qt[MAX_DIM / 2]; /* lane r of qt[j]: row r's bf16 pair (2j, 2j + 1) */
    __m512 acc[MAX_DIM], scores[CHUNK];
    for (int64_t j = 0; j < dim / 2; j++) {
        uint32_t lane[LANES];
        for (int64_t r = 0; r < LANES; r++) memcpy(&lane[r], q + ids[r < nr ? r : nr - 1] * dim + 2 * j, 4);
        qt[j] = _mm512_loadu_si512(lane);
    }
    for (int64_t d = 0; d < dim; d++) acc[d] = _mm512_setzero_ps();
    __m512 run_max = _mm512_set1_ps(-INFINITY), run_sum = _mm512_setzero_ps();
    for (int64_t t0 = 0; t0 < len; t0 += CHUNK) {
        const int64_t n = len - t0 < CHUNK ? len - t0 : CHUNK;
        score_chunk(qt, k_buf, slots + t0, n, kv_heads, h, dim, scale, scores);
        __m512 top = run_max;
        for (int64_t t = 0; t < n; t++) top = _mm512_max_ps(top, scores[t]);
        const __m512 rescale = exp_nonpositive(_mm512_sub_ps(run_max, top));
        run_sum = _mm512_mul_ps(run_sum, rescale);
        for (int64_t d = 0; d < dim; d++) acc[d] = _mm512_mul_ps(acc[d], rescale);
        for (int64_t t = 0; t < n; t++) {
            scores[t] = exp_nonpositive(_mm512_sub_ps(scores[t], top));
            run_sum = _mm512_add_ps(run_sum, scores[t]);
        }
        run_max = top;
        accumulate_chunk(scores, v_buf, slots + t0, n, kv_heads, h, dim, acc);
    }
    float sums[LANES], maxes[LANES], lanes[LANES];
    _mm512_storeu_ps(sums, run_sum);
    _mm512_storeu_ps(maxes, run_max);
    for (int64_t d = 0; d < dim; d++) {
        _mm512_storeu_ps(lanes, acc[d]);
        for (int64_t r = 0; r < nr; r++) out[ids[r] * dim + d] = f32_to_bf16(lanes[r] / sums[r]);
    }
    for (int64_t r = 0; r < nr; r++) lse[ids[r]] = row_lse(maxes[r], sums[r]);
}
#endif

int prefix_attention_bf16(const uint16_t *q, const uint16_t *k_buf, const uint16_t *v_buf, const int32_t *slots,
                          uint16_t *out, float *lse, int64_t num_tokens, int64_t prefix_len, int64_t heads,
                          int64_t kv_heads, int64_t dim, float scale, int num_threads) {
#ifdef HAVE_AVX512_BF16
    const int64_t group = heads / kv_heads, rows = num_tokens * (heads / kv_heads);
    if (dim % 32 == 0 && dim <= MAX_DIM && group * kv_heads == heads && prefix_len > 0) {
        const int64_t blocks = (rows + LANES - 1) / LANES;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
        for (int64_t unit = 0; unit < kv_heads * blocks; unit++) {
            const int64_t h = unit / blocks, j0 = (unit % blocks) * LANES;
            const int64_t nr = rows - j0 < LANES ? rows - j0 : LANES;
            int64_t ids[LANES];
            unit_rows(ids, j0, nr, h, group, heads);
            prefix_block_bf16_avx512(q, k_buf, v_buf, ids, nr, slots, prefix_len, kv_heads, h, dim, scale, out, lse);
        }
        return 0;
    }
#endif
    return prefix_attention_bf16_generic(q, k_buf, v_buf, slots, out, lse, num_tokens, prefix_len, heads, kv_heads,
                                         dim, scale, num_threads);
}
