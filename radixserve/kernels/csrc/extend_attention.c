/* Causal extend (prefill) attention for the CPU: each request's new query tokens attend over its own
 * context, K/V read in place from the pool through the request's slots.
 *
 * Request b (row b of `reqs`: q_start, q_len, kv_start, kv_len) has query tokens q_start .. + q_len
 * and context slots kv_indices[kv_start .. + kv_len); its queries are the last q_len positions, so
 * query i sees context keys 0 .. shift + i with shift = kv_len - q_len (0 for a fresh prompt).
 *
 * Work is split into units of UNIT_ROWS query rows of one kv head (row j: query token j / group, head
 * h * group + j % group), so every K/V row a unit reads serves all the query heads of its group. A
 * unit reads only the keys its last row sees (fully masked key chunks are never touched) and masks
 * lane by lane only in chunks past its first row's limit. Units run on OpenMP threads, each
 * request's costliest (latest) units first. With a vector level (AVX2: 16 rows, AVX-512: 32) a unit
 * is the lane block of attention_lanes.h (bf16 with vdpbf16ps where AVX-512 BF16 and dim % 32 == 0,
 * else widened to float32); otherwise the portable float32 loop of attention_common.h. With
 * seed_lse, rows start from a partial result over other keys (as in the decode kernel); lse (float32
 * [tokens, heads]) may be NULL.
 *
 * Sliding window: with window W > 0, query i also sees no key before shift + i - W + 1 (the query at
 * position p sees positions p - W + 1 .. p). A unit then starts at its first row's first key, so the
 * key blocks below every row's window are skipped as those above every row's limit are, and masks lane
 * by lane only where some row's window or limit cuts a chunk.
 *
 * bf16 K/V without vdpbf16ps (AVX2, AVX-512 without BF16): every context row of the batch is widened to
 * float32 once per call into a scratch copy (up to WIDE_SCRATCH_BYTES; above, chunk by chunk per unit),
 * which the units then read as float32, instead of each unit widening each chunk it reads.
 */
#include <stdlib.h>

#include "attention_lanes.h"

#ifdef SIMD_WIDTH
#define UNIT_ROWS LANES
#else
#define UNIT_ROWS MAX_ROWS
#endif
#define WIDE_SCRATCH_BYTES ((int64_t)256 << 20) /* the float32 K/V copy of a call, at most */
enum { Q_START, Q_LEN, KV_START, KV_LEN, REQ_FIELDS };

typedef struct {
    int64_t ids[UNIT_ROWS]; /* row ids (token * heads + head) */
    int32_t limits[UNIT_ROWS]; /* keys each row sees, from `slots`: [lows[r], limits[r]), both ascending */
    int32_t lows[UNIT_ROWS];
    int64_t nr, h, len; /* len: the keys the unit reads, limits[nr - 1] */
    const int32_t *slots; /* the unit's first key's slot */
} unit_t;

typedef struct {
    int64_t *first; /* first[b] = the first unit of request b; first[bs] = all units */
    int64_t *ctx; /* ctx[b] = request b's first row in a widened copy; ctx[bs] = all rows */
} plan_t;

static inline int64_t unit_blocks(const int64_t *req, int64_t group) {
    return (req[Q_LEN] * group + UNIT_ROWS - 1) / UNIT_ROWS;
}

/* Returns 0, or nonzero on bad shapes (or no memory). */
static int plan_units(plan_t *plan, const int64_t *reqs, int64_t bs, int64_t kv_heads, int64_t group) {
    plan->first = malloc((size_t)(2 * bs + 2) * sizeof *plan->first);
    if (plan->first == NULL) return 1;
    plan->ctx = plan->first + bs + 1;
    plan->first[0] = plan->ctx[0] = 0;
    for (int64_t b = 0; b < bs; b++) {
        const int64_t *req = reqs + b * REQ_FIELDS;
        if (req[Q_LEN] < 1 || req[KV_LEN] < req[Q_LEN] || req[KV_LEN] > INT32_MAX) {
            free(plan->first);
            return 1;
        }
        plan->first[b + 1] = plan->first[b] + kv_heads * unit_blocks(req, group);
        plan->ctx[b + 1] = plan->ctx[b] + req[KV_LEN];
    }
    return 0;
}

/* `iota` (NULL: read the pool through kv_indices): the units read rows ctx[b] + t of a widened copy. */
static void unit_setup(unit_t *u, int64_t unit, const plan_t *plan, const int64_t *reqs, int64_t bs,
                       const int32_t *kv_indices, const int32_t *iota, int64_t heads, int64_t group,
                       int64_t window) {
    const int64_t *first = plan->first;
    int64_t lo = 0, hi = bs - 1; /* the request owning the unit: the last b with first[b] <= unit */
    while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (first[mid] <= unit) lo = mid; else hi = mid - 1;
    }
    const int64_t *req = reqs + lo * REQ_FIELDS;
    const int64_t blocks = unit_blocks(req, group), local = unit - first[lo], rows = req[Q_LEN] * group;
    const int64_t j0 = (blocks - 1 - local % blocks) * UNIT_ROWS, shift = req[KV_LEN] - req[Q_LEN];
    u->h = local / blocks;
    u->nr = rows - j0 < UNIT_ROWS ? rows - j0 : UNIT_ROWS;
    const int64_t start = window > 0 && shift + j0 / group + 1 > window ? shift + j0 / group + 1 - window : 0;
    u->slots = (iota != NULL ? iota + plan->ctx[lo] : kv_indices + req[KV_START]) + start;
    for (int64_t r = 0; r < u->nr; r++) {
        const int64_t token = (j0 + r) / group, limit = shift + token + 1;
        u->ids[r] = (req[Q_START] + token) * heads + u->h * group + (j0 + r) % group;
        u->limits[r] = (int32_t)(limit - start);
        u->lows[r] = (int32_t)(window > 0 && limit > window ? limit - window - start : 0);
    }
    u->len = u->limits[u->nr - 1];
}

#define DEFINE_EXTEND(NAME, T, KT, ATTEND)                                                               \
    static int NAME(const T *q, const KT *k_buf, const KT *v_buf, const int32_t *kv_indices,             \
                    const int32_t *iota, const plan_t *plan, const int64_t *reqs, const T *seed_out,     \
                    const float *seed_lse, T *out, float *lse, int64_t bs, int64_t heads,                \
                    int64_t kv_heads, int64_t dim, int64_t window, float scale, int num_threads) {       \
        const int64_t group = heads / kv_heads;                                                          \
        _Pragma("omp parallel for schedule(dynamic, 1) num_threads(num_threads)")                        \
        for (int64_t unit = 0; unit < plan->first[bs]; unit++) {                                         \
            unit_t u;                                                                                    \
            unit_setup(&u, unit, plan, reqs, bs, kv_indices, iota, heads, group, window);                \
            ATTEND(q, k_buf, v_buf, u.ids, u.nr, u.slots, u.len, u.limits, window > 0 ? u.lows : NULL,   \
                   kv_heads, u.h, dim, scale, seed_out, seed_lse, out, lse);                             \
        }                                                                                                \
        return 0;                                                                                        \
    }

#ifdef SIMD_WIDTH
DEFINE_EXTEND(extend_f32, float, float, attend_lanes_f32)
DEFINE_EXTEND(extend_bf16, uint16_t, uint16_t, attend_lanes_bf16_wide)
DEFINE_EXTEND(extend_bf16_f32kv, uint16_t, float, attend_lanes_bf16_f32kv)
DEFINE_EXTEND(extend_f32_bf16kv, float, uint16_t, attend_lanes_f32_bf16kv)

/* Every request's context rows (all kv heads) widened to float32, request b's from row ctx[b] on: one
 * buffer, K's rows then V's; NULL when over WIDE_SCRATCH_BYTES (or no memory). */
static float *widen_context(const uint16_t *k_buf, const uint16_t *v_buf, const int32_t *kv_indices,
                            const int64_t *reqs, const plan_t *plan, int64_t bs, int64_t width, int num_threads) {
    const int64_t rows = plan->ctx[bs];
    if (rows * width * 2 * (int64_t)sizeof(float) > WIDE_SCRATCH_BYTES) return NULL;
    float *wide = malloc((size_t)(rows * width * 2) * sizeof *wide);
    if (wide == NULL) return NULL;
    _Pragma("omp parallel for schedule(static) num_threads(num_threads)")
    for (int64_t row = 0; row < 2 * rows; row++) {
        const int64_t i = row % rows;
        int64_t b = 0;
        while (plan->ctx[b + 1] <= i) b++; /* NOTE: few requests; a search would not pay */
        const int64_t slot = kv_indices[reqs[b * REQ_FIELDS + KV_START] + i - plan->ctx[b]];
        const uint16_t *src = (row < rows ? k_buf : v_buf) + slot * width;
        float *dst = wide + row * width;
        int64_t d = 0;
        for (; d + SIMD_WIDTH <= width; d += SIMD_WIDTH) vf_store(dst + d, vf_load_bf16(src + d));
        for (; d < width; d++) dst[d] = bf16_to_f32(src[d]);
    }
    return wide;
}

/* EXTEND (queries of type T over float32 K/V) run over the batch's bf16 context widened once (widen_context);
 * returns 0, or 1 when the copy is over WIDE_SCRATCH_BYTES (or no memory) and nothing ran. */
#define DEFINE_OVER_WIDENED(NAME, T, EXTEND)                                                             \
    static int NAME(const T *q, const uint16_t *k_buf, const uint16_t *v_buf, const int32_t *kv_indices, \
                    const plan_t *plan, const int64_t *reqs, const T *seed_out, const float *seed_lse,   \
                    T *out, float *lse, int64_t bs, int64_t heads, int64_t kv_heads, int64_t dim,        \
                    int64_t window, float scale, int num_threads) {                                      \
        float *wide = widen_context(k_buf, v_buf, kv_indices, reqs, plan, bs, kv_heads * dim, num_threads); \
        int32_t *iota = wide != NULL ? malloc((size_t)plan->ctx[bs] * sizeof *iota) : NULL;              \
        if (iota == NULL) {                                                                              \
            free(wide);                                                                                  \
            return 1;                                                                                    \
        }                                                                                                \
        for (int64_t i = 0; i < plan->ctx[bs]; i++) iota[i] = (int32_t)i;                                \
        EXTEND(q, wide, wide + plan->ctx[bs] * kv_heads * dim, kv_indices, iota, plan, reqs, seed_out,   \
               seed_lse, out, lse, bs, heads, kv_heads, dim, window, scale, num_threads);                \
        free(iota);                                                                                      \
        free(wide);                                                                                      \
        return 0;                                                                                        \
    }
DEFINE_OVER_WIDENED(extend_bf16_over_widened, uint16_t, extend_bf16_f32kv)
DEFINE_OVER_WIDENED(extend_f32_over_widened, float, extend_f32)
#else
DEFINE_EXTEND(extend_f32, float, float, attend_rows_f32)
DEFINE_EXTEND(extend_bf16, uint16_t, uint16_t, attend_rows_bf16)
DEFINE_EXTEND(extend_f32_bf16kv, float, uint16_t, attend_rows_f32_bf16kv)
#endif
#ifdef HAVE_AVX512_BF16
DEFINE_EXTEND(extend_bf16_dp, uint16_t, uint16_t, attend_lanes_bf16_dp)
#endif

static int bad_heads(int64_t heads, int64_t kv_heads, int64_t dim) {
    return kv_heads < 1 || dim < 1 || dim > MAX_DIM || heads % kv_heads != 0;
}

int EXPORT(extend_attention_bf16)(const uint16_t *q, const uint16_t *k_buf, const uint16_t *v_buf,
                                  const int32_t *kv_indices, const int64_t *reqs, const uint16_t *seed_out,
                                  const float *seed_lse, uint16_t *out, float *lse, int64_t bs, int64_t heads,
                                  int64_t kv_heads, int64_t dim, int64_t window, float scale, int num_threads) {
    plan_t plan;
    if (bad_heads(heads, kv_heads, dim) || plan_units(&plan, reqs, bs, kv_heads, heads / kv_heads)) return 1;
#ifdef HAVE_AVX512_BF16
    if (dim % 32 == 0) {
        extend_bf16_dp(q, k_buf, v_buf, kv_indices, NULL, &plan, reqs, seed_out, seed_lse, out, lse, bs, heads,
                       kv_heads, dim, window, scale, num_threads);
        free(plan.first);
        return 0;
    }
#endif
#ifdef SIMD_WIDTH
    if (extend_bf16_over_widened(q, k_buf, v_buf, kv_indices, &plan, reqs, seed_out, seed_lse, out, lse, bs, heads,
                                 kv_heads, dim, window, scale, num_threads) == 0) {
        free(plan.first);
        return 0;
    }
#endif
    extend_bf16(q, k_buf, v_buf, kv_indices, NULL, &plan, reqs, seed_out, seed_lse, out, lse, bs, heads, kv_heads,
                dim, window, scale, num_threads);
    free(plan.first);
    return 0;
}

int EXPORT(extend_attention_f32)(const float *q, const float *k_buf, const float *v_buf, const int32_t *kv_indices,
                                 const int64_t *reqs, const float *seed_out, const float *seed_lse, float *out,
                                 float *lse, int64_t bs, int64_t heads, int64_t kv_heads, int64_t dim,
                                 int64_t window, float scale, int num_threads) {
    plan_t plan;
    if (bad_heads(heads, kv_heads, dim) || plan_units(&plan, reqs, bs, kv_heads, heads / kv_heads)) return 1;
    extend_f32(q, k_buf, v_buf, kv_indices, NULL, &plan, reqs, seed_out, seed_lse, out, lse, bs, heads, kv_heads,
               dim, window, scale, num_threads);
    free(plan.first);
    return 0;
}

/* float32 queries and output over a bf16 KV cache (--kv-cache-dtype bfloat16 under float32 compute). With a vector
 * level and many new tokens per context row (a prompt computed whole) the context is widened to float32 once per
 * call (as for bf16 queries without vdpbf16ps) and the float32 kernel runs over the copy; with few (new tokens over
 * a long cached prefix, a verify step) each unit widens the chunks it reads: the copy would cost more traffic
 * than the units' repeated widening (measured at the AVX2 level, 32 requests of 40 new tokens over 1,000 cached:
 * 1.25x the float32 cache's time with the copy, 0.83x without; a 500-token prompt: 0.99x with, 1.08x without). */
#define WIDEN_MIN_NEW_PER_ROW 4 /* widen once when new tokens x this >= context rows */
int EXPORT(extend_attention_f32_bf16kv)(const float *q, const uint16_t *k_buf, const uint16_t *v_buf,
                                        const int32_t *kv_indices, const int64_t *reqs, const float *seed_out,
                                        const float *seed_lse, float *out, float *lse, int64_t bs, int64_t heads,
                                        int64_t kv_heads, int64_t dim, int64_t window, float scale, int num_threads) {
    plan_t plan;
    if (bad_heads(heads, kv_heads, dim) || plan_units(&plan, reqs, bs, kv_heads, heads / kv_heads)) return 1;
#ifdef SIMD_WIDTH
    int64_t tokens = 0;
    for (int64_t b = 0; b < bs; b++) tokens += reqs[b * REQ_FIELDS + Q_LEN];
    if (WIDEN_MIN_NEW_PER_ROW * tokens >= plan.ctx[bs]
        && extend_f32_over_widened(q, k_buf, v_buf, kv_indices, &plan, reqs, seed_out, seed_lse, out, lse, bs, heads,
                                   kv_heads, dim, window, scale, num_threads) == 0) {
        free(plan.first);
        return 0;
    }
#endif
    extend_f32_bf16kv(q, k_buf, v_buf, kv_indices, NULL, &plan, reqs, seed_out, seed_lse, out, lse, bs, heads,
                      kv_heads, dim, window, scale, num_threads);
    free(plan.first);
    return 0;
}
