/* The block shared by the prefix and extend kernels: query rows of one kv head, one row per lane, attended
 * over a run of pool slots. Each K and V row is read once for all the rows; a lane may see only a part of
 * the slots (a causal mask, a sliding window). The online softmax runs across the lanes, so no score needs
 * a horizontal sum.
 *
 * A unit of work has up to LANES (2 * SIMD_WIDTH) rows: AVX-512 32, AVX2 16. It runs as a block of two
 * vectors per lane set (_x2), or of one (_x1) when it has SIMD_WIDTH rows or fewer; attention_lane_block.h
 * is the block, written once and included here once per width.
 *
 * float32: one FMA per dim for scores and for V (a K or V element broadcast against the lanes).
 * bf16 on AVX2 or AVX-512 without BF16: K and V rows widened to float32 (per call by the extend kernel,
 * else per chunk), then the float32 code runs. bf16 with AVX-512 BF16 (dim % 32 == 0): vdpbf16ps
 * (attention_lanes_dp.h) in the same blocks.
 */
#ifndef RADIXSERVE_ATTENTION_LANES_H
#define RADIXSERVE_ATTENTION_LANES_H

#include "simd.h"

#ifdef SIMD_WIDTH
#define LANES (2 * SIMD_WIDTH) /* query rows of one unit, at most */

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

/* The parameters of every attend function, block or unit (the order DEFINE_ATTEND_LANES documents). */
#define ATTEND_ARGS(T, KT)                                                                               \
    const T *q, const KT *k_buf, const KT *v_buf, const int64_t *ids, int64_t nr, const int32_t *slots,  \
        int64_t len, const int32_t *limits, const int32_t *lows, int64_t kv_heads, int64_t h, int64_t dim, \
        float scale, const T *seed_out, const float *seed_lse, T *out, float *lse

#define LANE_VECS 1
#include "attention_lane_block.h"
#undef LANE_VECS
#define LANE_VECS 2
#include "attention_lane_block.h"
#undef LANE_VECS

/* A unit of nr <= LANES rows (as DEFINE_ATTEND_LANES in attention_lane_block.h): one vector's block when its
 * rows fit one vector, else two. */
#define DEFINE_ATTEND_UNIT(NAME, T, KT)                                                                  \
    static void NAME(ATTEND_ARGS(T, KT)) {                                                               \
        if (nr <= SIMD_WIDTH)                                                                            \
            NAME##_x1(q, k_buf, v_buf, ids, nr, slots, len, limits, lows, kv_heads, h, dim, scale, seed_out, \
                      seed_lse, out, lse);                                                               \
        else                                                                                             \
            NAME##_x2(q, k_buf, v_buf, ids, nr, slots, len, limits, lows, kv_heads, h, dim, scale, seed_out, \
                      seed_lse, out, lse);                                                               \
    }
DEFINE_ATTEND_UNIT(attend_lanes_f32, float, float)
DEFINE_ATTEND_UNIT(attend_lanes_bf16_wide, uint16_t, uint16_t)
DEFINE_ATTEND_UNIT(attend_lanes_f32_bf16kv, float, uint16_t)
DEFINE_ATTEND_UNIT(attend_lanes_bf16_f32kv, uint16_t, float)

#ifdef HAVE_AVX512_BF16
DEFINE_ATTEND_UNIT(attend_lanes_bf16_dp, uint16_t, uint16_t)
#endif
#undef ATTEND_ARGS
#endif

#endif
