"""Attention with logit soft-capping (Gemma 2), in torch math: the scores of a layer with `logit_cap` c become
c * tanh(s / c) (s = q.k * scaling) before the mask and the softmax.

No other path can do this: the C decode and extend kernels, AMX extend, torch's SDPA and cascade's merged
prefix/suffix all fuse the scores into the softmax. So the backend routes every capped layer here, before any of
them (`takes`, the one routing decision, read at the top of TorchAttnBackend.forward_decode / forward_extend),
and the execution plan turns cascade off for a model with capped layers.

The scores are computed as the other torch paths do (the product in q's dtype), then scaled, capped, masked and
normalised in float32; the probabilities are rounded to q's dtype for the product with V (transformers' eager
attention does the same). The index tables are the backend's, so the window and the hybrid KV pool work as for
uncapped layers:
- decode: over the gathered slots of each request, padded rows masked (`DecodeMetadata`), or over its window's
  slots when the layer's window hides keys or the pool is hybrid (`window.WindowDecodeMetadata`, translated to
  window slots);
- extend: per request, causal with the diagonal shifted by the cached prefix (`ExtendSlice`), or banded
  (`window.WindowSlice`). Queries go in blocks so that a block's float32 scores stay under SCORE_BLOCK_ELEMENTS.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from radixserve.layers.attention import window
from radixserve.layers.attention.base import as_cached, gather_kv
from radixserve.layers.attention.torch_metadata import metadata_of

if TYPE_CHECKING:
    from radixserve.forward_batch import ForwardBatch
    from radixserve.layers.attention.torch_backend import TorchAttnBackend
    from radixserve.layers.radix_attention import RadixAttention

# At most this many float32 scores per query block of a request's extend (64 MiB).
SCORE_BLOCK_ELEMENTS = 1 << 24


class Slice(Protocol):
    """A request's part of an extend batch (torch_backend.ExtendSlice, window.WindowSlice)."""

    q_start: int
    q_len: int
    kv_start: int
    kv_len: int

    def mask(self, device: torch.device) -> torch.Tensor | None: ...


def takes(layer: RadixAttention) -> bool:
    """Whether `layer` runs here: it caps its scores, which no kernel, SDPA or cascade path can."""
    return layer.logit_cap is not None


def cap_scores(scores: torch.Tensor, scaling: float, cap: float) -> torch.Tensor:
    """float32 scores: cap * tanh(scores * scaling / cap), in place where `scores` is float32 already."""
    scores = scores.float().mul_(scaling / cap)
    return scores.tanh_().mul_(cap)


def decode_attention(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, kv_indices: torch.Tensor,
                     max_len: int, mask: torch.Tensor | None, scaling: float, cap: float) -> torch.Tensor:
    """q [bs, heads, dim]; row r attends to slots kv_indices[r * max_len : (r + 1) * max_len] of the pool
    buffers k_all/v_all [slots, kv_heads, dim]; `mask`: additive float32 [bs, max_len] (-inf past a row's
    length), None: every row full. -> [bs, heads * dim]."""
    bs, heads, dim = q.shape
    kv_heads = k_all.shape[1]
    group = heads // kv_heads
    keys = gather_kv(k_all, kv_indices, q.dtype).view(bs, max_len, kv_heads, dim)
    values = gather_kv(v_all, kv_indices, q.dtype).view(bs, max_len, kv_heads, dim)
    queries = q.view(bs, kv_heads, group, dim)
    scores = cap_scores(torch.matmul(queries, keys.permute(0, 2, 3, 1)), scaling, cap)  # [bs, kv, group, len]
    if mask is not None:
        # NOTE: after the cap: capping -inf would give -cap, and padded slots would get weight
        scores.add_(mask.view(bs, 1, 1, max_len))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    out = torch.matmul(probs, values.permute(0, 2, 1, 3))  # [bs, kv_heads, group, dim]
    return out.reshape(bs, heads * dim)


def extend_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slices: list[Slice],
                     scaling: float, cap: float) -> torch.Tensor:
    """q [tokens, heads, dim]; `keys`/`values` [*, kv_heads, dim]: the gathered contexts (or the new tokens),
    request by request as `slices` say; each slice's mask (None: causal, diagonal shifted by kv_len - q_len).
    -> [tokens, heads * dim]."""
    tokens, heads, dim = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    out = torch.empty(tokens, kv_heads, group, dim, dtype=q.dtype, device=q.device)
    for s in slices:
        k = keys[s.kv_start : s.kv_start + s.kv_len].permute(1, 2, 0).unsqueeze(1)  # [kv, 1, dim, kv_len]
        v = values[s.kv_start : s.kv_start + s.kv_len].transpose(0, 1).unsqueeze(1)  # [kv, 1, kv_len, dim]
        mask = s.mask(q.device)
        if mask is None:
            mask = _causal(s.q_len, s.kv_len, q.device)
        block = max(1, SCORE_BLOCK_ELEMENTS // max(1, heads * s.kv_len))
        for first in range(0, s.q_len, block):
            rows = slice(first, min(first + block, s.q_len))
            qb = q[s.q_start + rows.start : s.q_start + rows.stop].view(-1, kv_heads, group, dim).permute(1, 2, 0, 3)
            scores = cap_scores(torch.matmul(qb, k), scaling, cap)  # [kv, group, rows, kv_len]
            # NOTE: masked after the cap (see decode_attention); every row sees at least its own key
            scores.masked_fill_(~mask[rows], float("-inf"))
            probs = torch.softmax(scores, dim=-1).to(q.dtype)
            out[s.q_start + rows.start : s.q_start + rows.stop] = torch.matmul(probs, v).permute(2, 0, 1, 3)
    return out.view(tokens, heads * dim)


def _causal(q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """bool [q_len, kv_len]: query i (the (kv_len - q_len + i)-th key's position) sees keys 0 .. kv_len - q_len + i."""
    return torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril_(kv_len - q_len)


def forward_decode(backend: TorchAttnBackend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   layer: RadixAttention, fb: ForwardBatch, save_kv_cache: bool = True) -> torch.Tensor:
    """A capped layer's decode on `backend`: stores the new K/V where the layer keeps them (window slots for a
    window layer of a hybrid pool), then attends over the window's tables or the whole context's."""
    k_all, v_all = _store(backend, k, v, layer, fb, save_kv_cache)
    fmeta = metadata_of(fb)
    windowed = backend.window_meta(layer, fmeta.window_decode)
    if windowed is not None and not isinstance(windowed, window.WindowDecodeMetadata):  # the window's cascade plan
        windowed = window.decode_metadata(fb, layer.sliding_window, _translate(fb))
    meta = windowed if windowed is not None else fmeta.decode
    if meta is None:  # cascade was planned for this batch (a backend built with it on): the plain tables
        meta = window.decode_metadata(fb, _hides_nothing(fb))
    return decode_attention(q, k_all, v_all, meta.kv_indices, meta.max_len, meta.mask, layer.scaling,
                            layer.logit_cap)


def forward_extend(backend: TorchAttnBackend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   layer: RadixAttention, fb: ForwardBatch, save_kv_cache: bool = True) -> torch.Tensor:
    """A capped layer's extend on `backend` (see forward_decode): banded per request where the layer's window
    tables are built, else causal over each request's context (its new K/V alone when nothing is cached)."""
    k_all, v_all = _store(backend, k, v, layer, fb, save_kv_cache)
    fmeta = metadata_of(fb)
    windowed = backend.window_meta(layer, fmeta.window_extend)
    if windowed is not None and not isinstance(windowed, window.WindowExtendMetadata):  # see forward_decode
        windowed = window.extend_metadata(fb, layer.sliding_window, _translate(fb))
    if windowed is not None:
        keys, values = gather_kv(k_all, windowed.kv_indices, q.dtype), gather_kv(v_all, windowed.kv_indices, q.dtype)
        return extend_attention(q, keys, values, windowed.slices, layer.scaling, layer.logit_cap)
    meta = fmeta.extend
    if meta is None:  # cascade was planned for this batch (see forward_decode)
        meta = window.extend_metadata(fb, _hides_nothing(fb))
    if meta.kv_indices is not None:
        k, v = gather_kv(k_all, meta.kv_indices, q.dtype), gather_kv(v_all, meta.kv_indices, q.dtype)
    else:  # NOTE: without kv_indices nothing is cached: the contexts are the new K/V (as the pool holds them)
        k, v = as_cached(k, k_all.dtype), as_cached(v, v_all.dtype)
    return extend_attention(q, k, v, meta.slices, layer.scaling, layer.logit_cap)


def _translate(fb: ForwardBatch) -> torch.Tensor | None:
    """The hybrid pool's full -> window slot table (window layers' tables are in window slots), or None: every
    pool declares `full_to_window` (memory_pool.py)."""
    return fb.token_to_kv_pool.full_to_window


def _hides_nothing(fb: ForwardBatch) -> int:
    """A window as long as the longest request: its tables are the whole contexts' (untranslated: full slots)."""
    return max(fb.seq_lens_cpu)


def _store(backend: TorchAttnBackend, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention, fb: ForwardBatch,
           save_kv_cache: bool) -> tuple[torch.Tensor, torch.Tensor]:
    pool = fb.token_to_kv_pool
    if save_kv_cache:
        pool.set_kv_buffer(layer.layer_id, backend.kv_write_loc(layer, fb), k, v)
    return pool.get_kv_buffer(layer.layer_id)
