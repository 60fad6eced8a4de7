/* Shared-prefix attention for the CPU (part (a) of cascade attention): every query token of a batch
 * attends, unmasked, over one run of slots that all its requests share -- the batch's common prefix.
 *
 * Work is split into units of 16 query rows of one kv head (row j of head h is query token j / group,
 * head h * group + j % group), spread over OpenMP threads. A unit streams the prefix's K and V rows of
 * its head once, in place from the pool, so the prefix is read once per 16 query rows instead of
 * once per request. The AVX-512 BF16 path is the 16-lane block of attention_lanes.h; otherwise the
 * portable float32 loop of attention_common.h. Writes the normalised output and each row's
 * log-sum-exp (float32 [num_tokens, heads]).
 */
#include "attention_lanes.h"

#define UNIT_ROWS MAX_ROWS /* query rows per unit */

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
        const int64_t blocks = (rows + UNIT_ROWS - 1) / UNIT_ROWS;                                       \
        _Pragma("omp parallel for schedule(dynamic, 1) num_threads(num_threads)")                        \
        for (int64_t unit = 0; unit < kv_heads * blocks; unit++) {                                       \
            const int64_t h = unit / blocks, j0 = (unit % blocks) * UNIT_ROWS;                           \
            const int64_t nr = rows - j0 < UNIT_ROWS ? rows - j0 : UNIT_ROWS;                            \
            int64_t ids[UNIT_ROWS];                                                                      \
            unit_rows(ids, j0, nr, h, group, heads);                                                     \
            ATTEND_ROWS(q, k_buf, v_buf, ids, nr, slots, prefix_len, NULL, kv_heads, h, dim, scale,      \
                        NULL, NULL, out, lse);                                                           \
        }                                                                                                \
        return 0;                                                                                        \
    }

DEFINE_PREFIX(prefix_attention_bf16_generic, uint16_t, attend_rows_bf16)
DEFINE_PREFIX(prefix_attention_f32, float, attend_rows_f32)

int prefix_attention_bf16(const uint16_t *q, const uint16_t *k_buf, const uint16_t *v_buf, const int32_t *slots,
                          uint16_t *out, float *lse, int64_t num_tokens, int64_t prefix_len, int64_t heads,
                          int64_t kv_heads, int64_t dim, float scale, int num_threads) {
#ifdef HAVE_AVX512_BF16
    const int64_t group = heads / kv_heads, rows = num_tokens * (heads / kv_heads);
    if (dim % 32 == 0 && dim <= MAX_DIM && group * kv_heads == heads && prefix_len > 0) {
        const int64_t blocks = (rows + UNIT_ROWS - 1) / UNIT_ROWS;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
        for (int64_t unit = 0; unit < kv_heads * blocks; unit++) {
            const int64_t h = unit / blocks, j0 = (unit % blocks) * UNIT_ROWS;
            const int64_t nr = rows - j0 < UNIT_ROWS ? rows - j0 : UNIT_ROWS;
            int64_t ids[UNIT_ROWS];
            unit_rows(ids, j0, nr, h, group, heads);
            attend_lanes_bf16(q, k_buf, v_buf, ids, nr, slots, prefix_len, NULL, kv_heads, h, dim, scale, NULL, NULL,
                              out, lse);
        }
        return 0;
    }
#endif
    return prefix_attention_bf16_generic(q, k_buf, v_buf, slots, out, lse, num_tokens, prefix_len, heads, kv_heads,
                                         dim, scale, num_threads);
}
