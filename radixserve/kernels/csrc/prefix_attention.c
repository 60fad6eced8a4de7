/* Shared-prefix attention for the CPU (part (a) of cascade attention): every query token of a batch
 * attends, unmasked, over one run of slots that all its requests share -- the batch's common prefix.
 *
 * Work is split into units of UNIT_ROWS query rows of one kv head (row j of head h is query token
 * j / group, head h * group + j % group), spread over OpenMP threads. A unit streams the prefix's K and
 * V rows of its head once, in place from the pool, so the prefix is read once per unit instead of once
 * per request. With a vector level (AVX2, AVX-512) a unit is the lane block of attention_lanes.h, one
 * row per lane; otherwise the portable float32 loop of attention_common.h. Writes the normalised output
 * and each row's log-sum-exp (float32 [num_tokens, heads]).
 *
 * Window layers: `first` (NULL: every query sees every slot, the unmasked case, unchanged) gives each query
 * token the index of the first slot it sees; a query of a window layer sees a shared key only if the key is
 * inside its window, and all its later shared keys are too, so that one lower bound is the whole mask. A unit
 * then starts at the smallest first of its rows (slots no row of it sees are never read) and masks lane by
 * lane only the chunks below its largest first. A row with first == prefix_len sees nothing: output 0, lse
 * -inf, the empty partial result that the decode and extend kernels take as a seed (attention_common.h).
 */
#include "attention_lanes.h"

#ifdef SIMD_WIDTH
#define UNIT_ROWS LANES
#else
#define UNIT_ROWS MAX_ROWS
#endif

/* The pool ids (token * heads + head) of a unit's rows j0 .. j0 + nr of kv head h. */
static inline void unit_rows(int64_t *ids, int64_t j0, int64_t nr, int64_t h, int64_t group, int64_t heads) {
    for (int64_t r = 0; r < nr; r++) ids[r] = ((j0 + r) / group) * heads + h * group + (j0 + r) % group;
}

/* The unit's shared slots from its rows' smallest first on (`start`), each row's first relative to it
 * (lows); returns start. */
static inline int64_t unit_lows(int32_t *lows, const int32_t *first, int64_t j0, int64_t nr, int64_t group) {
    int64_t start = first[j0 / group];
    for (int64_t r = 1; r < nr; r++) start = first[(j0 + r) / group] < start ? first[(j0 + r) / group] : start;
    for (int64_t r = 0; r < nr; r++) lows[r] = (int32_t)(first[(j0 + r) / group] - start);
    return start;
}

#define DEFINE_PREFIX(NAME, T, KT, ATTEND)                                                               \
    static int NAME(const T *q, const KT *k_buf, const KT *v_buf, const int32_t *slots, const int32_t *first, \
                    T *out, float *lse, int64_t num_tokens, int64_t prefix_len, int64_t heads,           \
                    int64_t kv_heads, int64_t dim, float scale, int num_threads) {                       \
        const int64_t group = heads / kv_heads, rows = num_tokens * (heads / kv_heads);                  \
        if (dim > MAX_DIM || group * kv_heads != heads) return 1;                                        \
        for (int64_t i = 0; first != NULL && i < num_tokens; i++)                                        \
            if (first[i] < 0 || first[i] > prefix_len) return 1;                                         \
        const int64_t blocks = (rows + UNIT_ROWS - 1) / UNIT_ROWS;                                       \
        _Pragma("omp parallel for schedule(dynamic, 1) num_threads(num_threads)")                        \
        for (int64_t unit = 0; unit < kv_heads * blocks; unit++) {                                       \
            const int64_t h = unit / blocks, j0 = (unit % blocks) * UNIT_ROWS;                           \
            const int64_t nr = rows - j0 < UNIT_ROWS ? rows - j0 : UNIT_ROWS;                            \
            int64_t ids[UNIT_ROWS];                                                                      \
            int32_t lows[UNIT_ROWS];                                                                     \
            unit_rows(ids, j0, nr, h, group, heads);                                                     \
            const int64_t start = first != NULL ? unit_lows(lows, first, j0, nr, group) : 0;             \
            ATTEND(q, k_buf, v_buf, ids, nr, slots + start, prefix_len - start, NULL,                    \
                   first != NULL ? lows : NULL, kv_heads, h, dim, scale, NULL, NULL, out, lse);          \
        }                                                                                                \
        return 0;                                                                                        \
    }

#ifdef SIMD_WIDTH
DEFINE_PREFIX(prefix_f32, float, float, attend_lanes_f32)
DEFINE_PREFIX(prefix_bf16, uint16_t, uint16_t, attend_lanes_bf16_wide)
DEFINE_PREFIX(prefix_f32_bf16kv, float, uint16_t, attend_lanes_f32_bf16kv)
#else
DEFINE_PREFIX(prefix_f32, float, float, attend_rows_f32)
DEFINE_PREFIX(prefix_bf16, uint16_t, uint16_t, attend_rows_bf16)
DEFINE_PREFIX(prefix_f32_bf16kv, float, uint16_t, attend_rows_f32_bf16kv)
#endif
#ifdef HAVE_AVX512_BF16
DEFINE_PREFIX(prefix_bf16_dp, uint16_t, uint16_t, attend_lanes_bf16_dp)
#endif

int EXPORT(prefix_attention_f32)(const float *q, const float *k_buf, const float *v_buf, const int32_t *slots,
                                 const int32_t *first, float *out, float *lse, int64_t num_tokens, int64_t prefix_len,
                                 int64_t heads, int64_t kv_heads, int64_t dim, float scale, int num_threads) {
    return prefix_f32(q, k_buf, v_buf, slots, first, out, lse, num_tokens, prefix_len, heads, kv_heads, dim, scale,
                      num_threads);
}

/* float32 queries over a bf16 KV cache (--kv-cache-dtype bfloat16) */
int EXPORT(prefix_attention_f32_bf16kv)(const float *q, const uint16_t *k_buf, const uint16_t *v_buf,
                                        const int32_t *slots, const int32_t *first, float *out, float *lse,
                                        int64_t num_tokens, int64_t prefix_len, int64_t heads, int64_t kv_heads,
                                        int64_t dim, float scale, int num_threads) {
    return prefix_f32_bf16kv(q, k_buf, v_buf, slots, first, out, lse, num_tokens, prefix_len, heads, kv_heads, dim,
                             scale, num_threads);
}

int EXPORT(prefix_attention_bf16)(const uint16_t *q, const uint16_t *k_buf, const uint16_t *v_buf,
                                  const int32_t *slots, const int32_t *first, uint16_t *out, float *lse,
                                  int64_t num_tokens, int64_t prefix_len, int64_t heads, int64_t kv_heads, int64_t dim,
                                  float scale, int num_threads) {
#ifdef HAVE_AVX512_BF16
    if (dim % 32 == 0)
        return prefix_bf16_dp(q, k_buf, v_buf, slots, first, out, lse, num_tokens, prefix_len, heads, kv_heads, dim,
                              scale, num_threads);
#endif
    return prefix_bf16(q, k_buf, v_buf, slots, first, out, lse, num_tokens, prefix_len, heads, kv_heads, dim, scale,
                       num_threads);
}
