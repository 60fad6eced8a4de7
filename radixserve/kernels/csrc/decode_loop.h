// The layer loop of the one-call decode step, written once for each element type that includes it:
// decode_step.c (bf16) and decode_step_f32.c (float32). The includer defines `elem_t` and, for rows of it,
//     rmsnorm_row(x, weight, out, n, eps)              out = RMSNorm(x)
//     add_rmsnorm_row(delta, residual, weight, out, n, eps)   residual += delta; out = RMSNorm(residual)
//     rotate_head(x, cos, sin, out, half)              the "rotate half" rotary of one head
//     silu_mul_row(gate_up, out, n)                    SiLU(gate) * up of one [gate | up] row
// then includes this file, which defines `decode_layers` and `decode_work_size` for it.
//
// Per layer: [add +] RMSNorm -> qkv -> rotary (q to a buffer, k and v into the KV pool at the slots) ->
// attention -> o -> add + RMSNorm -> gate_up -> SiLU(gate) * up -> down. In: `hidden` the embeddings;
// out: `hidden` the last layer's MLP output and `residual` the stream it is added to (the caller applies
// the final norm). Returns 0; 1 for a position or slot outside the tables (nothing written); or
// 1000 * (layer + 1) + which call failed (its own status is lost).
//
// Attention groups: the layers of one group share where they write the new K/V and what they attend over
// (slots, kv_indices, seq_lens, max_len). A model without sliding windows has one group; a window layer reads
// its window's group: each request's last min(seq_len, W) slots, and with a hybrid KV pool the window pool's
// slots (models/decode_step.py fills the groups from the attention backend's tables once per step).

#ifndef RADIXSERVE_DECODE_LOOP_H
#define RADIXSERVE_DECODE_LOOP_H

#include <stdint.h>
#include <string.h>

// The linear layers and the attention are the kernels the Python path calls (their C functions are passed in,
// one per linear layer in the layer table); `weights` is the linear method's own form of the weight (a packed
// layout, or a small descriptor of one), opaque here.
typedef int (*linear_fn)(const void *weights, const elem_t *x, const elem_t *bias, elem_t *y, int64_t m, int64_t n,
                         int64_t k, int nthreads);
typedef int (*attention_fn)(const elem_t *q, const elem_t *k_buf, const elem_t *v_buf, const int32_t *kv_indices,
                            const int64_t *seq_lens, const elem_t *seed_out, const float *seed_lse, elem_t *out,
                            int64_t bs, int64_t max_len, int64_t heads, int64_t kv_heads, int64_t dim, float scale,
                            int nthreads);

// The addresses of one layer's tensors and of its linear layers' functions, in this order (models/decode_step.py
// builds the table).
enum { IN_NORM, POST_NORM, QKV, QKV_FN, QKV_BIAS, O, O_FN, GATE_UP, GATE_UP_FN, DOWN, DOWN_FN, K_CACHE, V_CACHE,
       GROUP, LAYER_POINTERS };

typedef struct {
    const int32_t *slots;       // [bs] where the group's layers store the new K/V
    const int32_t *kv_indices;  // [bs * max_len] the slots each row attends over, row-major, padded
    const int64_t *seq_lens;    // [bs] the context each row attends to (<= max_len)
    int64_t max_len, num_slots; // num_slots: rows of the group's K/V buffers
} attention_group;

#define LINEAR(w, WHICH) ((linear_fn)(w)[WHICH##_FN])

typedef struct {
    int64_t num_layers, hidden, heads, kv_heads, head_dim, intermediate;
    int64_t max_position, num_groups; // rows of the cos/sin tables; attention groups
    float eps, scale;
    const int64_t *layers; // [num_layers][LAYER_POINTERS]
    const float *cos_table, *sin_table; // [positions][head_dim / 2]
} decode_model;

static void rotary_kv_row(const decode_model *m, const int64_t *layer, const elem_t *qkv, int64_t position,
                          int64_t slot, elem_t *q) {
    const int64_t dim = m->head_dim, half = dim / 2, kv = m->kv_heads;
    const float *cos = m->cos_table + position * half, *sin = m->sin_table + position * half;
    elem_t *k_cache = (elem_t *)layer[K_CACHE] + slot * kv * dim, *v_cache = (elem_t *)layer[V_CACHE] + slot * kv * dim;
    for (int64_t h = 0; h < m->heads; h++) rotate_head(qkv + h * dim, cos, sin, q + h * dim, half);
    for (int64_t h = 0; h < kv; h++) rotate_head(qkv + (m->heads + h) * dim, cos, sin, k_cache + h * dim, half);
    memcpy(v_cache, qkv + (m->heads + kv) * dim, (size_t)(kv * dim) * sizeof(elem_t));
}

static int decode_layers(const decode_model *m, attention_fn attention, elem_t *hidden,
                         elem_t *residual, const int64_t *positions, const attention_group *groups, int64_t bs,
                         elem_t *work, int nthreads) {
    const int64_t h = m->hidden, q_size = m->heads * m->head_dim, qkv_size = q_size + 2 * m->kv_heads * m->head_dim;
    const int64_t inter = m->intermediate;
    elem_t *normed = work, *qkv = normed + bs * h, *q = qkv + bs * qkv_size, *attn = q + bs * q_size;
    elem_t *gate_up = attn + bs * q_size, *act = gate_up + bs * 2 * inter;
    const int parallel = bs > 1 && nthreads > 1;
    for (int64_t r = 0; r < bs; r++)
        if (positions[r] < 0 || positions[r] >= m->max_position) return 1;
    for (int64_t g = 0; g < m->num_groups; g++)
        for (int64_t r = 0; r < bs; r++)
            if (groups[g].slots[r] < 0 || groups[g].slots[r] >= groups[g].num_slots) return 1;
    for (int64_t l = 0; l < m->num_layers; l++) {
        const int64_t *w = m->layers + l * LAYER_POINTERS;
        if (w[GROUP] < 0 || w[GROUP] >= m->num_groups) return 1;
        // NOTE: every layer of a group writes at the group's slots and attends over its table
        const attention_group *grp = groups + w[GROUP];
        const int status = 1000 * (int)(l + 1);
#pragma omp parallel for num_threads(nthreads) if (parallel)
        for (int64_t r = 0; r < bs; r++) {
            if (l == 0) {
                memcpy(residual + r * h, hidden + r * h, (size_t)h * sizeof(elem_t));
                rmsnorm_row(hidden + r * h, (const elem_t *)w[IN_NORM], normed + r * h, h, m->eps);
            } else {
                add_rmsnorm_row(hidden + r * h, residual + r * h, (const elem_t *)w[IN_NORM], normed + r * h, h, m->eps);
            }
        }
        if (LINEAR(w, QKV)((const void *)w[QKV], normed, (const elem_t *)w[QKV_BIAS], qkv, bs, qkv_size, h, nthreads))
            return status + 1;
#pragma omp parallel for num_threads(nthreads) if (parallel)
        for (int64_t r = 0; r < bs; r++)
            rotary_kv_row(m, w, qkv + r * qkv_size, positions[r], grp->slots[r], q + r * q_size);
        if (attention(q, (const elem_t *)w[K_CACHE], (const elem_t *)w[V_CACHE], grp->kv_indices, grp->seq_lens,
                      NULL, NULL, attn, bs, grp->max_len, m->heads, m->kv_heads, m->head_dim, m->scale, nthreads))
            return status + 2;
        if (LINEAR(w, O)((const void *)w[O], attn, NULL, hidden, bs, h, q_size, nthreads)) return status + 3;
#pragma omp parallel for num_threads(nthreads) if (parallel)
        for (int64_t r = 0; r < bs; r++)
            add_rmsnorm_row(hidden + r * h, residual + r * h, (const elem_t *)w[POST_NORM], normed + r * h, h, m->eps);
        if (LINEAR(w, GATE_UP)((const void *)w[GATE_UP], normed, NULL, gate_up, bs, 2 * inter, h, nthreads)) return status + 4;
#pragma omp parallel for num_threads(nthreads) if (parallel)
        for (int64_t r = 0; r < bs; r++) silu_mul_row(gate_up + r * 2 * inter, act + r * inter, inter);
        if (LINEAR(w, DOWN)((const void *)w[DOWN], act, NULL, hidden, bs, h, inter, nthreads)) return status + 5;
    }
    return 0;
}

// Elements of the work buffer `decode_layers` needs for `bs` rows.
static int64_t decode_work_size(const decode_model *m, int64_t bs) {
    const int64_t q_size = m->heads * m->head_dim;
    return bs * (m->hidden + q_size + 2 * m->kv_heads * m->head_dim + 2 * q_size + 3 * m->intermediate);
}

#endif
