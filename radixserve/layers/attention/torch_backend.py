"""Attention in plain torch over the paged KV pool (CPU and CUDA), plus the CPU variant with C kernels.

Decode: one gather per layer for the whole batch. Each request's slots are read from
`req_to_token[row, :max_len]` (rows are padded to the longest request and the padding is masked),
so the K/V rows of all requests come out of the pool in one `index_select` per buffer. With few kv
heads the queries are widened over all kv heads instead of transposing K/V (decode_block_diagonal);
with many, K/V are gathered head-major (decode_head_major). CpuAttnBackend replaces both with a C
kernel that reads the slots in place (kernels/attention.py), which removes the gather copy altogether.
Extend: requests without a cached prefix attend over their own new K/V directly (no gather);
when some request has a cached prefix, the contexts of all requests are gathered in one
`index_select` and each request runs causal SDPA over its slice, with the causal diagonal
shifted by its prefix length. CpuAttnBackend instead runs one C kernel call for the whole batch
that reads every request's context in place (extend_attention.c; in bf16 on CPUs with AMX-BF16,
extend_amx.c on the tiles, kernels/attention_amx.py; off with RADIXSERVE_CPU_PREFILL_KERNEL=0). Which C kernels run depends on the CPU's kernel level and the dtype
(kernels.attention.SELECTED, measured against the torch paths here), as the backend's plan says (registry.plan_attention).
Cascade (cascade.py): when every request of a batch shares a long enough prefix (see
`CascadePolicy`, configs/row_table.py), decode and extend attend over that prefix once for the whole batch.
Sliding window (window.py): a layer with a window, in a batch where the window hides keys, decodes over its
window's slots (the C decode kernel or torch, as planned) and extends with the C extend kernel given the window
where it is planned as for full layers, else with a banded mask in SDPA. Where the batch shares a prefix that its
windows still see, window layers take cascade too, cut to the window (window_cascade.py).
Soft-capped scores (softcap.py, Gemma 2): a layer with `logit_cap` runs torch math attention over the same tables.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import torch
import torch.nn.functional as F

from radixserve import envs
from radixserve.configs.row_table import CascadePolicy
from radixserve.layers.attention import cascade, softcap, window, window_cascade
from radixserve.layers.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    AttentionPlan,
    as_cached,
    gather_kv,
)
from radixserve.layers.attention.torch_metadata import (  # noqa: F401 (DecodeMetadata, ExtendSlice: re-exported)
    DecodeMetadata,
    ExtendMetadata,
    ExtendSlice,
    GraphDecodeTables,
    TorchAttnMetadata,
    decode_metadata,
    extend_metadata,
    metadata_of,
)

if TYPE_CHECKING:
    from radixserve.forward_batch import ForwardBatch
    from radixserve.kernels.attention import DecodeKernel
    from radixserve.kernels.attention_amx import AmxExtendKernel
    from radixserve.layers.radix_attention import RadixAttention


Plan = TypeVar("Plan")

# NOTE: up to this many kv heads, decode widens queries over all kv heads (see decode_block_diagonal).
BLOCK_DIAGONAL_MAX_KV_HEADS = 4
# The longest context whose decode the torch backend captures in CUDA graphs (its static tables are this wide).
GRAPH_MAX_CONTEXT = 4096


class TorchAttnBackend(AttentionBackend):
    def __init__(self, use_cascade: bool = True, plan: AttentionPlan | None = None) -> None:
        # NOTE: the plan decides which C kernels run per dtype (registry.plan_attention); torch runs the rest
        self.plan = plan or AttentionPlan("torch", use_cascade)
        self.decode_kernel = None  # set by CpuAttnBackend
        self.extend_kernel: DecodeKernel | None = None  # set by CpuAttnBackend unless switched off
        self.amx_extend: AmxExtendKernel | None = None  # bf16 extend on AMX tiles (CpuAttnBackend, AMX CPUs)
        # None: cascade attention off (--disable-cascade-attention)
        self.cascade: CascadePolicy | None = self.plan.rows.cascade if self.plan.cascade else None
        self.cascade_forwards = {"decode": 0, "extend": 0}  # forwards that ran cascade attention (full layers)
        self.window_cascade_forwards = {"decode": 0, "extend": 0}  # forwards whose window layers ran it
        self.graph_tables: GraphDecodeTables | None = None  # the CUDA graph runner's static tables (init_graph_state)

    def build_forward_metadata(self, fb: ForwardBatch) -> TorchAttnMetadata:
        # NOTE: one host sync finds the batch's shared prefix P for every layer kind; the policy decides per kind
        prefix_len = 0 if self.cascade is None else cascade.batch_prefix_len(fb, self.cascade)
        meta = TorchAttnMetadata()
        if fb.forward_mode.is_decode():
            meta.cascade_decode = self._plan(cascade.plan_decode, fb, "decode", prefix_len)
            meta.decode = None if meta.cascade_decode is not None else decode_metadata(fb)
        else:
            meta.extend_kernel_fits = (self.extend_kernel is not None
                                       and max(fb.extend_seq_lens_cpu) <= self.plan.rows.extend_kernel_new_tokens)
            meta.cascade_extend = self._plan(cascade.plan_extend, fb, "extend", prefix_len)
            if meta.cascade_extend is None:
                with_kernel = meta.extend_kernel_fits or self.amx_extend is not None
                meta.extend = extend_metadata(fb, with_kernel=with_kernel)
        self._plan_windows(fb, prefix_len, meta)
        return meta

    def _plan_windows(self, fb: ForwardBatch, prefix_len: int, meta: TorchAttnMetadata) -> None:
        """Per window: its cascade plan where the policy takes the part of P the window sees, else its tables."""
        # NOTE: with a hybrid pool, window layers read their own buffers: always through translated tables
        table = fb.token_to_kv_pool.full_to_window  # NOTE: declared by every pool (None unless hybrid)
        applies = [w for w in self.plan.windows if table is not None or window.window_applies(fb, w)]
        decode = fb.forward_mode.is_decode()
        plan_cascade = window_cascade.plan_decode if decode else window_cascade.plan_extend
        plan_tables = window.decode_metadata if decode else window.extend_metadata
        metas: dict[int, object] = {}
        for w in applies:
            cut = plan_cascade(fb, w, prefix_len, self.cascade, table) if prefix_len else None
            metas[w] = cut if cut is not None else plan_tables(fb, w, table)
        if decode:
            meta.window_decode = metas
        else:
            meta.window_extend = metas
        self.window_cascade_forwards["decode" if decode else "extend"] += any(
            isinstance(m, (cascade.CascadeDecodeMetadata, cascade.CascadeExtendMetadata)) for m in metas.values())
        meta.window_out_loc = table[fb.out_cache_loc.long()] if table is not None else None

    @classmethod
    def graph_refusal(cls, windows: tuple[int, ...] = (), hybrid: bool = False, context_len: int = 0) -> str | None:
        """Graphs take plain decode over fixed-width tables: no window tables (they are sized per batch), no hybrid
        pool; cascade is planned per batch, so a captured step never takes it. NOTE: every captured step gathers and
        attends over the whole table width, so only short contexts are captured."""
        if windows or hybrid:
            return "the torch backend's graph tables have no sliding-window or hybrid-pool form (use triton)"
        if context_len > GRAPH_MAX_CONTEXT:
            return (f"the torch backend's graph tables are as wide as the context ({context_len} > {GRAPH_MAX_CONTEXT} "
                    "positions gathered every step; use triton)")
        return None

    def init_graph_state(self, max_bs: int, max_context_len: int, device: torch.device) -> None:
        self.graph_tables = GraphDecodeTables(max_bs, max_context_len, device)

    def init_forward_metadata_capture(self, fb: ForwardBatch) -> TorchAttnMetadata:
        # NOTE: every row masked past its length (the tables are max_context_len wide): never the cascade plan
        meta = TorchAttnMetadata(decode=self.graph_tables.capture(fb.batch_size), graph=True)
        self.graph_tables.refill(fb, fb.batch_size)
        fb.attn_metadata = meta
        return meta

    def init_forward_metadata_replay(self, fb: ForwardBatch, meta: AttentionMetadata) -> None:
        self.graph_tables.refill(fb, fb.batch_size)

    def kv_write_loc(self, layer: RadixAttention, fb: ForwardBatch) -> torch.Tensor:
        """Where this layer writes the new tokens' K/V: window slots for a window layer of a hybrid pool."""
        window_loc = metadata_of(fb).window_out_loc
        if window_loc is not None and layer.sliding_window is not None:
            return window_loc
        return fb.out_cache_loc

    def _plan(self, planner: Callable[[ForwardBatch, CascadePolicy, int], Plan | None], fb: ForwardBatch,
              mode: str, prefix_len: int) -> Plan | None:
        if self.cascade is None:
            return None
        meta = planner(fb, self.cascade, prefix_len)
        self.cascade_forwards[mode] += meta is not None
        return meta

    def decode_kernel_for(self, q: torch.Tensor, num_kv_heads: int,
                          kv_dtype: torch.dtype | None = None) -> DecodeKernel | None:
        """The C decode kernel where the plan uses it in q's dtype and it takes q's shape over a `kv_dtype` cache
        (default q's; the C decoder asks too); None: torch."""
        kernel = self.decode_kernel
        ok = (kernel is not None and self.plan.uses("decode", q.dtype)
              and kernel.supports(q, num_kv_heads, kv_dtype or q.dtype))
        return kernel if ok else None

    def _kernel_for(self, q: torch.Tensor, layer: RadixAttention, k_all: torch.Tensor) -> DecodeKernel | None:
        return self.decode_kernel_for(q, layer.num_kv_heads, k_all.dtype)

    def _prefix_kernel_for(self, q: torch.Tensor, layer: RadixAttention, k_all: torch.Tensor,
                           meta: cascade.CascadeMetadata, decode: bool = False) -> DecodeKernel | AmxExtendKernel | None:
        return self.prefix_kernel_for(q, layer.num_kv_heads, k_all.dtype, decode, bounds=meta.prefix_first is not None)

    def prefix_kernel_for(self, q: torch.Tensor, num_kv_heads: int, kv_dtype: torch.dtype, decode: bool = False,
                          bounds: bool = False) -> DecodeKernel | AmxExtendKernel | None:
        """The C kernel of cascade's part (a) for `q` over a `kv_dtype` cache (the C decoder asks too): on AMX
        tiles where the plan uses them and no query has a lower bound (`bounds`: a window layer's plan), else the C
        prefix kernel where the plan uses it; None: torch's op."""
        amx = self.amx_extend
        if (amx is not None and not bounds and self.plan.uses("prefix_amx", q.dtype)
                and amx.prefix_supports(q, num_kv_heads, kv_dtype)):
            return amx
        kernel = self.decode_kernel
        # NOTE: over a cache narrower than q (bf16 under float32), torch's path widens a copy of the prefix per call,
        # which at decode sizes costs more than the attention (32 queries x 1,000 keys, AVX2 class: torch 1.82 ms,
        # the C kernel 0.68 ms; float32 cache 0.89 ms): a decode batch's part (a) then runs where decode runs in C
        widened = decode and kv_dtype != q.dtype and self.plan.uses("decode", q.dtype)
        ok = (kernel is not None and (self.plan.uses("prefix", q.dtype) or widened)
              and kernel.prefix_supports(q, num_kv_heads, kv_dtype))
        return kernel if ok else None

    def _extend_kernel_for(self, q: torch.Tensor, k_all: torch.Tensor, meta: TorchAttnMetadata) -> DecodeKernel | None:
        kernel = self.extend_kernel
        ok = meta.extend_kernel_fits and self.plan.uses("extend", q.dtype) and kernel.extend_supports(q, k_all)
        return kernel if ok else None

    def _plain_extend_kernel_for(self, q: torch.Tensor, k_all: torch.Tensor,
                                 meta: TorchAttnMetadata) -> DecodeKernel | AmxExtendKernel | None:
        """For extend without cascade: the AMX kernel where the plan uses it and it takes q, else the C kernel."""
        amx = self.amx_extend
        if amx is not None and self.plan.uses("extend_amx", q.dtype) and amx.extend_supports(q, k_all):
            return amx
        return self._extend_kernel_for(q, k_all, meta)

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention,
                       fb: ForwardBatch, save_kv_cache: bool = True) -> torch.Tensor:
        if softcap.takes(layer):  # NOTE: capped scores: torch math, before the C kernels and cascade (softcap.py)
            return softcap.forward_decode(self, q, k, v, layer, fb, save_kv_cache)
        pool = fb.token_to_kv_pool
        if save_kv_cache:
            pool.set_kv_buffer(layer.layer_id, self.kv_write_loc(layer, fb), k, v)
        k_all, v_all = pool.get_kv_buffer(layer.layer_id)
        kernel = self._kernel_for(q, layer, k_all)
        fmeta = metadata_of(fb)
        windowed = self.window_meta(layer, fmeta.window_decode)
        if isinstance(windowed, window.WindowDecodeMetadata):
            return self._decode_window(q, k_all, v_all, layer, windowed, kernel)
        cascaded = windowed if windowed is not None else fmeta.cascade_decode  # a window's own, or the batch's
        if cascaded is not None:
            out = cascade.cascade_decode(q, k_all, v_all, cascaded, layer.scaling, kernel,
                                         self._prefix_kernel_for(q, layer, k_all, cascaded, decode=True))
            return out.view(q.shape[0], layer.num_heads * layer.head_dim)
        meta = fmeta.decode
        if kernel is not None:
            out = kernel(q, k_all, v_all, meta.kv_indices, fb.seq_lens, meta.max_len, layer.scaling)
            return out.view(q.shape[0], layer.num_heads * layer.head_dim)
        if layer.num_kv_heads <= BLOCK_DIAGONAL_MAX_KV_HEADS:
            return decode_block_diagonal(q, k_all, v_all, meta, layer.scaling)
        return decode_head_major(q, k_all, v_all, meta, layer.scaling)

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention,
                       fb: ForwardBatch, save_kv_cache: bool = True) -> torch.Tensor:
        if softcap.takes(layer):  # NOTE: as in forward_decode
            return softcap.forward_extend(self, q, k, v, layer, fb, save_kv_cache)
        pool = fb.token_to_kv_pool
        if save_kv_cache:
            pool.set_kv_buffer(layer.layer_id, self.kv_write_loc(layer, fb), k, v)
        k_all, v_all = pool.get_kv_buffer(layer.layer_id)
        fmeta = metadata_of(fb)
        windowed = self.window_meta(layer, fmeta.window_extend)
        if isinstance(windowed, window.WindowExtendMetadata):
            kernel = self._extend_kernel_for(q, k_all, fmeta)
            if kernel is not None:
                out, _ = kernel.extend(q, k_all, v_all, windowed.kv_indices, windowed.reqs, layer.scaling,
                                       window=layer.sliding_window)
            else:
                out = window.extend_attention(q, k_all, v_all, windowed, layer.scaling)
            return out.view(q.shape[0], layer.num_heads * layer.head_dim)
        cascaded = windowed if windowed is not None else fmeta.cascade_extend  # a window's own, or the batch's
        if cascaded is not None:
            out = cascade.cascade_extend(q, k_all, v_all, cascaded, layer.scaling,
                                         self._prefix_kernel_for(q, layer, k_all, cascaded),
                                         self._extend_kernel_for(q, k_all, fmeta))
            return out.view(q.shape[0], layer.num_heads * layer.head_dim)
        extend_kernel = self._plain_extend_kernel_for(q, k_all, fmeta)
        meta = fmeta.extend
        if extend_kernel is not None and meta.kernel_reqs is not None:
            out, _ = extend_kernel.extend(q, k_all, v_all, meta.kernel_indices, meta.kernel_reqs, layer.scaling)
            return out.view(q.shape[0], layer.num_heads * layer.head_dim)
        if meta.kv_indices is not None:
            k, v = gather_kv(k_all, meta.kv_indices, q.dtype), gather_kv(v_all, meta.kv_indices, q.dtype)
        else:  # NOTE: nothing cached: the contexts are the new K/V, as the pool holds them
            k, v = as_cached(k, k_all.dtype), as_cached(v, v_all.dtype)
        out = torch.empty(q.shape[0], layer.num_heads, layer.head_dim, dtype=q.dtype, device=q.device)
        for s in meta.slices:
            out[s.q_start : s.q_start + s.q_len] = _causal_sdpa(
                q[s.q_start : s.q_start + s.q_len], k[s.kv_start : s.kv_start + s.kv_len],
                v[s.kv_start : s.kv_start + s.kv_len], s.mask(q.device), layer.scaling)
        return out.view(q.shape[0], layer.num_heads * layer.head_dim)


    def window_meta(self, layer: RadixAttention, metas: dict[int, Plan]) -> Plan | None:
        """This forward's plan for the layer's window (its tables, or its cascade cut to the window); None: a full
        layer, or a window that hides nothing."""
        if layer.sliding_window is None:
            return None
        if layer.sliding_window not in self.plan.windows:
            # NOTE: without its tables a window layer would silently attend to everything
            raise ValueError(f"layer {layer.layer_id} has sliding window {layer.sliding_window}, which the "
                             f"attention plan does not list ({self.plan.windows})")
        return metas.get(layer.sliding_window)

    def _decode_window(self, q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, layer: RadixAttention,
                       meta: window.WindowDecodeMetadata, kernel: DecodeKernel | None) -> torch.Tensor:
        """Decode over each request's window: its slots and lengths stand in for the whole context."""
        if kernel is not None:
            out = kernel(q, k_all, v_all, meta.kv_indices, meta.lens, meta.max_len, layer.scaling)
            return out.view(q.shape[0], layer.num_heads * layer.head_dim)
        plain = DecodeMetadata(meta.kv_indices, meta.max_len, meta.mask)
        if layer.num_kv_heads <= BLOCK_DIAGONAL_MAX_KV_HEADS:
            return decode_block_diagonal(q, k_all, v_all, plain, layer.scaling)
        return decode_head_major(q, k_all, v_all, plain, layer.scaling)


PREFILL_KERNEL_ENV = envs.CPU_PREFILL_KERNEL.name  # "0": extend attention stays on torch's SDPA


class CpuAttnBackend(TorchAttnBackend):
    """The torch backend with decode, extend and cascade-prefix attention in compiled C kernels that read the
    pool in place, at the kernel level of `platform.kernel_isa()`; each kernel only where the plan uses it
    (registry.plan_attention: where `kernels.attention.SELECTED` says it beat torch's op on that level), else torch."""

    def __init__(self, use_cascade: bool = True, plan: AttentionPlan | None = None) -> None:
        from radixserve.kernels.attention import load_decode_kernel
        from radixserve.kernels.attention_amx import load_amx_extend_kernel
        from radixserve.layers.attention.registry import plan_attention

        plan = plan or plan_attention("cpu", torch.device("cpu"), use_cascade)
        super().__init__(use_cascade, plan)
        used = set().union(*plan.kernels.values())
        self.decode_kernel = load_decode_kernel(plan.level) if used - {"extend_amx", "prefix_amx"} else None
        self.extend_kernel = self.decode_kernel if "extend" in used else None
        self.amx_extend = load_amx_extend_kernel() if used & {"extend_amx", "prefix_amx"} else None


def decode_block_diagonal(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, meta: DecodeMetadata,
                          scaling: float) -> torch.Tensor:
    """Decode attention reading each token's K/V row (all kv heads) once, with no transposed copy.

    Each query head is widened to all kv heads, zero outside its own, so one batched matmul against
    the gathered [max_len, kv_heads * dim] rows gives exactly its scores; the output keeps the block of
    its own kv head. The matmuls do kv_heads times the needed work, cheap next to the KV memory traffic.
    """
    bs, heads, dim = q.shape
    kv_heads = k_all.shape[1]
    group, width = heads // kv_heads, kv_heads * dim
    keys = gather_kv(k_all.view(-1, width), meta.kv_indices, q.dtype).view(bs, meta.max_len, width)
    values = gather_kv(v_all.view(-1, width), meta.kv_indices, q.dtype).view(bs, meta.max_len, width)
    q_wide = q.new_zeros(bs, kv_heads, group, kv_heads, dim)
    torch.diagonal(q_wide, dim1=1, dim2=3).copy_(q.view(bs, kv_heads, group, dim).permute(0, 2, 3, 1))
    scores = torch.bmm(q_wide.view(bs, heads, width), keys.transpose(1, 2)).float().mul_(scaling)
    if meta.mask is not None:
        scores.add_(meta.mask.unsqueeze(1))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    out_wide = torch.bmm(probs, values).view(bs, kv_heads, group, kv_heads, dim)
    return torch.diagonal(out_wide, dim1=1, dim2=3).permute(0, 3, 1, 2).reshape(bs, heads * dim)


def decode_head_major(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, meta: DecodeMetadata,
                      scaling: float) -> torch.Tensor:
    """Decode attention on K/V gathered head-major, [kv_heads * bs, max_len, dim] (for many kv heads)."""
    bs, heads, dim = q.shape
    kv_heads = k_all.shape[1]
    group = heads // kv_heads
    keys = _gather_head_major(k_all, meta.kv_indices).view(kv_heads * bs, meta.max_len, dim).to(q.dtype)
    values = _gather_head_major(v_all, meta.kv_indices).view(kv_heads * bs, meta.max_len, dim).to(q.dtype)
    queries = q.view(bs, kv_heads, group, dim).transpose(0, 1).reshape(kv_heads * bs, group, dim)
    scores = torch.bmm(queries, keys.transpose(1, 2)).float().mul_(scaling)
    if meta.mask is not None:
        scores = scores.view(kv_heads, bs, group, meta.max_len).add_(meta.mask.view(1, bs, 1, -1)).view_as(scores)
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    out = torch.bmm(probs, values).view(kv_heads, bs, group, dim)
    return out.transpose(0, 1).reshape(bs, heads * dim)


def _gather_head_major(buffer: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """buffer [slots, kv_heads, dim] -> [kv_heads, len(indices), dim], one index_select per head."""
    slots, kv_heads, dim = buffer.shape
    out = torch.empty(kv_heads, indices.shape[0], dim, dtype=buffer.dtype, device=buffer.device)
    for head in range(kv_heads):
        torch.index_select(buffer[:, head], 0, indices, out=out[head])
    return out


def _causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                 scaling: float) -> torch.Tensor:
    """q: [n, heads, dim], k/v: [m, kv_heads, dim] -> [n, heads, dim]."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask, is_causal=mask is None, scale=scaling, enable_gqa=q.shape[1] != k.shape[1])
    return out.squeeze(0).transpose(0, 1)
