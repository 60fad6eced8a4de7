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
 * request's costliest (latest) units first. With a vector level (AVX2: 8 rows, AVX-512: 16) a unit
 * is the lane block of attention_lanes.h (bf16 with vdpbf16ps where AVX-512 BF16 and dim % 32 == 0,
 * else widened to float32); otherwise the portable float32 loop of attention_common.h. With
 * seed_lse, rows start from a partial result over other keys (as in the decode kernel); lse (float32
 * [tokens, heads]) may be NULL.
 */
#include <stdlib.h>

#include "attention_lanes.h"

#ifdef SIMD_WIDTH
#define UNIT_ROWS LANES
#else
#define UNIT_ROWS MAX_ROWS
#endif
enum { Q_START, Q_LEN, KV_START, KV_LEN, REQ_FIELDS };

typedef struct {
    int64_t ids[UNIT_ROWS]; /* row ids (token * heads + head) */
    int32_t limits[UNIT_ROWS]; /* keys each row sees, ascending */
    int64_t nr, h;
    const int32_t *slots;
} unit_t;

static inline int64_t unit_blocks(const int64_t *req, int64_t group) {
    return (req[Q_LEN] * group + UNIT_ROWS - 1) / UNIT_ROWS;
}

/* first[b] = the first unit of request b; first[bs] = all units. NULL on bad shapes (or no memory). */
static int64_t *plan_units(const int64_t *reqs, int64_t bs, int64_t kv_heads, int64_t group) {
    int64_t *first = malloc((size_t)(bs + 1) * sizeof *first);
    if (first == NULL) return NULL;
    first[0] = 0;
    for (int64_t b = 0; b < bs; b++) {
        const int64_t *req = reqs + b * REQ_FIELDS;
        if (req[Q_LEN] < 1 || req[KV_LEN] < req[Q_LEN] || req[KV_LEN] > INT32_MAX) {
            free(first);
            return NULL;
        }
        first[b + 1] = first[b] + kv_heads * unit_blocks(req, group);
    }
    return first;
}

static void unit_setup(unit_t *u, int64_t unit, const int64_t *first, const int64_t *reqs, int64_t bs,
                       const int32_t *kv_indices, int64_t heads, int64_t group) {
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
    u->slots = kv_indices + req[KV_START];
    for (int64_t r = 0; r < u->nr; r++) {
        const int64_t token = (j0 + r) / group;
        u->ids[r] = (req[Q_START] + token) * heads + u->h * group + (j0 + r) % group;
        u->limits[r] = (int32_t)(shift + token + 1);
    }
}

#define DEFINE_EXTEND(NAME, T, ATTEND)                                                                   \
    static int NAME(const T *q, const T *k_buf, const T *v_buf, const int32_t *kv_indices,               \
                    const int64_t *reqs, const T *seed_out, const float *seed_lse, T *out, float *lse,   \
                    int64_t bs, int64_t heads, int64_t kv_heads, int64_t dim, float scale,               \
                    int num_threads) {                                                                   \
        const int64_t group = heads / kv_heads;                                                          \
        int64_t *first = plan_units(reqs, bs, kv_heads, group);                                          \
        if (first == NULL) return 2;                                                                     \
        _Pragma("omp parallel for schedule(dynamic, 1) num_threads(num_threads)")                        \
        for (int64_t unit = 0; unit < first[bs]; unit++) {                                               \
            unit_t u;                                                                                    \
            unit_setup(&u, unit, first, reqs, bs, kv_indices, heads, group);                             \
            ATTEND(q, k_buf, v_buf, u.ids, u.nr, u.slots, u.limits[u.nr - 1], u.limits, kv_heads, u.h,   \
                   dim, scale, seed_out, seed_lse, out, lse);                                            \
        }                                                                                                \
        free(first);                                                                                     \
        return 0;                                                                                        \
    }

#ifdef SIMD_WIDTH
DEFINE_EXTEND(extend_f32, float, attend_lanes_f32)
DEFINE_EXTEND(extend_bf16, uint16_t, attend_lanes_bf16_wide)
#else
DEFINE_EXTEND(extend_f32, float, attend_rows_f32)
DEFINE_EXTEND(extend_bf16, uint16_t, attend_rows_bf16)
#endif
#ifdef HAVE_AVX512_BF16
DEFINE_EXTEND(extend_bf16_dp, uint16_t, attend_lanes_bf16_dp)
#endif

static int bad_heads(int64_t heads, int64_t kv_heads, int64_t dim) {
    return kv_heads < 1 || dim < 1 || dim > MAX_DIM || heads % kv_heads != 0;
}

int EXPORT(extend_attention_bf16)(const uint16_t *q, const uint16_t *k_buf, const uint16_t *v_buf,
                                  const int32_t *kv_indices, const int64_t *reqs, const uint16_t *seed_out,
                                  const float *seed_lse, uint16_t *out, float *lse, int64_t bs, int64_t heads,
                                  int64_t kv_heads, int64_t dim, float scale, int num_threads) {
    if (bad_heads(heads, kv_heads, dim)) return 1;
#ifdef HAVE_AVX512_BF16
    if (dim % 32 == 0)
        return extend_bf16_dp(q, k_buf, v_buf, kv_indices, reqs, seed_out, seed_lse, out, lse, bs, heads, kv_heads,
                              dim, scale, num_threads);
#endif
    return extend_bf16(q, k_buf, v_buf, kv_indices, reqs, seed_out, seed_lse, out, lse, bs, heads, kv_heads, dim,
                       scale, num_threads);
}

int EXPORT(extend_attention_f32)(const float *q, const float *k_buf, const float *v_buf, const int32_t *kv_indices,
                                 const int64_t *reqs, const float *seed_out, const float *seed_lse, float *out,
                                 float *lse, int64_t bs, int64_t heads, int64_t kv_heads, int64_t dim, float scale,
                                 int num_threads) {
    if (bad_heads(heads, kv_heads, dim)) return 1;
    return extend_f32(q, k_buf, v_buf, kv_indices, reqs, seed_out, seed_lse, out, lse, bs, heads, kv_heads, dim, scale,
                      num_threads);
}
