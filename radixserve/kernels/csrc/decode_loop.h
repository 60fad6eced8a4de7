// The layer loop of the one-call decode step, written once for each element type that includes it:
// decode_step.c (bf16) and decode_step_f32.c (float32). The includer defines `elem_t` and, for rows of it,
//     rmsnorm_row(x, weight, out, n, eps)              out = RMSNorm(x)
//     add_rmsnorm_row(delta, residual, weight, out, n, eps)   residual += delta; out = RMSNorm(residual)
//     rotate_head(x, cos, sin, out, half)              the "rotate half" rotary of one head
//     silu_mul_row(gate_up, out, n)                    SiLU(gate) * up of one [gate | up] row
// and, for Gemma's layers (decode_gemma.h),
//     gemma_norm_row(x, weight1, out, n, eps)          out = x * rsqrt(mean(x^2) + eps) * weight1 (float32 1 + w)
//     add_row(delta, residual, n)                      residual += delta
//     gelu_mul_row(gate_up, out, n)                    gelu_tanh(gate) * up of one [gate | up] row
// then includes this file, which defines `decode_layers` and `decode_work_size` for it.
//
// Llama layers: [add +] RMSNorm -> qkv -> rotary (q to a buffer, k and v into the KV pool at the slots) ->
// attention -> o -> add + RMSNorm -> gate_up -> SiLU(gate) * up -> down. In: `hidden` the embeddings;
// out: `hidden` the last layer's MLP output and `residual` the stream it is added to (the caller applies
// the final norm). Returns 0; 1 for a position, slot or LoRA row outside the tables (nothing written); or
// 1000 * (layer + 1) + which call failed (its own status is lost): 1 qkv, 2 attention, 3 o, 4 gate_up, 5 down,
// 6 + LORA_* the LoRA delta of a linear layer (decode_lora.h: a batch's adapter rows, after each base product).
//
// Attention groups: the layers of one group share where they write the new K/V and what they attend over
// (slots, kv_indices, seq_lens, max_len). A model without sliding windows has one group; a window layer reads
// its window's group: each request's last min(seq_len, W) slots, and with a hybrid KV pool the window pool's
// slots (models/decode_step.py fills the groups from the attention backend's tables once per step).
// Cascade: where the batch shares a prefix (layers/attention/cascade.py), a group also names those prefix slots and
// the function of part (a) (`prefix_fn`), which attends every row over them first; its output and log-sum-exp seed
// the attention over each row's own slots (kv_indices then hold the positions past the prefix).

#ifndef RADIXSERVE_DECODE_LOOP_H
#define RADIXSERVE_DECODE_LOOP_H

#include <stdint.h>
#include <string.h>

// The linear layers and the attention are the kernels the Python path calls (their C functions are passed in,
// one per linear layer in the layer table); `weights` is the linear method's own form of the weight (a packed
// layout, or a small descriptor of one), opaque here.
typedef int (*linear_fn)(const void *weights, const elem_t *x, const elem_t *bias, elem_t *y, int64_t m, int64_t n,
                         int64_t k, int nthreads);
// k_buf / v_buf: the cache's element type (elem_t, or bf16 where decode_model.kv_bf16: the f32 build's
// decode_attention_f32_bf16kv)
typedef int (*attention_fn)(const elem_t *q, const void *k_buf, const void *v_buf, const int32_t *kv_indices,
                            const int64_t *seq_lens, const elem_t *seed_out, const float *seed_lse, elem_t *out,
                            int64_t bs, int64_t max_len, int64_t heads, int64_t kv_heads, int64_t dim, float scale,
                            int nthreads);
// cascade's part (a) (prefix_attention.c, extend_amx.c): every row over the same slots -> out and float32 lse
typedef int (*prefix_fn)(const elem_t *q, const void *k_buf, const void *v_buf, const int32_t *slots,
                         const int32_t *first, elem_t *out, float *lse, int64_t n, int64_t prefix_len, int64_t heads,
                         int64_t kv_heads, int64_t dim, float scale, int nthreads);

// The addresses of one layer's tensors and of its linear layers' functions, in this order (models/decode_step.py
// builds the table).
// COS/SIN: the layer's rotary tables [max_position][head_dim / 2] (Gemma 3's window layers have their own base).
// The last four are Gemma's (decode_gemma.h; 0 for a Llama layer): the per-head q/k norms and the norms after
// attention and after the MLP. A Gemma layer's IN_NORM / POST_NORM are its input and pre-MLP norms, and every
// Gemma norm weight is the float32 table 1 + w.
enum { IN_NORM, POST_NORM, QKV, QKV_FN, QKV_BIAS, O, O_FN, GATE_UP, GATE_UP_FN, DOWN, DOWN_FN, K_CACHE, V_CACHE,
       GROUP, COS, SIN, Q_NORM, K_NORM, POST_ATTN_NORM, POST_FF_NORM, LAYER_POINTERS };

enum { STYLE_LLAMA, STYLE_GEMMA }; // decode_model.style: which layer loop runs

typedef struct {
    const int32_t *slots;       // [bs] where the group's layers store the new K/V
    const int32_t *kv_indices;  // [bs * max_len] the slots each row attends over, row-major, padded
    const int64_t *seq_lens;    // [bs] the context each row attends to (<= max_len)
    int64_t max_len, num_slots; // num_slots: rows of the group's K/V buffers
    const int32_t *prefix_slots; // cascade: [prefix_len] slots every row attends over first; prefix_len 0: none
    int64_t prefix_len;
    const void *prefix;          // the prefix_fn of part (a), where prefix_len > 0
} attention_group;

#define LINEAR(w, WHICH) ((linear_fn)(w)[WHICH##_FN])

#include "decode_lora.h"

// The LoRA delta of linear layer WHICH of layer l (x its input, y its output [bs, N]); returns from the layer loop
// with the call's status where it fails.
#define ADD_LORA(WHICH, x, y, K, N)                                                                              \
    do {                                                                                                       \
        if (lora_add(lora, l, LORA_##WHICH, x, y, K, N, nthreads)) return status + 6 + LORA_##WHICH;           \
    } while (0)

typedef struct {
    int64_t num_layers, hidden, heads, kv_heads, head_dim, intermediate;
    int64_t max_position, num_groups; // rows of every rotary table; attention groups
    int64_t style;                    // STYLE_LLAMA or STYLE_GEMMA
    int64_t kv_bf16;                  // 1: the KV cache is bf16 under float32 elements (--kv-cache-dtype); else elem_t
    float eps, scale;
    const int64_t *layers; // [num_layers][LAYER_POINTERS]
} decode_model;

static void rotary_kv_row(const decode_model *m, const int64_t *layer, const elem_t *qkv, int64_t position,
                          int64_t slot, elem_t *q) {
    const int64_t dim = m->head_dim, half = dim / 2, kv = m->kv_heads;
    const float *cos = (const float *)layer[COS] + position * half, *sin = (const float *)layer[SIN] + position * half;
    for (int64_t h = 0; h < m->heads; h++) rotate_head(qkv + h * dim, cos, sin, q + h * dim, half);
#ifdef DECODE_KV_BF16
    if (m->kv_bf16) { // NOTE: rounded to nearest even, as torch's .to(bfloat16) of the Python path's write
        uint16_t *k_cache = (uint16_t *)layer[K_CACHE] + slot * kv * dim, *v_cache = (uint16_t *)layer[V_CACHE] + slot * kv * dim;
        elem_t k[MAX_DIM];
        for (int64_t h = 0; h < kv; h++) {
            rotate_head(qkv + (m->heads + h) * dim, cos, sin, k, half);
            for (int64_t d = 0; d < dim; d++) k_cache[h * dim + d] = f32_to_bf16(k[d]);
        }
        for (int64_t i = 0; i < kv * dim; i++) v_cache[i] = f32_to_bf16(qkv[(m->heads + kv) * dim + i]);
        return;
    }
#endif
    elem_t *k_cache = (elem_t *)layer[K_CACHE] + slot * kv * dim, *v_cache = (elem_t *)layer[V_CACHE] + slot * kv * dim;
    for (int64_t h = 0; h < kv; h++) rotate_head(qkv + (m->heads + h) * dim, cos, sin, k_cache + h * dim, half);
    memcpy(v_cache, qkv + (m->heads + kv) * dim, (size_t)(kv * dim) * sizeof(elem_t));
}

// 0 if every position, slot and layer group is inside its table (checked before anything is written), else 1.
static int check_inputs(const decode_model *m, const int64_t *positions, const attention_group *groups, int64_t bs) {
    for (int64_t r = 0; r < bs; r++)
        if (positions[r] < 0 || positions[r] >= m->max_position) return 1;
    for (int64_t g = 0; g < m->num_groups; g++) {
        for (int64_t r = 0; r < bs; r++)
            if (groups[g].slots[r] < 0 || groups[g].slots[r] >= groups[g].num_slots) return 1;
        if (groups[g].prefix_len > 0 && groups[g].prefix == NULL) return 1;
        for (int64_t i = 0; i < groups[g].prefix_len; i++)
            if (groups[g].prefix_slots[i] < 0 || groups[g].prefix_slots[i] >= groups[g].num_slots) return 1;
    }
    for (int64_t l = 0; l < m->num_layers; l++) {
        const int64_t group = m->layers[l * LAYER_POINTERS + GROUP];
        if (group < 0 || group >= m->num_groups) return 1;
    }
    return 0;
}

// The work buffer's parts, `bs` rows each (decode_work_size is their sum).
typedef struct {
    elem_t *normed, *qkv, *q, *attn, *gate_up, *act, *seed; // seed: cascade's part (a) output
    float *seed_lse;                                         // and its log-sum-exps [bs, heads]
} step_buffers;

static step_buffers split_work(const decode_model *m, elem_t *work, int64_t bs) {
    const int64_t q_size = m->heads * m->head_dim, qkv_size = q_size + 2 * m->kv_heads * m->head_dim;
    step_buffers b;
    b.normed = work;
    b.qkv = b.normed + bs * m->hidden;
    b.q = b.qkv + bs * qkv_size;
    b.attn = b.q + bs * q_size;
    b.gate_up = b.attn + bs * q_size;
    b.act = b.gate_up + bs * 2 * m->intermediate;
    b.seed = b.act + bs * m->intermediate;
    // NOTE: float-aligned past the seed (decode_work_size leaves 4 bytes for it)
    b.seed_lse = (float *)(((uintptr_t)(b.seed + bs * q_size) + 3) & ~(uintptr_t)3);
    return b;
}

// The layer's attention over its group's table, then o into `out`. Returns 0, or the failed call (2 or 3).
static int attend_and_project(const decode_model *m, attention_fn attention, const int64_t *w,
                              const attention_group *grp, const step_buffers *b, elem_t *out, int64_t bs,
                              int nthreads) {
    const int64_t q_size = m->heads * m->head_dim;
    const void *k_cache = (const void *)w[K_CACHE], *v_cache = (const void *)w[V_CACHE];
    const elem_t *seed = NULL;
    const float *seed_lse = NULL;
    if (grp->prefix_len > 0) { // cascade: part (a) over the shared prefix seeds the rows' own slots (part (b))
        if (((prefix_fn)grp->prefix)(b->q, k_cache, v_cache, grp->prefix_slots, NULL, b->seed, b->seed_lse, bs,
                                     grp->prefix_len, m->heads, m->kv_heads, m->head_dim, m->scale, nthreads))
            return 2;
        seed = b->seed, seed_lse = b->seed_lse;
    }
    if (attention(b->q, k_cache, v_cache, grp->kv_indices, grp->seq_lens, seed, seed_lse, b->attn, bs, grp->max_len,
                  m->heads, m->kv_heads, m->head_dim, m->scale, nthreads))
        return 2;
    return LINEAR(w, O)((const void *)w[O], b->attn, NULL, out, bs, m->hidden, q_size, nthreads) ? 3 : 0;
}

static int llama_layers(const decode_model *m, attention_fn attention, const decode_lora *lora, elem_t *hidden,
                        elem_t *residual, const int64_t *positions, const attention_group *groups, int64_t bs,
                        elem_t *work, int nthreads) {
    const int64_t h = m->hidden, q_size = m->heads * m->head_dim, qkv_size = q_size + 2 * m->kv_heads * m->head_dim;
    const int64_t inter = m->intermediate;
    const step_buffers b = split_work(m, work, bs);
    const int parallel = bs > 1 && nthreads > 1;
    for (int64_t l = 0; l < m->num_layers; l++) {
        const int64_t *w = m->layers + l * LAYER_POINTERS;
        // NOTE: every layer of a group writes at the group's slots and attends over its table
        const attention_group *grp = groups + w[GROUP];
        const int status = 1000 * (int)(l + 1);
#pragma omp parallel for num_threads(nthreads) if (parallel)
        for (int64_t r = 0; r < bs; r++) {
            if (l == 0) {
                memcpy(residual + r * h, hidden + r * h, (size_t)h * sizeof(elem_t));
                rmsnorm_row(hidden + r * h, (const elem_t *)w[IN_NORM], b.normed + r * h, h, m->eps);
            } else {
                add_rmsnorm_row(hidden + r * h, residual + r * h, (const elem_t *)w[IN_NORM], b.normed + r * h, h,
                                m->eps);
            }
        }
        if (LINEAR(w, QKV)((const void *)w[QKV], b.normed, (const elem_t *)w[QKV_BIAS], b.qkv, bs, qkv_size, h,
                           nthreads))
            return status + 1;
        ADD_LORA(QKV, b.normed, b.qkv, h, qkv_size);
#pragma omp parallel for num_threads(nthreads) if (parallel)
        for (int64_t r = 0; r < bs; r++)
            rotary_kv_row(m, w, b.qkv + r * qkv_size, positions[r], grp->slots[r], b.q + r * q_size);
        const int failed = attend_and_project(m, attention, w, grp, &b, hidden, bs, nthreads);
        if (failed) return status + failed;
        ADD_LORA(O, b.attn, hidden, q_size, h);
#pragma omp parallel for num_threads(nthreads) if (parallel)
        for (int64_t r = 0; r < bs; r++)
            add_rmsnorm_row(hidden + r * h, residual + r * h, (const elem_t *)w[POST_NORM], b.normed + r * h, h, m->eps);
        if (LINEAR(w, GATE_UP)((const void *)w[GATE_UP], b.normed, NULL, b.gate_up, bs, 2 * inter, h, nthreads))
            return status + 4;
        ADD_LORA(GATE_UP, b.normed, b.gate_up, h, 2 * inter);
#pragma omp parallel for num_threads(nthreads) if (parallel)
        for (int64_t r = 0; r < bs; r++) silu_mul_row(b.gate_up + r * 2 * inter, b.act + r * inter, inter);
        if (LINEAR(w, DOWN)((const void *)w[DOWN], b.act, NULL, hidden, bs, h, inter, nthreads)) return status + 5;
        ADD_LORA(DOWN, b.act, hidden, inter, h);
    }
    return 0;
}

#include "decode_gemma.h"

// `lora`: the step's LoRA rows (decode_lora.h), or NULL for a batch of the base model alone.
static int decode_layers(const decode_model *m, attention_fn attention, const decode_lora *lora, elem_t *hidden,
                         elem_t *residual, const int64_t *positions, const attention_group *groups, int64_t bs,
                         elem_t *work, int nthreads) {
    if (check_inputs(m, positions, groups, bs) || check_lora(lora, bs)) return 1;
    if (m->style == STYLE_GEMMA)
        return gemma_layers(m, attention, lora, hidden, residual, positions, groups, bs, work, nthreads);
    return llama_layers(m, attention, lora, hidden, residual, positions, groups, bs, work, nthreads);
}

// Elements of the work buffer `decode_layers` needs for `bs` rows.
static int64_t decode_work_size(const decode_model *m, int64_t bs) {
    const int64_t q_size = m->heads * m->head_dim;
    const int64_t lse_elems = (int64_t)((m->heads * sizeof(float) + sizeof(elem_t) - 1) / sizeof(elem_t));
    return bs * (m->hidden + q_size + 2 * m->kv_heads * m->head_dim + 3 * q_size + 3 * m->intermediate + lse_elems) +
           (int64_t)(4 / sizeof(elem_t)) + 1;
}

#endif
