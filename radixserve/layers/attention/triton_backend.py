"""Attention over the paged KV pool in Triton kernels (triton_ops/): the backend `auto` picks on CUDA.

Per forward, `build_forward_metadata` copies the batch's `req_to_token` rows into a slot table (one row per
request, as wide as the batch needs), so that the layers never read the scheduler's table again: the overlap loop may
rewrite a row once the forward's `read_done` is recorded. Decode is split-K flash decoding over each row
(decode_attention.py); extend is one kernel over the cached prefix (from the pool, through the row) and the new
tokens (as computed, causal) (extend_attention.py). GQA, sliding windows (a layer's `sliding_window`), soft-capped
scores (`logit_cap`) and the hybrid pool's window slots (`full_to_window`) are kernel parameters: every layer of
every model the torch backend serves runs here, with no cascade (each request attends over its whole context).

CUDA graphs (model_executor/cuda_graph_runner.py): the decode kernels' launch shapes depend on the batch size only
(the split count is fixed), so a captured step replays for any lengths: `init_graph_state` allocates a static slot
table as wide as the longest context, `init_forward_metadata_capture` hands out views of its first bs rows, and
`init_forward_metadata_replay` refills them (and the hybrid pool's window slots) in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from radixserve.layers.attention.base import AttentionBackend, AttentionMetadata, AttentionPlan, as_cached
from radixserve.layers.attention.triton_ops.decode_attention import decode_attention
from radixserve.layers.attention.triton_ops.extend_attention import extend_attention

if TYPE_CHECKING:
    from radixserve.forward_batch import ForwardBatch
    from radixserve.layers.radix_attention import RadixAttention

# NOTE: fixed, so that a decode step's launch shapes depend on the batch size alone (CUDA graphs); 8 parts keep
# an H100's SMs busy from about 16 rows x kv heads up, and cost one small merge kernel per layer
DEFAULT_KV_SPLITS = 8


@dataclass
class TritonAttnMetadata(AttentionMetadata):
    """One forward's tables. Decode: `table` [bs, width] int32, the rows' slots by position, and `seq_lens`.
    Extend: `table` holds the cached prefixes (width: the longest), with each request's prefix and new-token counts,
    where its new tokens start in the batch, and the most new tokens of a request (the grid's size)."""

    table: torch.Tensor
    seq_lens: torch.Tensor
    prefix_lens: torch.Tensor | None = None
    extend_lens: torch.Tensor | None = None
    q_starts: torch.Tensor | None = None
    max_extend_len: int = 0
    window_out_loc: torch.Tensor | None = None  # hybrid pool: the new tokens' window slots


class TritonAttnBackend(AttentionBackend):
    def __init__(self, use_cascade: bool = False, plan: AttentionPlan | None = None,
                 num_kv_splits: int = DEFAULT_KV_SPLITS) -> None:
        # NOTE: never cascade (use_cascade is the registry's common signature); the plan says so
        self.plan = plan or AttentionPlan("triton", False)
        self.num_kv_splits = num_kv_splits
        self.graph_table: torch.Tensor | None = None  # static [max_bs, max_context_len] (init_graph_state)
        self.graph_window_loc: torch.Tensor | None = None

    def build_forward_metadata(self, fb: ForwardBatch) -> TritonAttnMetadata:
        rows = fb.req_to_token_pool.req_to_token
        window_loc = _window_loc(fb)
        if fb.forward_mode.is_decode():
            table = rows[fb.req_pool_indices, : max(fb.seq_lens_cpu)]  # NOTE: a copy (advanced indexing)
            return TritonAttnMetadata(table, fb.seq_lens, window_out_loc=window_loc)
        width = max(1, max(fb.extend_prefix_lens_cpu))
        table = rows[fb.req_pool_indices, :width]
        starts = torch.zeros_like(fb.extend_seq_lens)
        starts[1:] = torch.cumsum(fb.extend_seq_lens, 0)[:-1]
        return TritonAttnMetadata(table, fb.seq_lens, fb.extend_prefix_lens, fb.extend_seq_lens, starts,
                                  max(fb.extend_seq_lens_cpu), window_loc)

    def kv_write_loc(self, layer: RadixAttention, fb: ForwardBatch) -> torch.Tensor:
        loc = _meta(fb).window_out_loc
        return loc if loc is not None and layer.sliding_window is not None else fb.out_cache_loc

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention,
                       fb: ForwardBatch, save_kv_cache: bool = True) -> torch.Tensor:
        meta, (k_all, v_all), translate = self._store(k, v, layer, fb, save_kv_cache)
        q = q.reshape(-1, layer.num_heads, layer.head_dim)
        out = decode_attention(q, k_all, v_all, meta.table, meta.seq_lens, layer.scaling, self.num_kv_splits,
                               layer.sliding_window, layer.logit_cap, translate)
        return out.view(q.shape[0], layer.num_heads * layer.head_dim)

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention,
                       fb: ForwardBatch, save_kv_cache: bool = True) -> torch.Tensor:
        meta, (k_all, v_all), translate = self._store(k, v, layer, fb, save_kv_cache)
        q = q.reshape(-1, layer.num_heads, layer.head_dim)
        # NOTE: the new K/V as the pool holds them (rounded through a narrower cache), as every other path reads them
        k_new = as_cached(k.reshape(-1, layer.num_kv_heads, layer.head_dim), k_all.dtype)
        v_new = as_cached(v.reshape(-1, layer.num_kv_heads, layer.head_dim), v_all.dtype)
        out = extend_attention(q, k_new, v_new, k_all, v_all, meta.table, meta.prefix_lens, meta.extend_lens,
                               meta.q_starts, meta.max_extend_len, layer.scaling, layer.sliding_window,
                               layer.logit_cap, translate)
        return out.view(q.shape[0], layer.num_heads * layer.head_dim)

    def _store(self, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention, fb: ForwardBatch, save_kv_cache: bool
               ) -> tuple[TritonAttnMetadata, tuple[torch.Tensor, torch.Tensor], torch.Tensor | None]:
        """Writes the new K/V (unless the model did), and returns the metadata, the layer's buffers and the slot
        translation its kernels apply (a hybrid pool's window layers read window slots)."""
        pool = fb.token_to_kv_pool
        if save_kv_cache:
            pool.set_kv_buffer(layer.layer_id, self.kv_write_loc(layer, fb), k, v)
        translate = pool.full_to_window if layer.sliding_window is not None else None
        return _meta(fb), pool.get_kv_buffer(layer.layer_id), translate

    # CUDA graph hooks (base.AttentionBackend)

    @classmethod
    def graph_refusal(cls, windows: tuple[int, ...] = (), hybrid: bool = False, context_len: int = 0) -> str | None:
        return None  # NOTE: windows, caps and the hybrid pool are kernel parameters; the grid depends on bs alone

    def init_graph_state(self, max_bs: int, max_context_len: int, device: torch.device) -> None:
        self.graph_table = torch.zeros(max_bs, max_context_len, dtype=torch.int32, device=device)
        self.graph_window_loc = torch.zeros(max_bs, dtype=torch.int32, device=device)

    def init_forward_metadata_capture(self, fb: ForwardBatch) -> TritonAttnMetadata:
        bs = fb.batch_size
        hybrid = fb.token_to_kv_pool.full_to_window is not None
        meta = TritonAttnMetadata(self.graph_table[:bs], fb.seq_lens[:bs],
                                  window_out_loc=self.graph_window_loc[:bs] if hybrid else None, graph=True)
        self.init_forward_metadata_replay(fb, meta)
        fb.attn_metadata = meta
        return meta

    def init_forward_metadata_replay(self, fb: ForwardBatch, meta: AttentionMetadata) -> None:
        bs = fb.batch_size
        rows = fb.req_to_token_pool.req_to_token
        self.graph_table[:bs].copy_(rows[fb.req_pool_indices[:bs], : self.graph_table.shape[1]])
        if meta.window_out_loc is not None:
            meta.window_out_loc.copy_(_window_loc(fb)[:bs])


def _meta(fb: ForwardBatch) -> TritonAttnMetadata:
    meta = fb.attn_metadata
    if not isinstance(meta, TritonAttnMetadata):
        # NOTE: a batch's tables are built once per forward, before the first layer; never guessed here
        raise RuntimeError(f"the batch carries {type(meta).__name__}, not this forward's TritonAttnMetadata")
    return meta


def _window_loc(fb: ForwardBatch) -> torch.Tensor | None:
    table = fb.token_to_kv_pool.full_to_window  # NOTE: declared by every pool (None unless hybrid)
    return None if table is None else table[fb.out_cache_loc.long()]
