// The Gemma 3 layer loop of the one-call decode step (included by decode_loop.h, for each element type).
//
// Per layer: RMSNorm -> qkv -> per-head q/k RMSNorm -> rotary (the layer's own tables: window layers have
// another base) -> attention over the layer's group (window or full) -> o -> RMSNorm (post-attention) ->
// residual += it -> RMSNorm (pre-MLP) -> gate_up -> gelu_tanh(gate) * up -> down -> RMSNorm (post-MLP) ->
// residual += it. Every Gemma norm scales by 1 + w (the float32 tables in the layer row), normalising and
// scaling in float32 with one rounding, as models/gemma3.py's GemmaRMSNorm.
// In: `hidden` the scaled embeddings. Out: `residual` the stream after the last layer (the caller applies the
// final norm to it); `hidden` is scratch. Statuses as decode_loop.h's; LoRA rows add their deltas after each
// linear layer as in the Llama loop (decode_lora.h).

#ifndef RADIXSERVE_DECODE_GEMMA_H
#define RADIXSERVE_DECODE_GEMMA_H

// q and k: per-head norms, then the rotary (q to its buffer, k into the KV pool at `slot`); v copied.
static void gemma_qk_row(const decode_model *m, const int64_t *layer, elem_t *qkv, int64_t position, int64_t slot,
                         elem_t *q) {
    const int64_t dim = m->head_dim, kv = m->kv_heads;
    if (layer[Q_NORM]) // NOTE: Gemma 2 has no q/k norms
        for (int64_t h = 0; h < m->heads; h++)
            gemma_norm_row(qkv + h * dim, (const float *)layer[Q_NORM], qkv + h * dim, dim, m->eps);
    if (layer[K_NORM])
        for (int64_t h = 0; h < kv; h++)
            gemma_norm_row(qkv + (m->heads + h) * dim, (const float *)layer[K_NORM], qkv + (m->heads + h) * dim, dim,
                           m->eps);
    rotary_kv_row(m, layer, qkv, position, slot, q);
}

static int gemma_layers(const decode_model *m, attention_fn attention, const decode_lora *lora, elem_t *hidden,
                        elem_t *residual, const int64_t *positions, const attention_group *groups, int64_t bs,
                        elem_t *work, int nthreads) {
    const int64_t h = m->hidden, q_size = m->heads * m->head_dim, qkv_size = q_size + 2 * m->kv_heads * m->head_dim;
    const int64_t inter = m->intermediate;
    const step_buffers b = split_work(m, work, bs);
    const int parallel = bs > 1 && nthreads > 1;
    memcpy(residual, hidden, (size_t)(bs * h) * sizeof(elem_t));
    for (int64_t l = 0; l < m->num_layers; l++) {
        const int64_t *w = m->layers + l * LAYER_POINTERS;
        const attention_group *grp = groups + w[GROUP];
        const int status = 1000 * (int)(l + 1);
#pragma omp parallel for num_threads(nthreads) if (parallel)
        for (int64_t r = 0; r < bs; r++)
            gemma_norm_row(residual + r * h, (const float *)w[IN_NORM], b.normed + r * h, h, m->eps);
        if (LINEAR(w, QKV)((const void *)w[QKV], b.normed, (const elem_t *)w[QKV_BIAS], b.qkv, bs, qkv_size, h,
                           nthreads))
            return status + 1;
        ADD_LORA(QKV, b.normed, b.qkv, h, qkv_size);
#pragma omp parallel for num_threads(nthreads) if (parallel)
        for (int64_t r = 0; r < bs; r++)
            gemma_qk_row(m, w, b.qkv + r * qkv_size, positions[r], grp->slots[r], b.q + r * q_size);
        const int failed = attend_and_project(m, attention, w, grp, &b, hidden, bs, nthreads);
        if (failed) return status + failed;
        ADD_LORA(O, b.attn, hidden, q_size, h);
#pragma omp parallel for num_threads(nthreads) if (parallel)
        for (int64_t r = 0; r < bs; r++) {
            // NOTE: normalised in place, then added: the post-norm's rounding comes before the add's, as in Python
            gemma_norm_row(hidden + r * h, (const float *)w[POST_ATTN_NORM], hidden + r * h, h, m->eps);
            add_row(hidden + r * h, residual + r * h, h);
            gemma_norm_row(residual + r * h, (const float *)w[POST_NORM], b.normed + r * h, h, m->eps);
        }
        if (LINEAR(w, GATE_UP)((const void *)w[GATE_UP], b.normed, NULL, b.gate_up, bs, 2 * inter, h, nthreads))
            return status + 4;
        ADD_LORA(GATE_UP, b.normed, b.gate_up, h, 2 * inter);
#pragma omp parallel for num_threads(nthreads) if (parallel)
        for (int64_t r = 0; r < bs; r++) gelu_mul_row(b.gate_up + r * 2 * inter, b.act + r * inter, inter);
        if (LINEAR(w, DOWN)((const void *)w[DOWN], b.act, NULL, hidden, bs, h, inter, nthreads)) return status + 5;
        ADD_LORA(DOWN, b.act, hidden, inter, h);
#pragma omp parallel for num_threads(nthreads) if (parallel)
        for (int64_t r = 0; r < bs; r++) {
            gemma_norm_row(hidden + r * h, (const float *)w[POST_FF_NORM], hidden + r * h, h, m->eps);
            add_row(hidden + r * h, residual + r * h, h);
        }
    }
    return 0;
}

#endif
