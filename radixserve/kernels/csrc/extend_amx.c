/* Causal extend (prefill) attention in bf16 on AMX tiles, K/V read from the pool through slot indices.
 *
 * Same contract as extend_attention.c (without seeds or log-sum-exps): request b's rows of `reqs` are
 * (q_start, q_len, kv_start, kv_len); query i of the request sees its first kv_len - q_len + i + 1
 * context slots kv_indices[kv_start ...]. q/out [tokens, heads, dim], k/v_buf [slots, kv_heads, dim].
 *
 * Phase 1 (parallel over requests, kv heads and 32-token blocks) packs each block's K and V into the
 * layouts a B tile wants: K pair-transposed (16 dims' pairs x 16 tokens per tile, for S = Q K^T) and V
 * token-pair interleaved (16 token pairs x 16 dims, for O = P V). Phase 2 (parallel over requests, query
 * heads and 16-query blocks) runs flash attention per block: S of 16 queries x 32 keys on the tiles, an
 * online softmax in float32 vectors (the scale applied in float32, P rounded to bf16 for the tiles, as
 * a bf16 flash kernel does), P V on the tiles added into a float32 accumulator, and one division at the
 * end. Tiles: tmm0/1 S (keys 0-15 | 16-31), then P V outputs with tmm5/6; tmm2 Q; tmm3 P; tmm4 K or V.
 *
 * prefix_attention_amx_bf16 (at the end) runs the same blocks unmasked over a prefix the batch shares, with
 * log-sum-exps: cascade's part (a).
 *
 * Returns 0; 1 for a shape it does not take (dim % 32, dim > 256, heads % kv_heads, kv_len < q_len); 2
 * without memory;
 * -2 without the OS's AMX permission (amx_request, called once by the loader).
 */
#define _GNU_SOURCE
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>

#include "amx_tiles.h"
#include "simd.h" /* vf_exp_nonpositive, vf_max16, vf_sum16; MAX_DIM */

#define KB 32 /* keys per block */
#define QB 16 /* queries per block */

static void configure(void) {
    const uint8_t rows[8] = {16, 16, 16, 16, 16, 16, 16, 16};
    configure_tiles(rows, 8);
}

/* The resident path's scores are in log2 units (scaled by scale * log2(e)). Rows whose running max is
 * exceeded by more than this are rescaled; the others keep their max, so their P values may reach 2^11
 * (~2000): exact enough in bf16 and float32 sums. */
#define LAZY_RESCALE 11.0f
#define LOG2E 1.44269504088896341f

/* 2^x for x <= 126, relative error below 5e-5 (P is rounded to bf16, 2^-8, anyway): 2^round(x) times a
 * degree-4 polynomial of the remainder in [-0.5, 0.5]; below -126 it returns ~1e-38, not 0. */
static inline __m512 exp2_ps(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(9.618129e-3f), f, _mm512_set1_ps(5.550411e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}


/* Packed block sizes in bf16 elements: one 16 x 32 tile is 512. */
static inline int64_t block_elems(int64_t dim) { return (int64_t)KB * dim; }

/* The 16 x 16 transpose of 32-bit elements r[0..15] (rows) in place: r[j][i] <- r[i][j]. */
static inline void transpose16(__m512i r[16]) {
    __m512i a[16], b[16];
    for (int k = 0; k < 16; k += 2) {
        a[k] = _mm512_unpacklo_epi32(r[k], r[k + 1]);
        a[k + 1] = _mm512_unpackhi_epi32(r[k], r[k + 1]);
    }
    for (int m = 0; m < 16; m += 4) { /* b[m + j], 128-bit lane L: column 4 L + j of rows m .. m + 3 */
        b[m] = _mm512_unpacklo_epi64(a[m], a[m + 2]);
        b[m + 1] = _mm512_unpackhi_epi64(a[m], a[m + 2]);
        b[m + 2] = _mm512_unpacklo_epi64(a[m + 1], a[m + 3]);
        b[m + 3] = _mm512_unpackhi_epi64(a[m + 1], a[m + 3]);
    }
    for (int j = 0; j < 4; j++) {
        const __m512i c0 = _mm512_shuffle_i32x4(b[j], b[4 + j], 0x44), c1 = _mm512_shuffle_i32x4(b[j], b[4 + j], 0xEE);
        const __m512i d0 = _mm512_shuffle_i32x4(b[8 + j], b[12 + j], 0x44), d1 = _mm512_shuffle_i32x4(b[8 + j], b[12 + j], 0xEE);
        r[j] = _mm512_shuffle_i32x4(c0, d0, 0x88);
        r[4 + j] = _mm512_shuffle_i32x4(c0, d0, 0xDD);
        r[8 + j] = _mm512_shuffle_i32x4(c1, d1, 0x88);
        r[12 + j] = _mm512_shuffle_i32x4(c1, d1, 0xDD);
    }
}

/* K block -> kp[s][c][p][t][e] = K[16 s + t][32 c + 2 p + e]; V block -> vp[g][p][n][e] = V[2 p + e][16 g + n].
 * Keys past the context are zero. K: per 16 tokens and 32 dims, a 16 x 16 transpose of (token, dim pair) in
 * registers; V: two token rows interleaved 16 dims at a time. */
static void pack_block(const uint16_t *k_buf, const uint16_t *v_buf, const int32_t *slots, int64_t count,
                       int64_t kv_heads, int64_t h, int64_t dim, uint16_t *kp, uint16_t *vp) {
    const int64_t steps = dim / 32;
    const uint16_t *krows[KB], *vrows[KB];
    for (int64_t t = 0; t < count; t++) {
        krows[t] = k_buf + ((int64_t)slots[t] * kv_heads + h) * dim;
        vrows[t] = v_buf + ((int64_t)slots[t] * kv_heads + h) * dim;
    }
    for (int64_t s = 0; s < KB / 16; s++)
        for (int64_t c = 0; c < steps; c++) {
            __m512i r[16];
            for (int64_t t = 0; t < 16; t++)
                r[t] = 16 * s + t < count ? _mm512_loadu_si512(krows[16 * s + t] + 32 * c) : _mm512_setzero_si512();
            transpose16(r);
            uint16_t *dst = kp + (s * steps + c) * 512;
            for (int64_t p = 0; p < 16; p++) _mm512_store_si512(dst + 32 * p, r[p]);
        }
    for (int64_t t = 0; t < KB; t += 2)
        for (int64_t g = 0; g < dim / 16; g++) {
            const __m256i a = t < count ? _mm256_loadu_si256((const __m256i *)(vrows[t] + 16 * g)) : _mm256_setzero_si256();
            const __m256i b = t + 1 < count ? _mm256_loadu_si256((const __m256i *)(vrows[t + 1] + 16 * g)) : _mm256_setzero_si256();
            const __m256i lo = _mm256_unpacklo_epi16(a, b), hi = _mm256_unpackhi_epi16(a, b);
            uint16_t *dst = vp + g * 512 + (t / 2) * 32;
            _mm256_store_si256((__m256i *)dst, _mm256_permute2x128_si256(lo, hi, 0x20));
            _mm256_store_si256((__m256i *)(dst + 16), _mm256_permute2x128_si256(lo, hi, 0x31));
        }
}

/* S of 16 queries x 32 keys into sbuf (scaled, masked; tmm0/1 S, tmm2 Q, tmm3 K); returns the 16 rows'
 * maxima (lane r: row r). */
static inline __m512 scores_block(const uint16_t *qbuf, const uint16_t *kb, float *sbuf, int64_t steps, int64_t dim,
                                  float scale, int masked, int64_t limit0, int causal) {
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t c = 0; c < steps; c++) {
        _tile_loadd(2, qbuf + 32 * c, 2 * dim);
        _tile_loadd(3, kb + c * 512, 64);
        _tile_dpbf16ps(0, 2, 3);
        _tile_loadd(3, kb + (steps + c) * 512, 64);
        _tile_dpbf16ps(1, 2, 3);
    }
    _tile_stored(0, sbuf, KB * 4);
    _tile_stored(1, sbuf + 16, KB * 4);
    __m512 fold[QB];
    for (int64_t r = 0; r < QB; r++) {
        __m512 s0 = _mm512_mul_ps(_mm512_load_ps(sbuf + r * KB), _mm512_set1_ps(scale));
        __m512 s1 = _mm512_mul_ps(_mm512_load_ps(sbuf + r * KB + 16), _mm512_set1_ps(scale));
        if (masked) {
            const __m512i limit = _mm512_set1_epi32((int)(causal ? limit0 + r : limit0)); /* keys <= limit */
            const __m512 ninf = _mm512_set1_ps(-INFINITY);
            s0 = _mm512_mask_mov_ps(ninf, _mm512_cmple_epi32_mask(lane, limit), s0);
            s1 = _mm512_mask_mov_ps(ninf, _mm512_cmple_epi32_mask(_mm512_add_epi32(lane, _mm512_set1_epi32(16)), limit), s1);
        }
        _mm512_store_ps(sbuf + r * KB, s0);
        _mm512_store_ps(sbuf + r * KB + 16, s1);
        fold[r] = _mm512_max_ps(s0, s1);
    }
    return vf_max16(fold);
}

/* P = exp(S - shift) of each row (base 2 when `base2`: the resident path's log2 units) into pbuf as bf16;
 * returns the 16 rows' sums of P in float32 (lane r: row r). */
static inline __m512 probs_block(const float *sbuf, const float *shifts, uint16_t *pbuf, int base2) {
    __m512 fold[QB];
    for (int64_t r = 0; r < QB; r++) {
        const __m512 m = _mm512_set1_ps(shifts[r]);
        const __m512 x0 = _mm512_sub_ps(_mm512_load_ps(sbuf + r * KB), m);
        const __m512 x1 = _mm512_sub_ps(_mm512_load_ps(sbuf + r * KB + 16), m);
        const __m512 p0 = base2 ? exp2_ps(x0) : vf_exp_nonpositive(x0), p1 = base2 ? exp2_ps(x1) : vf_exp_nonpositive(x1);
        fold[r] = _mm512_add_ps(p0, p1);
        _mm512_store_si512(pbuf + r * KB, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
    }
    return vf_sum16(fold);
}

/* One block of up to 16 queries of query head `head` (kv head h) over the request's packed context. */
static void attend_block(const uint16_t *q, uint16_t *out, const uint16_t *kpack, const uint16_t *vpack,
                         int64_t q0, int64_t rows, int64_t q_len, int64_t kv_len, int64_t heads, int64_t head,
                         int64_t dim, float scale, int causal, float *lse) {
    __attribute__((aligned(64))) uint16_t qbuf[QB * MAX_DIM];
    __attribute__((aligned(64))) uint16_t pbuf[QB * KB];
    __attribute__((aligned(64))) float sbuf[QB * KB];
    __attribute__((aligned(64))) float pv[QB * 64];
    __attribute__((aligned(64))) float acc[QB * MAX_DIM];
    __attribute__((aligned(64))) float run_max[QB], run_sum[QB], alpha[QB];
    const int64_t steps = dim / 32, groups = dim / 16, before = kv_len - q_len;
    memset(qbuf, 0, sizeof(uint16_t) * QB * dim);
    for (int64_t r = 0; r < rows; r++) memcpy(qbuf + r * dim, q + ((q0 + r) * heads + head) * dim, 2 * dim);
    memset(acc, 0, sizeof(float) * QB * dim);
    for (int r = 0; r < QB; r++) run_max[r] = -INFINITY, run_sum[r] = 0.0f;
    /* the block's last query sees keys 0..last_key; unmasked (a shared prefix), every query sees all kv_len */
    const int64_t last_key = causal ? before + q0 + rows - 1 : kv_len - 1, seen = causal ? before + q0 : kv_len - 1;
    for (int64_t b = 0; b * KB <= last_key; b++) {
        const uint16_t *kb = kpack + b * block_elems(dim), *vb = vpack + b * block_elems(dim);
        const int masked = (b + 1) * KB - 1 > seen; /* some key of the block is past some query */
        const __m512 block_max = scores_block(qbuf, kb, sbuf, steps, dim, scale, masked, seen - b * KB, causal);
        const __m512 old_max = _mm512_load_ps(run_max);
        const __m512 top = _mm512_max_ps(old_max, block_max);
        /* NOTE: a row with no key yet keeps max -inf; its shift is 0 so that exp never sees inf - inf */
        const __mmask16 none = _mm512_cmp_ps_mask(top, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ);
        const __m512 shift = _mm512_mask_mov_ps(top, none, _mm512_setzero_ps());
        _mm512_store_ps(alpha, _mm512_mask_mov_ps(vf_exp_nonpositive(_mm512_sub_ps(old_max, shift)), none,
                                                  _mm512_set1_ps(1.0f)));
        _mm512_store_ps(run_max, top);
        __attribute__((aligned(64))) float shifts[QB];
        _mm512_store_ps(shifts, shift);
        const __m512 sums = probs_block(sbuf, shifts, pbuf, 0);
        _mm512_store_ps(run_sum, _mm512_fmadd_ps(_mm512_load_ps(run_sum), _mm512_load_ps(alpha), sums));
        _tile_loadd(3, pbuf, KB * 2);
        for (int64_t g0 = 0; g0 < groups; g0 += 4) { /* P V, 4 column groups of 16 dims at a time */
            const int64_t n = groups - g0 < 4 ? groups - g0 : 4;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(5);
            _tile_zero(6);
            _tile_loadd(4, vb + g0 * 512, 64);
            _tile_dpbf16ps(0, 3, 4);
            if (n > 1) { _tile_loadd(4, vb + (g0 + 1) * 512, 64); _tile_dpbf16ps(1, 3, 4); }
            if (n > 2) { _tile_loadd(4, vb + (g0 + 2) * 512, 64); _tile_dpbf16ps(5, 3, 4); }
            if (n > 3) { _tile_loadd(4, vb + (g0 + 3) * 512, 64); _tile_dpbf16ps(6, 3, 4); }
            _tile_stored(0, pv, 64 * 4);
            _tile_stored(1, pv + 16, 64 * 4);
            _tile_stored(5, pv + 32, 64 * 4);
            _tile_stored(6, pv + 48, 64 * 4);
            for (int64_t r = 0; r < rows; r++) {
                const __m512 a = _mm512_set1_ps(alpha[r]);
                for (int64_t j = 0; j < n; j++) {
                    float *o = acc + r * dim + 16 * (g0 + j);
                    _mm512_store_ps(o, _mm512_fmadd_ps(_mm512_load_ps(o), a, _mm512_load_ps(pv + r * 64 + 16 * j)));
                }
            }
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        const __m512 inv = _mm512_set1_ps(run_sum[r] > 0.0f ? 1.0f / run_sum[r] : 0.0f);
        uint16_t *o = out + ((q0 + r) * heads + head) * dim;
        for (int64_t d = 0; d < dim; d += 16)
            _mm256_storeu_si256((__m256i *)(o + d), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(acc + r * dim + d), inv)));
        if (lse) lse[(q0 + r) * heads + head] = run_max[r] + logf(run_sum[r]);
    }
}

/* The resident path's output tiles tmm4 .. tmm(3 + groups), groups 2 or 4, to and from acc (rows of 64
 * floats); tile numbers must be immediates. */
static inline void store_out_tiles(float *acc, int64_t groups) {
    _tile_stored(4, acc, 64 * 4);
    _tile_stored(5, acc + 16, 64 * 4);
    if (groups > 2) {
        _tile_stored(6, acc + 32, 64 * 4);
        _tile_stored(7, acc + 48, 64 * 4);
    }
}

static inline void load_out_tiles(const float *acc, int64_t groups) {
    _tile_loadd(4, acc, 64 * 4);
    _tile_loadd(5, acc + 16, 64 * 4);
    if (groups > 2) {
        _tile_loadd(6, acc + 32, 64 * 4);
        _tile_loadd(7, acc + 48, 64 * 4);
    }
}

/* attend_block for dim <= 64: the output's dim / 16 float32 tiles (tmm4-7) stay in the tile registers
 * across all key blocks, P V accumulating into them; a row's running max is raised (and the tiles
 * rescaled through memory) only when a block exceeds it by more than LAZY_RESCALE, which after the first
 * few blocks is rare. Tiles: tmm0/1 S, then tmm0 P; tmm2 Q; tmm3 K or V; tmm4-7 O. */
static void attend_block_resident(const uint16_t *q, uint16_t *out, const uint16_t *kpack, const uint16_t *vpack,
                                  int64_t q0, int64_t rows, int64_t q_len, int64_t kv_len, int64_t heads,
                                  int64_t head, int64_t dim, float scale, int causal, float *lse) {
    __attribute__((aligned(64))) uint16_t qbuf[QB * 64];
    __attribute__((aligned(64))) uint16_t pbuf[QB * KB];
    __attribute__((aligned(64))) float sbuf[QB * KB];
    __attribute__((aligned(64))) float acc[QB * 64];
    __attribute__((aligned(64))) float run_max[QB], run_sum[QB], alpha[QB], shifts[QB];
    const int64_t steps = dim / 32, groups = dim / 16, before = kv_len - q_len;
    memset(qbuf, 0, sizeof qbuf);
    for (int64_t r = 0; r < rows; r++) memcpy(qbuf + r * dim, q + ((q0 + r) * heads + head) * dim, 2 * dim);
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    _mm512_store_ps(run_sum, _mm512_setzero_ps());
    const int64_t last_key = causal ? before + q0 + rows - 1 : kv_len - 1, seen = causal ? before + q0 : kv_len - 1;
    for (int64_t b = 0; b * KB <= last_key; b++) {
        const uint16_t *kb = kpack + b * block_elems(dim), *vb = vpack + b * block_elems(dim);
        const int masked = (b + 1) * KB - 1 > seen;
        const __m512 top = scores_block(qbuf, kb, sbuf, steps, dim, scale * LOG2E, masked, seen - b * KB, causal);
        /* NOTE: every row sees key 0, so after block 0 no running max is -inf */
        __m512 mx = top;
        if (b > 0) {
            const __m512 old = _mm512_load_ps(run_max);
            const __mmask16 raise = _mm512_cmp_ps_mask(top, _mm512_add_ps(old, _mm512_set1_ps(LAZY_RESCALE)), _CMP_GT_OQ);
            mx = _mm512_mask_mov_ps(old, raise, top);
            if (raise) {
                const __m512 a = _mm512_mask_mov_ps(_mm512_set1_ps(1.0f), raise, exp2_ps(_mm512_sub_ps(old, top)));
                _mm512_store_ps(alpha, a);
                _mm512_store_ps(run_sum, _mm512_mul_ps(_mm512_load_ps(run_sum), a));
                store_out_tiles(acc, groups);
                for (int64_t r = 0; r < QB; r++) {
                    if (!(raise >> r & 1)) continue;
                    const __m512 ar = _mm512_set1_ps(alpha[r]);
                    for (int64_t g = 0; g < groups; g++)
                        _mm512_store_ps(acc + r * 64 + 16 * g, _mm512_mul_ps(_mm512_load_ps(acc + r * 64 + 16 * g), ar));
                }
                load_out_tiles(acc, groups);
            }
        }
        _mm512_store_ps(run_max, mx);
        _mm512_store_ps(shifts, mx);
        _mm512_store_ps(run_sum, _mm512_add_ps(_mm512_load_ps(run_sum), probs_block(sbuf, shifts, pbuf, 1)));
        _tile_loadd(0, pbuf, KB * 2);
        _tile_loadd(3, vb, 64);
        _tile_dpbf16ps(4, 0, 3);
        _tile_loadd(3, vb + 512, 64);
        _tile_dpbf16ps(5, 0, 3);
        if (groups > 2) {
            _tile_loadd(3, vb + 2 * 512, 64);
            _tile_dpbf16ps(6, 0, 3);
            _tile_loadd(3, vb + 3 * 512, 64);
            _tile_dpbf16ps(7, 0, 3);
        }
    }
    store_out_tiles(acc, groups);
    for (int64_t r = 0; r < rows; r++) {
        const __m512 inv = _mm512_set1_ps(run_sum[r] > 0.0f ? 1.0f / run_sum[r] : 0.0f);
        uint16_t *o = out + ((q0 + r) * heads + head) * dim;
        for (int64_t d = 0; d < dim; d += 16)
            _mm256_storeu_si256((__m256i *)(o + d), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(acc + r * 64 + d), inv)));
        if (lse) lse[(q0 + r) * heads + head] = run_max[r] / LOG2E + logf(run_sum[r]); /* run_max in log2 units */
    }
}

int extend_attention_amx_bf16(const uint16_t *q, const uint16_t *k_buf, const uint16_t *v_buf,
                              const int32_t *kv_indices, const int64_t *reqs, uint16_t *out, int64_t bs,
                              int64_t heads, int64_t kv_heads, int64_t dim, float scale, int num_threads) {
    if (dim % 32 || dim > MAX_DIM || kv_heads < 1 || heads % kv_heads) return 1;
    for (int64_t b = 0; b < bs; b++) /* q_start, q_len, kv_start, kv_len: a query must see its own key */
        if (reqs[4 * b] < 0 || reqs[4 * b + 1] < 0 || reqs[4 * b + 2] < 0 || reqs[4 * b + 3] < reqs[4 * b + 1]) return 1;
    const int64_t group = heads / kv_heads;
    int64_t *pack_at = malloc(sizeof(int64_t) * (bs + 1)), *qblocks_at = malloc(sizeof(int64_t) * (bs + 1));
    if (!pack_at || !qblocks_at) {
        free(pack_at);
        free(qblocks_at);
        return 2;
    }
    pack_at[0] = qblocks_at[0] = 0; /* per request: its first K/V block, its first query block */
    for (int64_t b = 0; b < bs; b++) {
        pack_at[b + 1] = pack_at[b] + (reqs[4 * b + 3] + KB - 1) / KB;
        qblocks_at[b + 1] = qblocks_at[b] + (reqs[4 * b + 1] + QB - 1) / QB;
    }
    const int64_t kv_blocks = pack_at[bs], q_blocks = qblocks_at[bs];
    uint16_t *kpack = aligned_alloc(64, sizeof(uint16_t) * kv_blocks * kv_heads * block_elems(dim) + 64);
    uint16_t *vpack = aligned_alloc(64, sizeof(uint16_t) * kv_blocks * kv_heads * block_elems(dim) + 64);
    if (!kpack || !vpack) {
        free(kpack), free(vpack), free(pack_at), free(qblocks_at);
        return 2;
    }
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < kv_blocks * kv_heads; i++) {
            const int64_t blk = i / kv_heads, h = i % kv_heads;
            int64_t b = 0;
            while (pack_at[b + 1] <= blk) b++;
            const int64_t j = blk - pack_at[b], kv_len = reqs[4 * b + 3];
            const int64_t count = kv_len - j * KB < KB ? kv_len - j * KB : KB;
            const int64_t at = (h * kv_blocks + blk) * block_elems(dim); /* head-major: a request's blocks are adjacent */
            pack_block(k_buf, v_buf, kv_indices + reqs[4 * b + 2] + j * KB, count, kv_heads, h, dim,
                       kpack + at, vpack + at);
        }
        configure();
        /* NOTE: later query blocks see more keys: dynamic scheduling from the last block down balances them */
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = q_blocks * heads - 1; i >= 0; i--) {
            const int64_t qblk = i / heads, head = i % heads, h = head / group;
            int64_t b = 0;
            while (qblocks_at[b + 1] <= qblk) b++;
            const int64_t q_start = reqs[4 * b], q_len = reqs[4 * b + 1], kv_len = reqs[4 * b + 3];
            const int64_t first = (qblk - qblocks_at[b]) * QB, rows = q_len - first < QB ? q_len - first : QB;
            const int64_t at = (h * kv_blocks + pack_at[b]) * block_elems(dim);
            (dim <= 64 ? attend_block_resident : attend_block)(q + q_start * heads * dim, out + q_start * heads * dim,
                                                               kpack + at, vpack + at, first, rows, q_len, kv_len,
                                                               heads, head, dim, scale, 1, NULL);
        }
        _tile_release();
    }
    free(kpack), free(vpack), free(pack_at), free(qblocks_at);
    return 0;
}

/* Cascade's part (a) on the tiles: every query token of q [n, heads, dim] over the same prefix_len slots,
 * unmasked (every query sits past the shared prefix); writes the normalised output and each row's log-sum-exp
 * (float32 [n, heads], natural log). The signature of prefix_attention.c's kernels, so the C decode step calls
 * either; `first` (window layers' lower bounds) is not taken here. The prefix's K/V are packed once per call
 * (phase 1 as above), then each 16-token block of one query head runs the extend kernel's block unmasked.
 * Returns 0; 1 for a shape it does not take (dim % 32, dim > MAX_DIM, heads % kv_heads, prefix_len < 1, first
 * set); 2 without memory. */
int prefix_attention_amx_bf16(const uint16_t *q, const uint16_t *k_buf, const uint16_t *v_buf, const int32_t *slots,
                              const int32_t *first, uint16_t *out, float *lse, int64_t n, int64_t prefix_len,
                              int64_t heads, int64_t kv_heads, int64_t dim, float scale, int num_threads) {
    if (first || dim % 32 || dim > MAX_DIM || kv_heads < 1 || heads % kv_heads || n < 0 || prefix_len < 1) return 1;
    const int64_t group = heads / kv_heads, kv_blocks = (prefix_len + KB - 1) / KB, q_blocks = (n + QB - 1) / QB;
    const int64_t head_elems = kv_blocks * block_elems(dim);
    uint16_t *kpack = aligned_alloc(64, sizeof(uint16_t) * kv_heads * head_elems + 64);
    uint16_t *vpack = aligned_alloc(64, sizeof(uint16_t) * kv_heads * head_elems + 64);
    if (!kpack || !vpack) {
        free(kpack), free(vpack);
        return 2;
    }
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < kv_blocks * kv_heads; i++) {
            const int64_t blk = i / kv_heads, h = i % kv_heads;
            const int64_t count = prefix_len - blk * KB < KB ? prefix_len - blk * KB : KB;
            const int64_t at = h * head_elems + blk * block_elems(dim);
            pack_block(k_buf, v_buf, slots + blk * KB, count, kv_heads, h, dim, kpack + at, vpack + at);
        }
        configure();
        /* NOTE: every block sees the whole prefix: equal work, static scheduling */
#pragma omp for schedule(static)
        for (int64_t i = 0; i < q_blocks * heads; i++) {
            const int64_t qblk = i / heads, head = i % heads, h = head / group;
            const int64_t q0 = qblk * QB, rows = n - q0 < QB ? n - q0 : QB;
            (dim <= 64 ? attend_block_resident : attend_block)(q, out, kpack + h * head_elems, vpack + h * head_elems,
                                                               q0, rows, n, prefix_len, heads, head, dim, scale, 0,
                                                               lse);
        }
        _tile_release();
    }
    free(kpack), free(vpack);
    return 0;
}
