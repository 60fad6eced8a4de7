/* The block shared by the prefix and extend kernels: LANES (16) query rows of one kv head, one row per
 * lane (AVX-512: one vector; AVX2: two), attended over a run of pool slots. Each K and V row is read once
 * for all the rows; a lane may see only a part of the slots (a causal mask, a sliding window). The
 * online softmax runs across the lanes, so no score needs a horizontal sum.
 *
 * float32: one FMA per dim for scores and for V (a K or V element broadcast against the lanes).
 * bf16 on AVX2 or AVX-512 without BF16: K and V rows widened to float32 (per call by the extend kernel,
 * else per chunk), then the float32 code runs. bf16 with AVX-512 BF16 (dim % 32 == 0): a score is one
 * vdpbf16ps per bf16 pair of the head dim (exact products, float32 sums); the weights (rounded to bf16,
 * as torch's CPU flash attention does) meet V two tokens per vdpbf16ps, summed in float32.
 */
#ifndef RADIXSERVE_ATTENTION_LANES_H
#define RADIXSERVE_ATTENTION_LANES_H

#include "simd.h"

#ifdef SIMD_WIDTH
/* The lane block's vector `lv`: 16 float32 lanes, one query row each. AVX-512: one vector. AVX2: two 8-lane
 * vectors, so that each K or V element broadcast once feeds two FMAs (half the loads per FMA) and twice the
 * accumulators are in flight (FMA latency hidden). */
#define LANES 16 /* query rows per block, one per lane */
#if SIMD_WIDTH == 16
#define TOKENS 8  /* tokens scored together: independent FMA chains */
#define DBLOCK 16 /* columns of acc held in registers (of 32) as V streams by */
typedef vf lv;
typedef vi lvi;
typedef vmask lvm;
#define lv_zero vf_zero
#define lv_set1 vf_set1
#define lv_load vf_load
#define lv_store vf_store
#define lv_add vf_add
#define lv_sub vf_sub
#define lv_mul vf_mul
#define lv_max vf_max
#define lv_fmadd vf_fmadd
#define lv_select vf_select
#define lv_exp vf_exp_nonpositive
#define lvi_load vi_load
#define lv_within vm_within
#else
#define TOKENS 4 /* x 2 vectors: 8 FMA chains, 11 of the 16 ymm registers */
#define DBLOCK 4
typedef struct { vf lo, hi; } lv;
typedef struct { vi lo, hi; } lvi;
typedef struct { vmask lo, hi; } lvm;
static inline lv lv_zero(void) { return (lv){vf_zero(), vf_zero()}; }
static inline lv lv_set1(float x) {
    const vf v = vf_set1(x);
    return (lv){v, v};
}
static inline lv lv_load(const float *p) { return (lv){vf_load(p), vf_load(p + 8)}; }
static inline void lv_store(float *p, lv v) {
    vf_store(p, v.lo);
    vf_store(p + 8, v.hi);
}
#define LV_BINARY(NAME, OP) \
    static inline lv NAME(lv a, lv b) { return (lv){OP(a.lo, b.lo), OP(a.hi, b.hi)}; }
LV_BINARY(lv_add, vf_add)
LV_BINARY(lv_sub, vf_sub)
LV_BINARY(lv_mul, vf_mul)
LV_BINARY(lv_max, vf_max)
static inline lv lv_fmadd(lv a, lv b, lv c) { return (lv){vf_fmadd(a.lo, b.lo, c.lo), vf_fmadd(a.hi, b.hi, c.hi)}; }
static inline lv lv_select(lvm m, lv a, lv b) { return (lv){vf_select(m.lo, a.lo, b.lo), vf_select(m.hi, a.hi, b.hi)}; }
static inline lv lv_exp(lv x) { return (lv){vf_exp_nonpositive(x.lo), vf_exp_nonpositive(x.hi)}; }
static inline lvi lvi_load(const int32_t *p) { return (lvi){vi_load(p), vi_load(p + 8)}; }
static inline lvm lv_within(int64_t t, lvi low, lvi limit) {
    return (lvm){vm_within(t, low.lo, limit.lo), vm_within(t, low.hi, limit.hi)};
}
#endif

/* Folds one chunk of scores into the lanes' running (max, sum) and rescales acc; leaves the weights
 * exp(score - max) in scores. Lane r sees token t of the chunk only if low[r] <= t0 + t < limit[r]. A lane
 * that has seen nothing keeps (max -inf, sum 0, acc 0): exp_nonpositive turns the NaN of -inf - -inf into
 * its clamp, ~1e-38, which multiplies zeros or is masked to 0. */
static inline void softmax_lanes(lv *scores, int64_t n, int64_t t0, lvi low, lvi limit, int masked, lv *run_max,
                                 lv *run_sum, lv *acc, int64_t dim) {
    if (masked) {
        for (int64_t t = 0; t < n; t++)
            scores[t] = lv_select(lv_within(t0 + t, low, limit), scores[t], lv_set1(-INFINITY));
    }
    lv top = *run_max;
    for (int64_t t = 0; t < n; t++) top = lv_max(top, scores[t]);
    const lv rescale = lv_exp(lv_sub(*run_max, top));
    lv sum = lv_mul(*run_sum, rescale);
    for (int64_t d = 0; d < dim; d++) acc[d] = lv_mul(acc[d], rescale);
    for (int64_t t = 0; t < n; t++) {
        scores[t] = lv_exp(lv_sub(scores[t], top));
        if (masked) /* NOTE: exp_nonpositive clamps, so exp(-inf) is not 0 until masked here */
            scores[t] = lv_select(lv_within(t0 + t, low, limit), scores[t], lv_zero());
        sum = lv_add(sum, scores[t]);
    }
    *run_sum = sum;
    *run_max = top;
}

/* lane r of scores[t] = scale * q_r . rows[t] (float32 rows of the head dim). */
static inline void score_rows(const lv *qt, const float *const *rows, int64_t n, int64_t dim, float scale,
                              lv *scores) {
    for (int64_t t = 0; t < n; t += TOKENS) {
        const float *k[TOKENS];
        for (int64_t i = 0; i < TOKENS; i++) k[i] = rows[t + i < n ? t + i : n - 1];
        lv sum[TOKENS];
        for (int64_t i = 0; i < TOKENS; i++) sum[i] = lv_zero();
        for (int64_t d = 0; d < dim; d++) {
            const lv qd = qt[d];
            for (int64_t i = 0; i < TOKENS; i++) sum[i] = lv_fmadd(qd, lv_set1(k[i][d]), sum[i]);
        }
        for (int64_t i = 0; i < TOKENS && t + i < n; i++) scores[t + i] = lv_mul(sum[i], lv_set1(scale));
    }
}

/* acc[d] += sum_t weights[t] * rows[t][d] over the chunk's n tokens. Full blocks of DBLOCK columns have a
 * constant trip count, so their accumulators stay in registers (a variable one had the compiler test and
 * branch around every FMA); a last partial block takes the general loop. */
static inline void accumulate_rows(const lv *weights, const float *const *rows, int64_t n, int64_t dim, lv *acc) {
    int64_t d0 = 0;
    for (; d0 + DBLOCK <= dim; d0 += DBLOCK) {
        lv a[DBLOCK];
        for (int64_t dd = 0; dd < DBLOCK; dd++) a[dd] = acc[d0 + dd];
        for (int64_t t = 0; t < n; t++) {
            const float *v = rows[t] + d0;
            /* NOTE: an opaque pointer, so each v[dd] is v plus a constant: left to itself, GCC indexes the rows by
             * (d0 + dd) * 4 kept in registers, and with DBLOCK of them some spill and are reloaded per token */
            __asm__("" : "+r"(v));
            for (int64_t dd = 0; dd < DBLOCK; dd++) a[dd] = lv_fmadd(weights[t], lv_set1(v[dd]), a[dd]);
        }
        for (int64_t dd = 0; dd < DBLOCK; dd++) acc[d0 + dd] = a[dd];
    }
    for (; d0 < dim; d0++) {
        lv a = acc[d0];
        for (int64_t t = 0; t < n; t++) a = lv_fmadd(weights[t], lv_set1(rows[t][d0]), a);
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

static inline void score_chunk_f32(const lv *qt, const float *k_buf, const int32_t *slots, int64_t n,
                                   int64_t kv_heads, int64_t h, int64_t dim, float scale, lv *scores) {
    const float *rows[CHUNK];
    pool_rows_f32(k_buf, slots, n, kv_heads, h, dim, rows);
    score_rows(qt, rows, n, dim, scale, scores);
}

static inline void accumulate_chunk_f32(const lv *weights, const float *v_buf, const int32_t *slots, int64_t n,
                                        int64_t kv_heads, int64_t h, int64_t dim, lv *acc) {
    const float *rows[CHUNK];
    pool_rows_f32(v_buf, slots, n, kv_heads, h, dim, rows);
    accumulate_rows(weights, rows, n, dim, acc);
}

static inline void score_chunk_bf16_wide(const lv *qt, const uint16_t *k_buf, const int32_t *slots, int64_t n,
                                         int64_t kv_heads, int64_t h, int64_t dim, float scale, lv *scores) {
    float wide[CHUNK][MAX_DIM];
    const float *rows[CHUNK];
    pool_rows_bf16(k_buf, slots, n, kv_heads, h, dim, wide, rows);
    score_rows(qt, rows, n, dim, scale, scores);
}

static inline void accumulate_chunk_bf16_wide(const lv *weights, const uint16_t *v_buf, const int32_t *slots,
                                              int64_t n, int64_t kv_heads, int64_t h, int64_t dim, lv *acc) {
    float wide[CHUNK][MAX_DIM];
    const float *rows[CHUNK];
    pool_rows_bf16(v_buf, slots, n, kv_heads, h, dim, wide, rows);
    accumulate_rows(weights, rows, n, dim, acc);
}

/* qt[d], lane r = row r's q[d] in float32 (rows past nr repeat the last one). */
#define DEFINE_LOAD_Q(NAME, T, LOAD)                                                                     \
    static inline void NAME(lv *qt, const T *q, const int64_t *ids, int64_t nr, int64_t dim) {           \
        float lane[LANES];                                                                               \
        for (int64_t d = 0; d < dim; d++) {                                                              \
            for (int64_t r = 0; r < LANES; r++) lane[r] = LOAD(q[ids[r < nr ? r : nr - 1] * dim + d]);   \
            qt[d] = lv_load(lane);                                                                       \
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
 * slots[0..limits[r]); lows (NULL: none) likewise from slots[lows[r]] on (a sliding window, or the shared
 * prefix's first key a query sees); in any order: a chunk is masked lane by lane only where it crosses the
 * smallest limit or the largest low. Seeding and outputs as attend_rows_*. T: the query and output
 * type, KT: the K/V buffers'. QT: the type LOAD_Q fills (one vector per dim, or per bf16 pair for
 * vdpbf16ps). */
#define DEFINE_ATTEND_LANES(NAME, T, KT, QT, LOAD_Q, SCORE, ACCUMULATE, LOAD, STORE)                     \
    static void NAME(const T *q, const KT *k_buf, const KT *v_buf, const int64_t *ids, int64_t nr,       \
                     const int32_t *slots, int64_t len, const int32_t *limits, const int32_t *lows,      \
                     int64_t kv_heads,                                                                   \
                     int64_t h, int64_t dim, float scale, const T *seed_out, const float *seed_lse,      \
                     T *out, float *lse) {                                                               \
        QT qt[MAX_DIM];                                                                                  \
        lv acc[MAX_DIM], scores[CHUNK];                                                                  \
        float lanes[LANES];                                                                              \
        int32_t limit[LANES], low[LANES];                                                                \
        LOAD_Q(qt, q, ids, nr, dim);                                                                     \
        for (int64_t d = 0; d < dim; d++) {                                                              \
            for (int64_t r = 0; r < LANES && seed_lse != NULL; r++)                                      \
                lanes[r] = LOAD(seed_out[ids[r < nr ? r : nr - 1] * dim + d]);                           \
            acc[d] = seed_lse != NULL ? lv_load(lanes) : lv_zero();                                      \
        }                                                                                                \
        float seeded[LANES]; /* a seed's sum: 1, or 0 for an empty seed (lse -inf: it saw no key) */      \
        int32_t min_limit = (int32_t)len, max_low = 0;                                                   \
        for (int64_t r = 0; r < LANES; r++) {                                                            \
            lanes[r] = seed_lse != NULL ? seed_lse[ids[r < nr ? r : nr - 1]] : -INFINITY;                \
            seeded[r] = lanes[r] > -INFINITY ? 1.0f : 0.0f;                                              \
            limit[r] = limits != NULL ? limits[r < nr ? r : nr - 1] : (int32_t)len;                      \
            low[r] = lows != NULL ? lows[r < nr ? r : nr - 1] : 0;                                       \
            min_limit = limit[r] < min_limit ? limit[r] : min_limit;                                     \
            max_low = low[r] > max_low ? low[r] : max_low;                                               \
        }                                                                                                \
        lv run_max = lv_load(lanes);                                                                     \
        lv run_sum = lv_load(seeded);                                                                    \
        const lvi limit_v = lvi_load(limit), low_v = lvi_load(low);                                         \
        for (int64_t t0 = 0; t0 < len; t0 += CHUNK) {                                                    \
            const int64_t n = len - t0 < CHUNK ? len - t0 : CHUNK;                                       \
            SCORE(qt, k_buf, slots + t0, n, kv_heads, h, dim, scale, scores);                            \
            const int masked = t0 + n > min_limit || t0 < max_low;                                      \
            softmax_lanes(scores, n, t0, low_v, limit_v, masked, &run_max, &run_sum, acc, dim);          \
            ACCUMULATE(scores, v_buf, slots + t0, n, kv_heads, h, dim, acc);                             \
        }                                                                                                \
        float sums[LANES], maxes[LANES];                                                                 \
        lv_store(sums, run_sum);                                                                         \
        lv_store(maxes, run_max);                                                                        \
        for (int64_t d = 0; d < dim; d++) {                                                              \
            lv_store(lanes, acc[d]);                                                                     \
            for (int64_t r = 0; r < nr; r++)                                                           \
                out[ids[r] * dim + d] = STORE(sums[r] > 0.0f ? lanes[r] / sums[r] : 0.0f);               \
        }                                                                                                \
        for (int64_t r = 0; r < nr && lse != NULL; r++) lse[ids[r]] = row_lse(maxes[r], sums[r]);        \
    }

DEFINE_ATTEND_LANES(attend_lanes_f32, float, float, lv, load_q_f32, score_chunk_f32, accumulate_chunk_f32, f32_id,
                    f32_id)
DEFINE_ATTEND_LANES(attend_lanes_bf16_wide, uint16_t, uint16_t, lv, load_q_bf16_wide, score_chunk_bf16_wide,
                    accumulate_chunk_bf16_wide, bf16_to_f32, f32_to_bf16)
/* float32 queries and output over a bf16 KV cache (--kv-cache-dtype bfloat16), widened chunk by chunk */
DEFINE_ATTEND_LANES(attend_lanes_f32_bf16kv, float, uint16_t, lv, load_q_f32, score_chunk_bf16_wide,
                    accumulate_chunk_bf16_wide, f32_id, f32_id)
/* bf16 queries and output over K/V already widened to float32 (extend_attention.c's scratch copy) */
DEFINE_ATTEND_LANES(attend_lanes_bf16_f32kv, uint16_t, float, lv, load_q_bf16_wide, score_chunk_f32,
                    accumulate_chunk_f32, bf16_to_f32, f32_to_bf16)
#ifdef HAVE_AVX512_BF16
DEFINE_ATTEND_LANES(attend_lanes_bf16_dp, uint16_t, uint16_t, __m512i, load_q_bf16, score_chunk_bf16,
                    accumulate_chunk_bf16, bf16_to_f32, f32_to_bf16)
#endif
#endif

#endif
