/* vdpbf16ps pieces of the lane block, for bf16 queries over a bf16 K/V pool with dim % 32 == 0, where AVX-512 BF16
 * is present: attention_lane_block.h includes this in each of its widths (LB names, TOKENS, LANE_VECS). A score is
 * one vdpbf16ps per bf16 pair of the head dim (exact products, float32 sums); the weights (rounded to bf16, as
 * torch's CPU flash attention does) meet V two tokens per vdpbf16ps, summed in float32. Each K or V pair broadcast
 * feeds the block's LANE_VECS vectors. The block's score and acc vectors are read as __m512: vector k of token t
 * (or dim d) at t * LANE_VECS + k.
 */
#define DP_COLS (16 / LANE_VECS) /* columns of acc held in registers as V streams by */

typedef struct {
    __m512i half[LANE_VECS];
} LB(qpairs);

/* qt[j], lane r of half k = row 16k + r's bf16 pair (2j, 2j + 1) of q, j < dim / 2 (rows past nr repeat the last
 * one); written row by row first, as load_q_f32 is. */
static inline void LB(load_q_bf16)(LB(qpairs) *qt, const uint16_t *q, const int64_t *ids, int64_t nr, int64_t dim) {
    uint32_t pair[MAX_DIM / 2][BLOCK_LANES];
    for (int64_t r = 0; r < BLOCK_LANES; r++) {
        const uint16_t *row = q + ids[r < nr ? r : nr - 1] * dim;
        for (int64_t j = 0; j < dim / 2; j++) memcpy(&pair[j][r], row + 2 * j, 4);
    }
    for (int64_t j = 0; j < dim / 2; j++)
        for (int k = 0; k < LANE_VECS; k++) qt[j].half[k] = _mm512_loadu_si512(pair[j] + 16 * k);
}

/* Lane r of scores[t] = scale * q_r . k_t for tokens t0 .. t0 + n of the chunk. */
static inline void LB(score_chunk_bf16)(const LB(qpairs) *qt, const uint16_t *k_buf, const int32_t *slots, int64_t n,
                                        int64_t kv_heads, int64_t h, int64_t dim, float scale, LB(lv) *block) {
    __m512 *scores = (__m512 *)block;
    for (int64_t t = 0; t < n; t += TOKENS) {
        const uint32_t *krow[TOKENS];
        for (int64_t i = 0; i < TOKENS; i++) {
            const int64_t slot = slots[t + i < n ? t + i : n - 1];
            krow[i] = (const uint32_t *)(k_buf + (slot * kv_heads + h) * dim);
        }
        __m512 sum[TOKENS][LANE_VECS];
        for (int64_t i = 0; i < TOKENS; i++)
            for (int k = 0; k < LANE_VECS; k++) sum[i][k] = _mm512_setzero_ps();
        for (int64_t j = 0; j < dim / 2; j++) {
            for (int64_t i = 0; i < TOKENS; i++) {
                const __m512bh kj = (__m512bh)_mm512_set1_epi32((int)krow[i][j]);
                for (int k = 0; k < LANE_VECS; k++)
                    sum[i][k] = _mm512_dpbf16_ps(sum[i][k], (__m512bh)qt[j].half[k], kj);
            }
        }
        for (int64_t i = 0; i < TOKENS && t + i < n; i++)
            for (int k = 0; k < LANE_VECS; k++)
                scores[(t + i) * LANE_VECS + k] = _mm512_mul_ps(sum[i][k], _mm512_set1_ps(scale));
    }
}

/* acc[d] += sum_t weights[t] * v_t[d] over the chunk's n tokens, two tokens per vdpbf16ps: lane r of
 * wpair[p][k] holds row 16k + r's bf16 weights of tokens 2p and 2p + 1, word d of vpair[p] their V values at d. */
static inline void LB(accumulate_chunk_bf16)(const LB(lv) *block_weights, const uint16_t *v_buf, const int32_t *slots,
                                             int64_t n, int64_t kv_heads, int64_t h, int64_t dim, LB(lv) *block_acc) {
    static const uint16_t lo_words[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                          8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    const __m512 *weights = (const __m512 *)block_weights;
    __m512 *acc = (__m512 *)block_acc;
    const __m512i lo = _mm512_loadu_si512(lo_words), hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    uint32_t vpair[CHUNK / 2][MAX_DIM];
    __m512i wpair[CHUNK / 2][LANE_VECS];
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
        for (int k = 0; k < LANE_VECS; k++) {
            const __m512i wa = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(weights[2 * p * LANE_VECS + k]));
            const __m512i wb = has_b ? _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(weights[(2 * p + 1) * LANE_VECS + k]))
                                     : _mm512_setzero_si512();
            wpair[p][k] = _mm512_or_si512(wa, _mm512_slli_epi32(wb, 16));
        }
    }
    for (int64_t d0 = 0; d0 < dim; d0 += DP_COLS) {
        __m512 a[DP_COLS][LANE_VECS];
        for (int64_t dd = 0; dd < DP_COLS; dd++)
            for (int k = 0; k < LANE_VECS; k++) a[dd][k] = acc[(d0 + dd) * LANE_VECS + k];
        for (int64_t p = 0; p < pairs; p++) {
            for (int64_t dd = 0; dd < DP_COLS; dd++) {
                const __m512bh v = (__m512bh)_mm512_set1_epi32((int)vpair[p][d0 + dd]);
                for (int k = 0; k < LANE_VECS; k++) a[dd][k] = _mm512_dpbf16_ps(a[dd][k], (__m512bh)wpair[p][k], v);
            }
        }
        for (int64_t dd = 0; dd < DP_COLS; dd++)
            for (int k = 0; k < LANE_VECS; k++) acc[(d0 + dd) * LANE_VECS + k] = a[dd][k];
    }
}
#undef DP_COLS
