"""Sliding-window attention: the index tables and masks of a window layer, and its extend attention.

A layer with window W lets the query at position p see keys p - W + 1 .. p (transformers' rule: W keys,
itself included). The window is a per-layer property (`RadixAttention.sliding_window`); the backend builds
these tables once per forward for each distinct window of the model (`AttentionPlan.windows`), and only for
batches where some request is longer than its window: otherwise the window hides nothing and a window layer
runs exactly the full layers' path (cascade and the C kernels included).

Decode: each request's last min(seq_len, W) slots, gathered into a padded [bs, width] table, are the whole
context: the C decode kernel and the torch decode paths take that table and those lengths unchanged, so both
have the window without knowing about it.
Extend: each request's query i sees the context positions max(0, p_i - W + 1) .. p_i; the keys before the
first query's window are never gathered. Where the backend plans the C extend kernel it takes those slots (one
`reqs` row per request) and W, and skips what no query sees; otherwise the rest is a banded mask (causal and
within W) given to torch's SDPA.
Cascade (window_cascade.py): where a batch shares a prefix that its windows still see, a window layer splits it
off as full layers do; its part (b) is these same tables cut at the shared prefix's end (`floor`).
Hybrid KV (mem_cache/swa_memory.py): window layers keep K/V in their own smaller pool, so every table gathered
here is translated from full slots to window slots (`full_to_window`), and window layers always take these
tables, window or not.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from radixserve.layers.attention.base import gather_kv

if TYPE_CHECKING:
    from radixserve.forward_batch import ForwardBatch


@dataclass
class WindowDecodeMetadata:
    kv_indices: torch.Tensor  # [bs * width] slots of each request's last min(seq_len, W) positions, padded
    lens: torch.Tensor  # int64 [bs], min(seq_len, W): the context each row attends to
    max_len: int  # width
    mask: torch.Tensor | None  # additive float32 [bs, width]; None when every row is full


@dataclass
class WindowSlice:
    q_start: int
    q_len: int
    kv_start: int  # into the gathered contexts
    kv_len: int  # positions first .. seq_len - 1 of the request
    first: int  # the first context position gathered: max(floor, prefix_len - W + 1)
    prefix_len: int
    window: int
    _mask: torch.Tensor | None = field(default=None, repr=False)

    def mask(self, device: torch.device) -> torch.Tensor:
        """bool [q_len, kv_len]: query i (position prefix_len + i) sees the keys within its window."""
        if self._mask is None:
            q_pos = torch.arange(self.prefix_len, self.prefix_len + self.q_len, device=device).unsqueeze(1)
            k_pos = torch.arange(self.first, self.first + self.kv_len, device=device).unsqueeze(0)
            self._mask = (k_pos <= q_pos) & (k_pos > q_pos - self.window)
        return self._mask


@dataclass
class WindowExtendMetadata:
    slices: list[WindowSlice]
    kv_indices: torch.Tensor  # the gathered context slots of every request, concatenated
    reqs: torch.Tensor  # for the C extend kernel: int64 [bs, 4] rows (q_start, q_len, kv_start, kv_len)


def window_applies(fb: ForwardBatch, window: int) -> bool:
    """Whether a window of `window` tokens hides any key in this batch (some request is longer than it)."""
    return max(fb.seq_lens_cpu) > window


def decode_metadata(fb: ForwardBatch, window: int, translate: torch.Tensor | None = None,
                    floor: int = 0) -> WindowDecodeMetadata:
    """`translate`: the hybrid pool's full_to_window table (the gathered slots are window slots then).
    `floor`: no position before it is gathered (cascade's part (b): the shared prefix's end; below every seq_len)."""
    lens_cpu = fb.seq_lens_cpu
    table = fb.req_to_token_pool.req_to_token
    max_len = max(lens_cpu)
    width = min(window, max_len - floor)
    starts = (fb.seq_lens - window).clamp(min=floor)
    lens = fb.seq_lens - starts
    cols = (starts.unsqueeze(1) + torch.arange(width, device=table.device)).clamp(max=max_len - 1)
    # NOTE: gathered here, once per forward: the table may change once init_forward_metadata returns
    kv_indices = table[fb.req_pool_indices, :max_len].gather(1, cols).reshape(-1)
    if translate is not None:
        kv_indices = translate[kv_indices.long()]
    mask = None
    if min(min(n - floor, window) for n in lens_cpu) != width:
        beyond = torch.arange(width, device=table.device).unsqueeze(0) >= lens.unsqueeze(1)
        mask = torch.zeros(beyond.shape, dtype=torch.float32, device=table.device).masked_fill_(beyond, float("-inf"))
    return WindowDecodeMetadata(kv_indices, lens, width, mask)


def extend_metadata(fb: ForwardBatch, window: int, translate: torch.Tensor | None = None,
                    floor: int = 0) -> WindowExtendMetadata:
    """`translate` as for decode_metadata; `floor`: no position before it is gathered (at most every cached prefix)."""
    table = fb.req_to_token_pool.req_to_token
    rows = fb.req_pool_indices.tolist()
    slices, parts, q_start, kv_start = [], [], 0, 0
    for row, prefix, new in zip(rows, fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu, strict=True):
        first = max(floor, prefix - window + 1)  # NOTE: no query of this request sees a key before it
        kv_len = prefix + new - first
        slices.append(WindowSlice(q_start, new, kv_start, kv_len, first, prefix, window))
        parts.append(table[row, first : prefix + new])
        q_start, kv_start = q_start + new, kv_start + kv_len
    kv_indices = torch.cat(parts)
    if translate is not None:
        kv_indices = translate[kv_indices.long()]
    reqs = torch.tensor([(s.q_start, s.q_len, s.kv_start, s.kv_len) for s in slices], dtype=torch.int64)
    return WindowExtendMetadata(slices, kv_indices, reqs)


def extend_attention(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, meta: WindowExtendMetadata,
                     scaling: float) -> torch.Tensor:
    """q [tokens, heads, dim] (new K/V already in the pool) -> [tokens, heads, dim], banded per request."""
    keys, values = gather_kv(k_all, meta.kv_indices, q.dtype), gather_kv(v_all, meta.kv_indices, q.dtype)
    out = torch.empty_like(q)
    for s in meta.slices:
        qs, ks = slice(s.q_start, s.q_start + s.q_len), slice(s.kv_start, s.kv_start + s.kv_len)
        out[qs] = F.scaled_dot_product_attention(
            q[qs].transpose(0, 1).unsqueeze(0), keys[ks].transpose(0, 1).unsqueeze(0),
            values[ks].transpose(0, 1).unsqueeze(0), attn_mask=s.mask(q.device), scale=scaling,
            enable_gqa=q.shape[1] != keys.shape[1]).squeeze(0).transpose(0, 1)
    return out
