/* One width of the lane block of attention_lanes.h, which includes this file twice: with LANE_VECS 1 (names
 * ending _x1: SIMD_WIDTH query rows, one vector) and LANE_VECS 2 (_x2: two vectors, 2 * SIMD_WIDTH rows). A
 * block of two vectors feeds each K or V element it broadcasts to two FMAs, so it issues fewer loads per FMA
 * and has twice the accumulators in flight; a block of one wastes no lanes on a unit of SIMD_WIDTH rows or
 * fewer (a short extend, a request's last rows).
 *
 * TOKENS: tokens scored together (independent FMA chains: TOKENS x LANE_VECS). DBLOCK: columns of acc held in
 * registers as V streams by. Both are sized to the register file: 32 zmm with AVX-512, 16 ymm with AVX2.
 */
#if LANE_VECS == 1
#define LB(name) name##_x1
#define TOKENS 8
#define DBLOCK (SIMD_WIDTH == 16 ? 16 : 8)
#else
#define LB(name) name##_x2
#define TOKENS (SIMD_WIDTH == 16 ? 8 : 4)
#define DBLOCK (SIMD_WIDTH == 16 ? 8 : 4)
#endif
#define BLOCK_LANES (LANE_VECS * SIMD_WIDTH) /* query rows of one block, one per lane */

#if LANE_VECS == 1
typedef vf LB(lv);
typedef vi LB(lvi);
typedef vmask LB(lvm);
#define LB_UNARY(NAME, OP) \
    static inline LB(lv) LB(NAME)(LB(lv) a) { return OP(a); }
#define LB_BINARY(NAME, OP) \
    static inline LB(lv) LB(NAME)(LB(lv) a, LB(lv) b) { return OP(a, b); }
static inline LB(lv) LB(lv_zero)(void) { return vf_zero(); }
static inline LB(lv) LB(lv_set1)(float x) { return vf_set1(x); }
static inline LB(lv) LB(lv_load)(const float *p) { return vf_load(p); }
static inline void LB(lv_store)(float *p, LB(lv) v) { vf_store(p, v); }
static inline LB(lv) LB(lv_fmadd)(LB(lv) a, LB(lv) b, LB(lv) c) { return vf_fmadd(a, b, c); }
static inline LB(lv) LB(lv_select)(LB(lvm) m, LB(lv) a, LB(lv) b) { return vf_select(m, a, b); }
static inline LB(lvi) LB(lvi_load)(const int32_t *p) { return vi_load(p); }
static inline LB(lvm) LB(lv_within)(int64_t t, LB(lvi) low, LB(lvi) limit) { return vm_within(t, low, limit); }
#else
typedef struct { vf lo, hi; } LB(lv);
typedef struct { vi lo, hi; } LB(lvi);
typedef struct { vmask lo, hi; } LB(lvm);
#define LB_UNARY(NAME, OP) \
    static inline LB(lv) LB(NAME)(LB(lv) a) { return (LB(lv)){OP(a.lo), OP(a.hi)}; }
#define LB_BINARY(NAME, OP) \
    static inline LB(lv) LB(NAME)(LB(lv) a, LB(lv) b) { return (LB(lv)){OP(a.lo, b.lo), OP(a.hi, b.hi)}; }
static inline LB(lv) LB(lv_zero)(void) { return (LB(lv)){vf_zero(), vf_zero()}; }
static inline LB(lv) LB(lv_set1)(float x) {
    const vf v = vf_set1(x);
    return (LB(lv)){v, v};
}
static inline LB(lv) LB(lv_load)(const float *p) { return (LB(lv)){vf_load(p), vf_load(p + SIMD_WIDTH)}; }
static inline void LB(lv_store)(float *p, LB(lv) v) {
    vf_store(p, v.lo);
    vf_store(p + SIMD_WIDTH, v.hi);
}
static inline LB(lv) LB(lv_fmadd)(LB(lv) a, LB(lv) b, LB(lv) c) {
    return (LB(lv)){vf_fmadd(a.lo, b.lo, c.lo), vf_fmadd(a.hi, b.hi, c.hi)};
}
static inline LB(lv) LB(lv_select)(LB(lvm) m, LB(lv) a, LB(lv) b) {
    return (LB(lv)){vf_select(m.lo, a.lo, b.lo), vf_select(m.hi, a.hi, b.hi)};
}
static inline LB(lvi) LB(lvi_load)(const int32_t *p) { return (LB(lvi)){vi_load(p), vi_load(p + SIMD_WIDTH)}; }
static inline LB(lvm) LB(lv_within)(int64_t t, LB(lvi) low, LB(lvi) limit) {
    return (LB(lvm)){vm_within(t, low.lo, limit.lo), vm_within(t, low.hi, limit.hi)};
}
#endif
LB_BINARY(lv_add, vf_add)
LB_BINARY(lv_sub, vf_sub)
LB_BINARY(lv_mul, vf_mul)
LB_BINARY(lv_max, vf_max)
LB_UNARY(lv_exp, vf_exp_nonpositive)
#undef LB_UNARY
#undef LB_BINARY

/* Folds one chunk of scores into the lanes' running (max, sum) and rescales acc; leaves the weights
 * exp(score - max) in scores. Lane r sees token t of the chunk only if low[r] <= t0 + t < limit[r]. A lane
 * that has seen nothing keeps (max -inf, sum 0, acc 0): exp_nonpositive turns the NaN of -inf - -inf into
 * its clamp, ~1e-38, which multiplies zeros or is masked to 0. */
static inline void LB(softmax_lanes)(LB(lv) *scores, int64_t n, int64_t t0, LB(lvi) low, LB(lvi) limit, int masked,
                                     LB(lv) *run_max, LB(lv) *run_sum, LB(lv) *acc, int64_t dim) {
    if (masked) {
        for (int64_t t = 0; t < n; t++)
            scores[t] = LB(lv_select)(LB(lv_within)(t0 + t, low, limit), scores[t], LB(lv_set1)(-INFINITY));
    }
    LB(lv) top = *run_max;
    for (int64_t t = 0; t < n; t++) top = LB(lv_max)(top, scores[t]);
    const LB(lv) rescale = LB(lv_exp)(LB(lv_sub)(*run_max, top));
    LB(lv) sum = LB(lv_mul)(*run_sum, rescale);
    for (int64_t d = 0; d < dim; d++) acc[d] = LB(lv_mul)(acc[d], rescale);
    for (int64_t t = 0; t < n; t++) {
        scores[t] = LB(lv_exp)(LB(lv_sub)(scores[t], top));
        if (masked) /* NOTE: exp_nonpositive clamps, so exp(-inf) is not 0 until masked here */
            scores[t] = LB(lv_select)(LB(lv_within)(t0 + t, low, limit), scores[t], LB(lv_zero)());
        sum = LB(lv_add)(sum, scores[t]);
    }
    *run_sum = sum;
    *run_max = top;
}

/* lane r of scores[t] = scale * q_r . rows[t] (float32 rows of the head dim). */
static inline void LB(score_rows)(const LB(lv) *qt, const float *const *rows, int64_t n, int64_t dim, float scale,
                                  LB(lv) *scores) {
    for (int64_t t = 0; t < n; t += TOKENS) {
        const float *k[TOKENS];
        for (int64_t i = 0; i < TOKENS; i++) k[i] = rows[t + i < n ? t + i : n - 1];
        LB(lv) sum[TOKENS];
        for (int64_t i = 0; i < TOKENS; i++) sum[i] = LB(lv_zero)();
        for (int64_t d = 0; d < dim; d++) {
            const LB(lv) qd = qt[d];
            for (int64_t i = 0; i < TOKENS; i++) sum[i] = LB(lv_fmadd)(qd, LB(lv_set1)(k[i][d]), sum[i]);
        }
        for (int64_t i = 0; i < TOKENS && t + i < n; i++) scores[t + i] = LB(lv_mul)(sum[i], LB(lv_set1)(scale));
    }
}

/* acc[d] += sum_t weights[t] * rows[t][d] over the chunk's n tokens. Full blocks of DBLOCK columns have a
 * constant trip count, so their accumulators stay in registers (a variable one had the compiler test and
 * branch around every FMA); a last partial block takes the general loop. */
static inline void LB(accumulate_rows)(const LB(lv) *weights, const float *const *rows, int64_t n, int64_t dim,
                                       LB(lv) *acc) {
    int64_t d0 = 0;
    for (; d0 + DBLOCK <= dim; d0 += DBLOCK) {
        LB(lv) a[DBLOCK];
        for (int64_t dd = 0; dd < DBLOCK; dd++) a[dd] = acc[d0 + dd];
        for (int64_t t = 0; t < n; t++) {
            const float *v = rows[t] + d0;
            /* NOTE: an opaque pointer, so each v[dd] is v plus a constant: left to itself, GCC indexes the rows by
             * (d0 + dd) * 4 kept in registers, and with DBLOCK of them some spill and are reloaded per token */
            __asm__("" : "+r"(v));
            for (int64_t dd = 0; dd < DBLOCK; dd++) a[dd] = LB(lv_fmadd)(weights[t], LB(lv_set1)(v[dd]), a[dd]);
        }
        for (int64_t dd = 0; dd < DBLOCK; dd++) acc[d0 + dd] = a[dd];
    }
    for (; d0 < dim; d0++) {
        LB(lv) a = acc[d0];
        for (int64_t t = 0; t < n; t++) a = LB(lv_fmadd)(weights[t], LB(lv_set1)(rows[t][d0]), a);
        acc[d0] = a;
    }
}

static inline void LB(score_chunk_f32)(const LB(lv) *qt, const float *k_buf, const int32_t *slots, int64_t n,
                                       int64_t kv_heads, int64_t h, int64_t dim, float scale, LB(lv) *scores) {
    const float *rows[CHUNK];
    pool_rows_f32(k_buf, slots, n, kv_heads, h, dim, rows);
    LB(score_rows)(qt, rows, n, dim, scale, scores);
}

static inline void LB(accumulate_chunk_f32)(const LB(lv) *weights, const float *v_buf, const int32_t *slots,
                                            int64_t n, int64_t kv_heads, int64_t h, int64_t dim, LB(lv) *acc) {
    const float *rows[CHUNK];
    pool_rows_f32(v_buf, slots, n, kv_heads, h, dim, rows);
    LB(accumulate_rows)(weights, rows, n, dim, acc);
}

static inline void LB(score_chunk_bf16_wide)(const LB(lv) *qt, const uint16_t *k_buf, const int32_t *slots,
                                             int64_t n, int64_t kv_heads, int64_t h, int64_t dim, float scale,
                                             LB(lv) *scores) {
    float wide[CHUNK][MAX_DIM];
    const float *rows[CHUNK];
    pool_rows_bf16(k_buf, slots, n, kv_heads, h, dim, wide, rows);
    LB(score_rows)(qt, rows, n, dim, scale, scores);
}

static inline void LB(accumulate_chunk_bf16_wide)(const LB(lv) *weights, const uint16_t *v_buf, const int32_t *slots,
                                                  int64_t n, int64_t kv_heads, int64_t h, int64_t dim, LB(lv) *acc) {
    float wide[CHUNK][MAX_DIM];
    const float *rows[CHUNK];
    pool_rows_bf16(v_buf, slots, n, kv_heads, h, dim, wide, rows);
    LB(accumulate_rows)(weights, rows, n, dim, acc);
}

/* qt[d], lane r = row r's q[d] in float32 (rows past nr repeat the last one). NOTE: written row by row into a
 * float array and only then loaded as vectors: a vector load right after its lanes' scalar stores stalls (the
 * stores cannot be forwarded to it), which, once per dim, cost more than the copy. */
#define DEFINE_LOAD_Q(NAME, T, LOAD)                                                                      \
    static inline void NAME(LB(lv) *qt, const T *q, const int64_t *ids, int64_t nr, int64_t dim) {        \
        float lane[MAX_DIM][BLOCK_LANES];                                                                 \
        for (int64_t r = 0; r < BLOCK_LANES; r++) {                                                       \
            const T *row = q + ids[r < nr ? r : nr - 1] * dim;                                            \
            for (int64_t d = 0; d < dim; d++) lane[d][r] = LOAD(row[d]);                                  \
        }                                                                                                 \
        for (int64_t d = 0; d < dim; d++) qt[d] = LB(lv_load)(lane[d]);                                   \
    }
DEFINE_LOAD_Q(LB(load_q_f32), float, f32_id)
DEFINE_LOAD_Q(LB(load_q_bf16_wide), uint16_t, bf16_to_f32)
#undef DEFINE_LOAD_Q

#ifdef HAVE_AVX512_BF16
#include "attention_lanes_dp.h"
#endif

/* Rows ids[0..nr) (nr <= BLOCK_LANES) of kv head h over slots[0..len). limits (NULL: none): row r sees
 * slots[0..limits[r]); lows (NULL: none) likewise from slots[lows[r]] on (a sliding window, or the shared
 * prefix's first key a query sees); in any order: a chunk is masked lane by lane only where it crosses the
 * smallest limit or the largest low. Seeding and outputs as attend_rows_*. T: the query and output
 * type, KT: the K/V buffers'. QT: the type LOAD_Q fills (one vector per dim, or per bf16 pair for
 * vdpbf16ps). */
#define DEFINE_ATTEND_LANES(NAME, T, KT, QT, LOAD_Q, SCORE, ACCUMULATE, LOAD, STORE)                     \
    static void NAME(ATTEND_ARGS(T, KT)) {                                                               \
        QT qt[MAX_DIM];                                                                                  \
        LB(lv) acc[MAX_DIM], scores[CHUNK];                                                              \
        float lanes[BLOCK_LANES];                                                                        \
        int32_t limit[BLOCK_LANES], low[BLOCK_LANES];                                                    \
        LOAD_Q(qt, q, ids, nr, dim);                                                                     \
        for (int64_t d = 0; d < dim; d++) {                                                              \
            for (int64_t r = 0; r < BLOCK_LANES && seed_lse != NULL; r++)                                \
                lanes[r] = LOAD(seed_out[ids[r < nr ? r : nr - 1] * dim + d]);                           \
            acc[d] = seed_lse != NULL ? LB(lv_load)(lanes) : LB(lv_zero)();                              \
        }                                                                                                \
        float seeded[BLOCK_LANES]; /* a seed's sum: 1, or 0 for an empty seed (lse -inf: it saw no key) */ \
        int32_t min_limit = (int32_t)len, max_low = 0;                                                   \
        for (int64_t r = 0; r < BLOCK_LANES; r++) {                                                      \
            lanes[r] = seed_lse != NULL ? seed_lse[ids[r < nr ? r : nr - 1]] : -INFINITY;                \
            seeded[r] = lanes[r] > -INFINITY ? 1.0f : 0.0f;                                              \
            limit[r] = limits != NULL ? limits[r < nr ? r : nr - 1] : (int32_t)len;                      \
            low[r] = lows != NULL ? lows[r < nr ? r : nr - 1] : 0;                                       \
            min_limit = limit[r] < min_limit ? limit[r] : min_limit;                                     \
            max_low = low[r] > max_low ? low[r] : max_low;                                               \
        }                                                                                                \
        LB(lv) run_max = LB(lv_load)(lanes);                                                             \
        LB(lv) run_sum = LB(lv_load)(seeded);                                                            \
        const LB(lvi) limit_v = LB(lvi_load)(limit), low_v = LB(lvi_load)(low);                          \
        for (int64_t t0 = 0; t0 < len; t0 += CHUNK) {                                                    \
            const int64_t n = len - t0 < CHUNK ? len - t0 : CHUNK;                                       \
            SCORE(qt, k_buf, slots + t0, n, kv_heads, h, dim, scale, scores);                            \
            const int masked = t0 + n > min_limit || t0 < max_low;                                      \
            LB(softmax_lanes)(scores, n, t0, low_v, limit_v, masked, &run_max, &run_sum, acc, dim);      \
            ACCUMULATE(scores, v_buf, slots + t0, n, kv_heads, h, dim, acc);                             \
        }                                                                                                \
        float sums[BLOCK_LANES], maxes[BLOCK_LANES];                                                     \
        LB(lv_store)(sums, run_sum);                                                                     \
        LB(lv_store)(maxes, run_max);                                                                    \
        for (int64_t d = 0; d < dim; d++) {                                                              \
            LB(lv_store)(lanes, acc[d]);                                                                 \
            for (int64_t r = 0; r < nr; r++)                                                             \
                out[ids[r] * dim + d] = STORE(sums[r] > 0.0f ? lanes[r] / sums[r] : 0.0f);               \
        }                                                                                                \
        for (int64_t r = 0; r < nr && lse != NULL; r++) lse[ids[r]] = row_lse(maxes[r], sums[r]);        \
    }

DEFINE_ATTEND_LANES(LB(attend_lanes_f32), float, float, LB(lv), LB(load_q_f32), LB(score_chunk_f32),
                    LB(accumulate_chunk_f32), f32_id, f32_id)
DEFINE_ATTEND_LANES(LB(attend_lanes_bf16_wide), uint16_t, uint16_t, LB(lv), LB(load_q_bf16_wide),
                    LB(score_chunk_bf16_wide), LB(accumulate_chunk_bf16_wide), bf16_to_f32, f32_to_bf16)
/* float32 queries and output over a bf16 KV cache (--kv-cache-dtype bfloat16), widened chunk by chunk */
DEFINE_ATTEND_LANES(LB(attend_lanes_f32_bf16kv), float, uint16_t, LB(lv), LB(load_q_f32), LB(score_chunk_bf16_wide),
                    LB(accumulate_chunk_bf16_wide), f32_id, f32_id)
/* bf16 queries and output over K/V already widened to float32 (extend_attention.c's scratch copy) */
DEFINE_ATTEND_LANES(LB(attend_lanes_bf16_f32kv), uint16_t, float, LB(lv), LB(load_q_bf16_wide), LB(score_chunk_f32),
                    LB(accumulate_chunk_f32), bf16_to_f32, f32_to_bf16)
#ifdef HAVE_AVX512_BF16
DEFINE_ATTEND_LANES(LB(attend_lanes_bf16_dp), uint16_t, uint16_t, LB(qpairs), LB(load_q_bf16), LB(score_chunk_bf16),
                    LB(accumulate_chunk_bf16), bf16_to_f32, f32_to_bf16)
#endif
#undef DEFINE_ATTEND_LANES

#undef BLOCK_LANES
#undef DBLOCK
#undef TOKENS
#undef LB
