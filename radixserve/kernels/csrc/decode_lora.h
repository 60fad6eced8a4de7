// LoRA rows inside the one-call decode step (included by decode_loop.h, for each element type).
//
// A decode batch may mix rows of the base model with rows of several LoRA adapters. After each linear layer
// (qkv, o, gate_up, down) the step adds the adapters' deltas with the same SGMV function the Python layers call
// (lora_sgmv.c, through lora/layers.py): its address comes in the step's LoRA descriptor, with the step's
// segments (which rows use which adapter: one int64 row index, segment s at positions offsets[s] ..
// offsets[s + 1]), made once per step, and a table of each (layer, linear layer, segment)'s packed A and Bt and
// its rank (0: the segment's adapter does not target that linear layer). A NULL descriptor: no LoRA rows.
// models/decode_step_lora.py fills it.

#ifndef RADIXSERVE_DECODE_LORA_H
#define RADIXSERVE_DECODE_LORA_H

// lora_sgmv (csrc/lora_sgmv.c): y[rows of segment s] += (x[those rows] @ A_s^T) @ Bt_s, in place.
typedef int (*lora_sgmv_fn)(const void *x, void *y, int64_t k, int64_t n, int bf16, const int64_t *index,
                            const int64_t *offsets, int64_t num_segments, const void *const *a,
                            const void *const *bt, const int64_t *ranks, int nthreads);

enum { LORA_QKV, LORA_O, LORA_GATE_UP, LORA_DOWN, LORA_LINEARS };

typedef struct {
    lora_sgmv_fn sgmv;
    const int64_t *index;   // [offsets[num_segments]] the rows of every segment (rows of the batch)
    const int64_t *offsets; // [num_segments + 1]
    int64_t num_segments;
    // [num_layers][LORA_LINEARS][3][num_segments]: per (layer, linear layer) the segments' A addresses, then
    // their Bt addresses, then their ranks
    const int64_t *table;
} decode_lora;

// 0 if the segments are well formed (offsets rising from 0, every row inside the batch), else 1; checked before
// anything is written.
static int check_lora(const decode_lora *lora, int64_t bs) {
    if (lora == NULL) return 0;
    if (lora->sgmv == NULL || lora->num_segments < 0 || lora->offsets[0] != 0) return 1;
    for (int64_t s = 0; s < lora->num_segments; s++)
        if (lora->offsets[s + 1] < lora->offsets[s]) return 1;
    for (int64_t i = 0; i < lora->offsets[lora->num_segments]; i++)
        if (lora->index[i] < 0 || lora->index[i] >= bs) return 1;
    return 0;
}

// y [bs, n] += the LoRA deltas of its adapter rows for linear layer `which` of `layer`, x [bs, k] its input.
// Returns 0, or 1 where the SGMV call failed. NOTE: called right after the base product, on the same x and y
// the Python layers hand to the kernel (LinearBase.forward: the base product, then LoraLinear.add_to).
static int lora_add(const decode_lora *lora, int64_t layer, int which, const elem_t *x, elem_t *y, int64_t k,
                    int64_t n, int nthreads) {
    if (lora == NULL || lora->num_segments == 0) return 0;
    const int64_t s = lora->num_segments;
    const int64_t *t = lora->table + (layer * LORA_LINEARS + which) * 3 * s;
    // NOTE: the table's int64 addresses read as pointers (x86-64: both 8 bytes)
    return lora->sgmv(x, y, k, n, sizeof(elem_t) == 2, lora->index, lora->offsets, s, (const void *const *)t,
                      (const void *const *)(t + s), t + 2 * s, nthreads) != 0;
}

#endif
