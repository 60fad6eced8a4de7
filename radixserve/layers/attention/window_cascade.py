"""Cascade attention for window layers: the batch's shared prefix, cut to what its windows still see.

A layer with window W lets the query at position p see the keys at positions p - W + 1 .. p. The batch shares
its first P slots (positions 0 .. P - 1; every query sits at a position >= P), and cascade splits each request's
attention at P as for full layers (cascade.py), with both sides cut to the window:

(a) the shared positions [a, P), where a is the smallest first-visible position of any query of the batch:
    decode, min_i max(0, L_i - W) (the new token of request i is at L_i - 1); extend, min_i max(0, prefix_i -
    W + 1) (a request's first new token is at prefix_i and sees the furthest back). Shared keys before a are no
    query's and are never read: with the hybrid KV pool their window KV may be freed already. Within [a, P)
    each query token has its own lower bound: the query at p sees the shared key t only if t > p - W, so
    `prefix_first` = clamp(p - W + 1 - a, 0, P - a) is an index into the part's slots. A query whose window
    starts at or past P sees none (prefix_first = P - a): its part (a) is empty (out 0, lse -inf), and merging
    an empty part (torch's merge_partials, or the decode and extend kernels seeded with it) leaves part (b)
    exactly;
(b) each request's own positions from max(P, its first-visible position) on: decode, the last min(W, L_i - P)
    slots (window.decode_metadata with floor P), which the decode kernel and the padded torch batch take as the
    whole suffix; extend, window.extend_metadata with floor P, whose `reqs` give the C extend kernel, run with
    `window=W`, the right rule as is: request i's context starts at position s_i, its query j is at
    prefix_i + j = s_i + (kv_len - q_len) + j, so the kernel's shifted diagonal (context index shift + j, shift
    = kv_len - q_len) is the causal limit and its window cut (context index shift + j - W + 1) is the position
    prefix_i + j - W + 1. The torch path takes the same slices with their banded masks. Part (b) is never empty:
    each query sees itself.

Whether a window takes cascade is `CascadePolicy.takes` on the shared keys its part (a) reads, P - a, not P: a
long prefix that has slid out of every window does not turn cascade on for nothing. Full layers keep deciding
on P. With the hybrid pool every slot here (part (a)'s and part (b)'s) is translated to a window slot.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from radixserve.configs.row_table import CascadePolicy
from radixserve.layers.attention import cascade, window

if TYPE_CHECKING:
    from radixserve.forward_batch import ForwardBatch


def first_visible(fb: ForwardBatch, window_size: int) -> list[int]:
    """Per request, the first position its earliest query sees (decode: its new token; extend: its first one)."""
    if fb.forward_mode.is_decode():
        return [max(0, n - window_size) for n in fb.seq_lens_cpu]
    return [max(0, p - window_size + 1) for p in fb.extend_prefix_lens_cpu]


def plan_decode(fb: ForwardBatch, window_size: int, prefix_len: int, policy: CascadePolicy,
                translate: torch.Tensor | None = None) -> cascade.CascadeDecodeMetadata | None:
    """A window's decode cascade over the batch's shared `prefix_len` (cascade.batch_prefix_len), or None."""
    start = min(first_visible(fb, window_size))
    if prefix_len <= start or not policy.takes(True, fb.batch_size, prefix_len - start):
        return None
    suffix = window.decode_metadata(fb, window_size, translate, floor=prefix_len)
    positions = torch.tensor(fb.seq_lens_cpu, dtype=torch.int64) - 1
    mask = None if suffix.mask is None else suffix.mask.isinf()
    return cascade.CascadeDecodeMetadata(_slots(fb, start, prefix_len, translate), suffix.kv_indices, suffix.lens,
                                         suffix.max_len, mask, _first(fb, positions, window_size, start, prefix_len))


def plan_extend(fb: ForwardBatch, window_size: int, prefix_len: int, policy: CascadePolicy,
                translate: torch.Tensor | None = None) -> cascade.CascadeExtendMetadata | None:
    """A window's extend cascade over the batch's shared `prefix_len`, or None."""
    start = min(first_visible(fb, window_size))
    if prefix_len <= start or not policy.takes(False, fb.batch_size, prefix_len - start):
        return None
    suffix = window.extend_metadata(fb, window_size, translate, floor=prefix_len)
    device = fb.req_to_token_pool.req_to_token.device
    slices = [cascade.SuffixSlice(s.q_start, s.q_len, s.kv_start, s.kv_len, s.mask(device)) for s in suffix.slices]
    lens = torch.tensor(fb.extend_seq_lens_cpu, dtype=torch.int64)
    starts = torch.tensor(cascade.offsets(fb.extend_seq_lens_cpu), dtype=torch.int64)
    positions = (torch.arange(int(lens.sum())) + torch.repeat_interleave(
        torch.tensor(fb.extend_prefix_lens_cpu, dtype=torch.int64) - starts, lens))  # prefix_i + j
    return cascade.CascadeExtendMetadata(_slots(fb, start, prefix_len, translate), slices, suffix.kv_indices,
                                         suffix.reqs, _first(fb, positions, window_size, start, prefix_len),
                                         window_size)


def _first(fb: ForwardBatch, positions: torch.Tensor, window_size: int, start: int,
           prefix_len: int) -> torch.Tensor | None:
    """int32 [num_tokens]: for the query token at each position, the index into part (a)'s slots (positions
    start .. prefix_len) of the first one it sees, prefix_len - start where it sees none; None where all see all."""
    first = (positions - window_size + 1 - start).clamp(min=0, max=prefix_len - start)
    if int(first.max()) == 0:  # NOTE: built on the CPU, no sync; None keeps the C prefix kernel unmasked
        return None
    return first.to(torch.int32).to(fb.req_to_token_pool.req_to_token.device)


def _slots(fb: ForwardBatch, start: int, prefix_len: int, translate: torch.Tensor | None) -> torch.Tensor:
    slots = cascade.prefix_slots(fb, start, prefix_len)
    return slots if translate is None else translate[slots.long()]
