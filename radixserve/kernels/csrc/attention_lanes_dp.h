/* vdpbf16ps pieces of the one-vector lane block (attention_lane_block.h includes this in its _x1 instance where
 * AVX-512 BF16 is present): bf16 queries over a bf16 K/V pool, dim % 32 == 0. A score is one vdpbf16ps per bf16
 * pair of the head dim (exact products, float32 sums); the weights (rounded to bf16, as torch's CPU flash
 * attention does) meet V two tokens per vdpbf16ps, summed in float32.
 */
/* qt[j], lane r = row r's bf16 pair (2j, 2j + 1) of q, j < dim / 2. */
static inline void load_q_bf16(__m512i *qt, const uint16_t *q, const int64_t *ids, int64_t nr, int64_t dim) {
    uint32_t pair[SIMD_WIDTH];
    for (int64_t j = 0; j < dim / 2; j++) {
        for (int64_t r = 0; r < SIMD_WIDTH; r++) memcpy(&pair[r], q + ids[r < nr ? r : nr - 1] * dim + 2 * j, 4);
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
