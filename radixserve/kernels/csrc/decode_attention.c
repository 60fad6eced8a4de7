/* Paged decode attention for the CPU: one query token per request, K/V read in place from the pool.
 *
 * For each (request, kv head) pair -- spread over OpenMP threads -- the kernel walks the request's
 * slots in chunks, scores the chunk for every query head of the group, and folds it into a running
 * softmax (max, sum, weighted V) in float32. Every K and V row of the context is read exactly once
 * and nothing is gathered or copied. For cascade attention, `seed_out` [bs, heads, dim] and
 * `seed_lse` (float32 [bs, heads]) may hold each query head's partial result over the batch's shared
 * prefix (prefix_attention.c); every row then starts from it, so the slots given here are only the
 * request's own and the output is the exact merge of both. Built and loaded by native.py.
 *
 * Paths, best first: with AVX-512, decode_avx512.h (sixteen tokens scored at once; bf16 scores by
 * vdpbf16ps where AVX-512 BF16 is present, else bf16 widened to float32); with AVX2 (dim % 8 == 0) the
 * head dim runs across the lanes, bf16 widened to float32 as it is loaded; otherwise the portable loop
 * of attention_common.h.
 */
#include <stdlib.h>

#include "simd.h"

#define DEFINE_DECODE(NAME, T, KT, ATTEND_ROWS)                                                          \
    static int NAME(const T *q, const KT *k_buf, const KT *v_buf, const int32_t *kv_indices,             \
                    const int64_t *seq_lens, const T *seed_out, const float *seed_lse, T *out, int64_t bs,   \
                    int64_t max_len, int64_t heads, int64_t kv_heads, int64_t dim, float scale,          \
                    int num_threads) {                                                                   \
        const int64_t group = heads / kv_heads;                                                          \
        _Pragma("omp parallel for collapse(2) schedule(dynamic, 1) num_threads(num_threads)")            \
        for (int64_t b = 0; b < bs; b++) {                                                               \
            for (int64_t h = 0; h < kv_heads; h++) {                                                     \
                int64_t ids[MAX_GROUP];                                                                  \
                for (int64_t g = 0; g < group; g++) ids[g] = b * heads + h * group + g;                  \
                ATTEND_ROWS(q, k_buf, v_buf, ids, group, kv_indices + b * max_len, seq_lens[b], NULL,    \
                            NULL, kv_heads, h, dim, scale, seed_out, seed_lse, out, NULL);               \
            }                                                                                            \
        }                                                                                                \
        return 0;                                                                                        \
    }

DEFINE_DECODE(decode_rows_bf16, uint16_t, uint16_t, attend_rows_bf16)
DEFINE_DECODE(decode_rows_f32, float, float, attend_rows_f32)
DEFINE_DECODE(decode_rows_f32_bf16kv, float, uint16_t, attend_rows_f32_bf16kv)

#define MAX_HEADS 64 /* query heads a whole-request unit holds (else (request, kv head) units) */
#define PART_TOKENS 1024 /* a long context is attended in parts of at least this many tokens, then merged */
#define MAX_PARTS 32     /* parts of one context at most (longer parts past that) */

/* The parts of a context of `len` tokens and their length: PART_TOKENS each, longer when MAX_PARTS would not do. */
static inline int64_t context_parts(int64_t len) {
    const int64_t parts = (len + PART_TOKENS - 1) / PART_TOKENS;
    return parts < 1 ? 1 : parts > MAX_PARTS ? MAX_PARTS : parts;
}
static inline int64_t part_tokens(int64_t len) { return (len + context_parts(len) - 1) / context_parts(len); }

/* Every row's softmax over several parts merged: out = sum_p exp(lse_p - L) out_p / sum_p exp(lse_p - L), the parts
 * in order (part_out [parts][rows][dim], part_lse [parts][rows]; a part with lse -inf holds nothing). */
#define DEFINE_MERGE_PARTS(NAME, T, LOAD, STORE)                                                         \
    static void NAME(const T *part_out, const float *part_lse, int64_t parts, int64_t rows, int64_t dim, \
                     T *out, int num_threads) {                                                          \
        _Pragma("omp parallel for schedule(static) num_threads(num_threads) if (rows * parts * dim >= 65536)")    \
        for (int64_t i = 0; i < rows; i++) {                                                             \
            float top = -INFINITY, weight[MAX_PARTS], total = 0.0f, acc[MAX_DIM];                        \
            for (int64_t p = 0; p < parts; p++) top = part_lse[p * rows + i] > top ? part_lse[p * rows + i] : top; \
            for (int64_t p = 0; p < parts; p++) {                                                        \
                weight[p] = top > -INFINITY ? expf(part_lse[p * rows + i] - top) : 0.0f;                 \
                total += weight[p];                                                                      \
            }                                                                                            \
            for (int64_t d = 0; d < dim; d++) acc[d] = 0.0f;                                             \
            for (int64_t p = 0; p < parts; p++)                                                          \
                if (weight[p] > 0.0f)                                                                    \
                    for (int64_t d = 0; d < dim; d++) acc[d] += weight[p] * LOAD(part_out[(p * rows + i) * dim + d]); \
            const float inv = total > 0.0f ? 1.0f / total : 0.0f;                                        \
            for (int64_t d = 0; d < dim; d++) out[i * dim + d] = STORE(acc[d] * inv);                    \
        }                                                                                                \
    }

/* A unit's work is one request's kv heads [h0, h1) and their group query heads each, over one part of its
 * context; q, seed and out point at the unit's first query row, rows (h - h0) * group + g. Splits a batch
 * into units: whole requests when there are enough of them (each request's slots streamed once, every head
 * of a token read together), else (request, kv head) pairs so that a lone request still uses every thread.
 * NOTE: a context longer than PART_TOKENS is split into parts whose bounds depend on its own length only
 * (context_parts, part_tokens), never on the batch or the thread count: a long request at batch 1 keeps
 * every thread busy (a model with fewer kv heads than threads would else leave some idle), and a row's
 * result never depends on what else the batch holds. Parts are merged by their log-sum-exp, in order; the
 * seed (cascade) enters part 0. */
#define DEFINE_DECODE_UNITS(NAME, T, KT, REQUEST, MERGE)                                                 \
    static int NAME(const T *q, const KT *k_buf, const KT *v_buf, const int32_t *kv_indices,             \
                    const int64_t *seq_lens, const T *seed_out, const float *seed_lse, T *out, int64_t bs,   \
                    int64_t max_len, int64_t heads, int64_t kv_heads, int64_t dim, float scale,          \
                    int num_threads) {                                                                   \
        const int64_t group = heads / kv_heads;                                                          \
        const int64_t split = bs >= num_threads && heads <= MAX_HEADS ? 1 : kv_heads;                    \
        int64_t parts = 1;                                                                               \
        for (int64_t b = 0; b < bs; b++) {                                                               \
            const int64_t own = context_parts(seq_lens[b]);                                              \
            parts = own > parts ? own : parts;                                                           \
        }                                                                                                \
        T *part_out = parts > 1 ? malloc(sizeof(T) * (size_t)(parts * bs * heads * dim)) : NULL;         \
        float *part_lse = parts > 1 ? malloc(sizeof(float) * (size_t)(parts * bs * heads)) : NULL;        \
        if (parts > 1 && (!part_out || !part_lse)) {                                                     \
            free(part_out);                                                                              \
            free(part_lse);                                                                              \
            return 2;                                                                                    \
        }                                                                                                \
        _Pragma("omp parallel for schedule(dynamic, 1) num_threads(num_threads)")                        \
        for (int64_t unit = 0; unit < bs * split * parts; unit++) {                                      \
            const int64_t p = unit % parts, b = unit / parts / split, h0 = (unit / parts % split) * (kv_heads / split); \
            const int64_t h1 = split == 1 ? kv_heads : h0 + 1;                                           \
            const int64_t first = b * heads + h0 * group; /* row id of the unit's first query head */    \
            const int64_t part_len = part_tokens(seq_lens[b]), t0 = p * part_len, left = seq_lens[b] - t0; \
            const int64_t n = left < 0 ? 0 : left < part_len ? left : part_len;                          \
            const int seeded = seed_lse != NULL && p == 0;                                               \
            if (parts > 1 && n == 0 && !seeded) {                                                        \
                for (int64_t r = 0; r < (h1 - h0) * group; r++) part_lse[p * bs * heads + first + r] = -INFINITY; \
                continue;                                                                                \
            }                                                                                            \
            REQUEST(q + first * dim, k_buf, v_buf, kv_indices + b * max_len + t0, n, kv_heads, h0, h1, dim, \
                    group, scale, seeded ? seed_out + first * dim : NULL, seeded ? seed_lse + first : NULL, \
                    parts > 1 ? part_out + (p * bs * heads + first) * dim : out + first * dim,           \
                    parts > 1 ? part_lse + p * bs * heads + first : NULL);                               \
        }                                                                                                \
        if (parts > 1) MERGE(part_out, part_lse, parts, bs * heads, dim, out, num_threads);              \
        free(part_out);                                                                                  \
        free(part_lse);                                                                                  \
        return 0;                                                                                        \
    }

#if SIMD_WIDTH == 8 || SIMD_WIDTH == 16
DEFINE_MERGE_PARTS(merge_parts_f32, float, f32_id, f32_id)
DEFINE_MERGE_PARTS(merge_parts_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
#endif

#if SIMD_WIDTH == 8 /* AVX2; AVX-512 runs decode_avx512.h */
#define DECODE_TOKENS 8   /* tokens scored together; their 8 dot products are reduced in one step */
#define PREFETCH_AHEAD 16 /* tokens between a K/V row's prefetch and its scoring */

/* One unit (see DEFINE_DECODE_UNITS), the head dim across the lanes (dim % SIMD_WIDTH == 0). */
#define DEFINE_DECODE_REQUEST_DIM(NAME, T, KT, QLOADV, LOADV, LOAD, STORE)                               \
    static void NAME(const T *q, const KT *k_buf, const KT *v_buf, const int32_t *slots, int64_t len,    \
                     int64_t kv_heads, int64_t h0, int64_t h1, int64_t dim, int64_t group, float scale,  \
                     const T *seed_out, const float *seed_lse, T *out, float *out_lse) {                 \
        const int64_t nv = dim / SIMD_WIDTH, rows = (h1 - h0) * group, width = (h1 - h0) * dim;          \
        vf qv[MAX_HEADS][MAX_DIM / SIMD_WIDTH];                                                          \
        float acc[MAX_HEADS][MAX_DIM], score[MAX_HEADS][CHUNK], run_max[MAX_HEADS], run_sum[MAX_HEADS];  \
        const KT *vrow[CHUNK];                                                                           \
        for (int64_t r = 0; r < rows; r++) {                                                             \
            for (int64_t c = 0; c < nv; c++)                                                             \
                qv[r][c] = vf_mul(QLOADV(q + r * dim + c * SIMD_WIDTH), vf_set1(scale));                 \
            for (int64_t d = 0; d < dim; d++) acc[r][d] = seed_lse != NULL ? LOAD(seed_out[r * dim + d]) : 0.0f; \
            run_max[r] = seed_lse != NULL ? seed_lse[r] : -INFINITY;                                     \
            run_sum[r] = seed_lse != NULL && seed_lse[r] > -INFINITY ? 1.0f : 0.0f;                      \
        }                                                                                                \
        for (int64_t t0 = 0; t0 < len; t0 += CHUNK) {                                                    \
            const int64_t n = len - t0 < CHUNK ? len - t0 : CHUNK;                                       \
            for (int64_t t = 0; t < n; t += DECODE_TOKENS) {                                             \
                for (int64_t i = t0 + t + PREFETCH_AHEAD; i < t0 + t + PREFETCH_AHEAD + DECODE_TOKENS && i < len; i++) { \
                    prefetch_row(k_buf + ((int64_t)slots[i] * kv_heads + h0) * dim, width * (int64_t)sizeof(KT)); \
                    prefetch_row(v_buf + ((int64_t)slots[i] * kv_heads + h0) * dim, width * (int64_t)sizeof(KT)); \
                }                                                                                        \
                for (int64_t h = h0; h < h1; h++) {                                                      \
                    const KT *krow[DECODE_TOKENS];                                                       \
                    for (int64_t i = 0; i < DECODE_TOKENS; i++)                                          \
                        krow[i] = k_buf + ((int64_t)slots[t0 + (t + i < n ? t + i : n - 1)] * kv_heads + h) * dim; \
                    for (int64_t r = (h - h0) * group; r < (h - h0 + 1) * group; r++) {                 \
                        vf s[DECODE_TOKENS];                                                             \
                        for (int64_t i = 0; i < DECODE_TOKENS; i++) s[i] = vf_zero();                    \
                        for (int64_t c = 0; c < nv; c++) {                                               \
                            const vf qc = qv[r][c];                                                      \
                            for (int64_t i = 0; i < DECODE_TOKENS; i++)                                  \
                                s[i] = vf_fmadd(qc, LOADV(krow[i] + c * SIMD_WIDTH), s[i]);              \
                        }                                                                                \
                        vf_sums8(s, score[r] + t); /* past n: repeats of the last token, masked below */ \
                    }                                                                                    \
                }                                                                                        \
            }                                                                                            \
            for (int64_t r = 0; r < rows; r++) {                                                         \
                const float rescale = softmax_chunk(score[r], n, &run_max[r], &run_sum[r]);              \
                for (int64_t d = 0; d < dim; d++) acc[r][d] *= rescale;                                  \
            }                                                                                            \
            for (int64_t h = h0; h < h1; h++) {                                                          \
                const int64_t r0 = (h - h0) * group;                                                     \
                for (int64_t t = 0; t < n; t++) vrow[t] = v_buf + ((int64_t)slots[t0 + t] * kv_heads + h) * dim; \
                for (int64_t c = 0; c < nv; c++) {                                                       \
                    vf a[MAX_GROUP];                                                                     \
                    for (int64_t g = 0; g < group; g++) a[g] = vf_load(acc[r0 + g] + c * SIMD_WIDTH);    \
                    for (int64_t t = 0; t < n; t++) {                                                    \
                        const vf v = LOADV(vrow[t] + c * SIMD_WIDTH);                                    \
                        for (int64_t g = 0; g < group; g++) a[g] = vf_fmadd(vf_set1(score[r0 + g][t]), v, a[g]); \
                    }                                                                                    \
                    for (int64_t g = 0; g < group; g++) vf_store(acc[r0 + g] + c * SIMD_WIDTH, a[g]);    \
                }                                                                                        \
            }                                                                                            \
        }                                                                                                \
        for (int64_t r = 0; r < rows; r++) {                                                             \
            const float inv = run_sum[r] > 0.0f ? 1.0f / run_sum[r] : 0.0f;                              \
            for (int64_t d = 0; d < dim; d++) out[r * dim + d] = STORE(acc[r][d] * inv);                 \
            if (out_lse != NULL) out_lse[r] = run_sum[r] > 0.0f ? run_max[r] + logf(run_sum[r]) : -INFINITY; \
        }                                                                                                \
    }

DEFINE_DECODE_REQUEST_DIM(decode_request_dim_f32, float, float, vf_load, vf_load, f32_id, f32_id)
DEFINE_DECODE_REQUEST_DIM(decode_request_dim_bf16, uint16_t, uint16_t, vf_load_bf16, vf_load_bf16, bf16_to_f32,
                          f32_to_bf16)
DEFINE_DECODE_REQUEST_DIM(decode_request_dim_f32_bf16kv, float, uint16_t, vf_load, vf_load_bf16, f32_id, f32_id)
DEFINE_DECODE_UNITS(decode_dim_f32, float, float, decode_request_dim_f32, merge_parts_f32)
DEFINE_DECODE_UNITS(decode_dim_bf16, uint16_t, uint16_t, decode_request_dim_bf16, merge_parts_bf16)
DEFINE_DECODE_UNITS(decode_dim_f32_bf16kv, float, uint16_t, decode_request_dim_f32_bf16kv, merge_parts_f32)
#endif

#if SIMD_WIDTH == 16
#include "decode_avx512.h"

#define DEFINE_REQUEST_512(NAME, T, KT, UNIT)                                                            \
    static void NAME(const T *q, const KT *k_buf, const KT *v_buf, const int32_t *slots, int64_t len,    \
                     int64_t kv_heads, int64_t h0, int64_t h1, int64_t dim, int64_t group, float scale,  \
                     const T *seed_out, const float *seed_lse, T *out, float *out_lse) {                 \
        DECODE_SHAPES(UNIT, group, dim / 16, q, k_buf, v_buf, slots, len, kv_heads, h0, h1, scale,      \
                      seed_out, seed_lse, out, out_lse)                                                  \
    }

DEFINE_REQUEST_512(decode_request_512_f32, float, float, decode_unit_f32)
DEFINE_REQUEST_512(decode_request_512_bf16w, uint16_t, uint16_t, decode_unit_bf16w)
DEFINE_REQUEST_512(decode_request_512_f32_bf16kv, float, uint16_t, decode_unit_f32_bf16kv)
DEFINE_DECODE_UNITS(decode_512_f32, float, float, decode_request_512_f32, merge_parts_f32)
DEFINE_DECODE_UNITS(decode_512_bf16w, uint16_t, uint16_t, decode_request_512_bf16w, merge_parts_bf16)
DEFINE_DECODE_UNITS(decode_512_f32_bf16kv, float, uint16_t, decode_request_512_f32_bf16kv, merge_parts_f32)
#ifdef HAVE_AVX512_BF16
DEFINE_REQUEST_512(decode_request_512_bf16dp, uint16_t, uint16_t, decode_unit_bf16dp)
DEFINE_DECODE_UNITS(decode_512_bf16dp, uint16_t, uint16_t, decode_request_512_bf16dp, merge_parts_bf16)
#endif
#endif

static int bad_shape(int64_t heads, int64_t kv_heads, int64_t dim) {
    return kv_heads < 1 || dim < 1 || dim > MAX_DIM || heads % kv_heads != 0 || heads / kv_heads > MAX_GROUP;
}

int EXPORT(decode_attention_f32)(const float *q, const float *k_buf, const float *v_buf, const int32_t *kv_indices,
                                 const int64_t *seq_lens, const float *seed_out, const float *seed_lse, float *out,
                                 int64_t bs, int64_t max_len, int64_t heads, int64_t kv_heads, int64_t dim, float scale,
                                 int num_threads) {
    if (bad_shape(heads, kv_heads, dim)) return 1;
#if SIMD_WIDTH == 16
    if (dim % 16 == 0)
        return decode_512_f32(q, k_buf, v_buf, kv_indices, seq_lens, seed_out, seed_lse, out, bs, max_len, heads,
                              kv_heads, dim, scale, num_threads);
#elif SIMD_WIDTH == 8
    if (dim % SIMD_WIDTH == 0)
        return decode_dim_f32(q, k_buf, v_buf, kv_indices, seq_lens, seed_out, seed_lse, out, bs, max_len, heads,
                              kv_heads, dim, scale, num_threads);
#endif
    return decode_rows_f32(q, k_buf, v_buf, kv_indices, seq_lens, seed_out, seed_lse, out, bs, max_len, heads,
                           kv_heads, dim, scale, num_threads);
}

/* float32 queries and output over a bf16 KV cache (--kv-cache-dtype bfloat16 under float32 compute): the
 * float32 kernel's paths, with each K and V row widened to float32 as it is loaded. */
int EXPORT(decode_attention_f32_bf16kv)(const float *q, const uint16_t *k_buf, const uint16_t *v_buf,
                                        const int32_t *kv_indices, const int64_t *seq_lens, const float *seed_out,
                                        const float *seed_lse, float *out, int64_t bs, int64_t max_len, int64_t heads,
                                        int64_t kv_heads, int64_t dim, float scale, int num_threads) {
    if (bad_shape(heads, kv_heads, dim)) return 1;
#if SIMD_WIDTH == 16
    if (dim % 16 == 0)
        return decode_512_f32_bf16kv(q, k_buf, v_buf, kv_indices, seq_lens, seed_out, seed_lse, out, bs, max_len,
                                     heads, kv_heads, dim, scale, num_threads);
#elif SIMD_WIDTH == 8
    if (dim % SIMD_WIDTH == 0)
        return decode_dim_f32_bf16kv(q, k_buf, v_buf, kv_indices, seq_lens, seed_out, seed_lse, out, bs, max_len,
                                     heads, kv_heads, dim, scale, num_threads);
#endif
    return decode_rows_f32_bf16kv(q, k_buf, v_buf, kv_indices, seq_lens, seed_out, seed_lse, out, bs, max_len, heads,
                                  kv_heads, dim, scale, num_threads);
}

int EXPORT(decode_attention_bf16)(const uint16_t *q, const uint16_t *k_buf, const uint16_t *v_buf,
                                  const int32_t *kv_indices, const int64_t *seq_lens, const uint16_t *seed_out,
                                  const float *seed_lse, uint16_t *out, int64_t bs, int64_t max_len, int64_t heads,
                                  int64_t kv_heads, int64_t dim, float scale, int num_threads) {
    if (bad_shape(heads, kv_heads, dim)) return 1;
#ifdef HAVE_AVX512_BF16
    if (dim % 32 == 0)
        return decode_512_bf16dp(q, k_buf, v_buf, kv_indices, seq_lens, seed_out, seed_lse, out, bs, max_len, heads,
                                 kv_heads, dim, scale, num_threads);
#endif
#if SIMD_WIDTH == 16
    if (dim % 16 == 0)
        return decode_512_bf16w(q, k_buf, v_buf, kv_indices, seq_lens, seed_out, seed_lse, out, bs, max_len, heads,
                                kv_heads, dim, scale, num_threads);
#elif SIMD_WIDTH == 8
    if (dim % SIMD_WIDTH == 0)
        return decode_dim_bf16(q, k_buf, v_buf, kv_indices, seq_lens, seed_out, seed_lse, out, bs, max_len, heads,
                               kv_heads, dim, scale, num_threads);
#endif
    return decode_rows_bf16(q, k_buf, v_buf, kv_indices, seq_lens, seed_out, seed_lse, out, bs, max_len, heads,
                            kv_heads, dim, scale, num_threads);
}

/* The float32 lanes of this object's vector level (1: the portable loop only). */
int EXPORT(attention_simd_width)(void) {
#ifdef SIMD_WIDTH
    return SIMD_WIDTH;
#else
    return 1;
#endif
}
