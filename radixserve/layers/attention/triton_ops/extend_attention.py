"""Extend (prefill over a cached prefix) attention over the paged KV pool in Triton, one kernel per forward.

One program per (request, query head, block of BLOCK_M new tokens). It attends first over the request's cached
prefix, read from the pool through its slot table row (a copy of its `req_to_token` row; pages of any size alike),
with no mask but the window, then over the request's new tokens, read from the new K/V as the forward computed
them (contiguous: no slot lookup), causal within them; one online softmax (float32) runs across both parts.
Blocks a query never sees are skipped: causally, keys past the block's last query; with a window W, keys before
the block's first query's window.

Sliding window W: query at position p sees positions p - W + 1 .. p. Soft-capping c: scores c * tanh(s / c)
before the mask. `translate` (a hybrid pool's window layers): prefix slots are mapped through it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.layers.attention.triton_ops.decode_attention import _softcap, products, stages


@triton.jit
def _online_block(q, k, v, valid, m_i, l_i, acc, scaling, cap, HAS_CAP: tl.constexpr, IEEE: tl.constexpr):
    """One key block into the running (max, sum, acc) of the block's queries."""
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = s * scaling
    if HAS_CAP:
        s = _softcap(s, cap)
    s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # NOTE: a row with nothing visible yet stays at zero
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    if IEEE:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None] + pv


@triton.jit
def _extend_kernel(Q, KNew, VNew, Out, K, V, Table, PrefixLens, ExtendLens, QStarts, Translate,
                   stride_qt, stride_qh, stride_knt, stride_knh, stride_vnt, stride_vnh, stride_ot, stride_oh,
                   stride_kt, stride_kh, stride_vt, stride_vh, stride_tb,
                   scaling, cap, window,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, HAS_CAP: tl.constexpr, HAS_WINDOW: tl.constexpr,
                   HAS_TRANSLATE: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    mb = tl.program_id(2)
    n_new = tl.load(ExtendLens + b).to(tl.int32)
    if mb * BLOCK_M < n_new:
        kvh = h // GROUP
        prefix = tl.load(PrefixLens + b).to(tl.int32)
        q_start = tl.load(QStarts + b).to(tl.int32)
        m = mb * BLOCK_M + tl.arange(0, BLOCK_M)  # the queries' index among the new tokens
        m_ok = m < n_new
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        q = tl.load(Q + (q_start + m)[:, None] * stride_qt + h * stride_qh + d[None, :],
                    mask=m_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        q_pos = prefix + m
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        # the cached prefix, from the pool: visible to every query but for the window
        lo = 0
        if HAS_WINDOW:
            lo = tl.maximum(prefix + mb * BLOCK_M - window + 1, 0)
        for n0 in range(lo, prefix, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            ok = pos < prefix
            slot = tl.load(Table + b * stride_tb + pos, mask=ok, other=0).to(tl.int64)
            if HAS_TRANSLATE:
                slot = tl.load(Translate + slot, mask=ok, other=0).to(tl.int64)
            kv_ok = ok[:, None] & d_ok[None, :]
            k = tl.load(K + slot[:, None] * stride_kt + kvh * stride_kh + d[None, :], mask=kv_ok, other=0.0)
            v = tl.load(V + slot[:, None] * stride_vt + kvh * stride_vh + d[None, :], mask=kv_ok, other=0.0)
            valid = ok[None, :]
            if HAS_WINDOW:
                valid = valid & (pos[None, :] > q_pos[:, None] - window)
            m_i, l_i, acc = _online_block(q, k.to(q.dtype), v.to(q.dtype), valid, m_i, l_i, acc, scaling, cap,
                                          HAS_CAP, IEEE)
        # the new tokens, causal: up to the block's last query
        lo = 0
        if HAS_WINDOW:
            lo = tl.maximum(mb * BLOCK_M - window + 1, 0)
        hi = tl.minimum((mb + 1) * BLOCK_M, n_new)
        for n0 in range(lo, hi, BLOCK_N):
            j = n0 + tl.arange(0, BLOCK_N)
            ok = j < hi
            kv_ok = ok[:, None] & d_ok[None, :]
            k = tl.load(KNew + (q_start + j)[:, None] * stride_knt + kvh * stride_knh + d[None, :], mask=kv_ok,
                        other=0.0)
            v = tl.load(VNew + (q_start + j)[:, None] * stride_vnt + kvh * stride_vnh + d[None, :], mask=kv_ok,
                        other=0.0)
            valid = ok[None, :] & (j[None, :] <= m[:, None])
            if HAS_WINDOW:
                valid = valid & (j[None, :] > m[:, None] - window)
            m_i, l_i, acc = _online_block(q, k.to(q.dtype), v.to(q.dtype), valid, m_i, l_i, acc, scaling, cap,
                                          HAS_CAP, IEEE)
        out = acc / tl.maximum(l_i, 1e-30)[:, None]
        tl.store(Out + (q_start + m)[:, None] * stride_ot + h * stride_oh + d[None, :], out.to(Out.dtype.element_ty),
                 mask=m_ok[:, None] & d_ok[None, :])


def extend_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_buffer: torch.Tensor,
                     v_buffer: torch.Tensor, table: torch.Tensor, prefix_lens: torch.Tensor,
                     extend_lens: torch.Tensor, q_starts: torch.Tensor, max_extend_len: int, scaling: float,
                     window: int | None = None, cap: float | None = None, translate: torch.Tensor | None = None,
                     block_m: int = 32, block_n: int = 32) -> torch.Tensor:
    """q [tokens, heads, dim] and k/v_new [tokens, kv_heads, dim]: the new tokens, request after request (request b's
    from q_starts[b], extend_lens[b] of them); k/v_buffer the pool's [slots, kv_heads, dim]; table [bs, width]
    int32: row b's prefix slots by position (prefix_lens[b] of them) -> [tokens, heads, dim] in q's dtype.
    `max_extend_len`: the most new tokens of a request (the grid). `window`, `cap`, `translate` as for decode."""
    tokens, heads, dim = q.shape
    kv_heads = k_new.shape[1]
    bs = extend_lens.shape[0]
    block_d = triton.next_power_of_2(dim)
    out = torch.empty(tokens, heads, dim, dtype=q.dtype, device=q.device)
    grid = (bs, heads, triton.cdiv(max_extend_len, block_m))
    _extend_kernel[grid](
        q, k_new, v_new, out, k_buffer, v_buffer, table, prefix_lens, extend_lens, q_starts,
        translate if translate is not None else table,
        q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        out.stride(0), out.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        table.stride(0), scaling, cap or 1.0, window or 0,
        GROUP=heads // kv_heads, HEAD_DIM=dim, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n,
        HAS_CAP=cap is not None, HAS_WINDOW=window is not None, HAS_TRANSLATE=translate is not None,
        num_stages=stages(block_d), **products(q.dtype))
    return out
