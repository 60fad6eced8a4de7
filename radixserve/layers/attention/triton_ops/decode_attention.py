"""Decode attention over the paged KV pool in Triton: split-K flash decoding.

Each request's context is split into `num_splits` equal parts; stage 1 runs one program per (request, kv head,
split): the group of query heads that share the kv head attend over that part (online softmax, float32) and write a
partial output with its log-sum-exp; stage 2 merges the parts of each (request, head). The slots of a request are
read from its slot table row (a copy of its `req_to_token` row, made once per forward by the backend), so pages of
any size work alike: a row lists one slot per position.

Sliding window W: the query at position p sees positions p - W + 1 .. p, i.e. a request of length n attends to
positions max(0, n - W) .. n - 1 only, split like a whole context. Soft-capping c: scores become c * tanh(s / c)
before the mask. `translate` (a hybrid pool's window layers): slots are mapped through it before the K/V load.

NOTE: every shape the launch depends on is fixed by the call's tensors (bs, heads, num_splits), never by the
lengths: a CUDA graph captured for a batch size replays for any lengths up to the table's width.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def stages(block_d: int) -> int:
    """Software-pipelining depth of the K/V loads: 2, or 1 for 256-wide heads (shared memory: a float32 K and V
    block of 32 x 256 is 64 KiB per stage)."""
    return 2 if block_d <= 128 else 1


def products(dtype: torch.dtype) -> dict[str, bool]:
    """How the kernels multiply: float32 inputs exactly (IEEE, not TF32); bf16 in float32 under Triton's interpreter,
    whose dot reads bf16 operands as raw bits (Triton 3.7), natively on a GPU."""
    upcast = dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"
    return {"IEEE": dtype == torch.float32 or upcast, "UPCAST": upcast}


@triton.jit
def _softcap(s, cap):
    # NOTE: cap * tanh(s / cap), written with exp so the interpreter and every GPU have it
    t = tl.exp(-2.0 * tl.abs(s) / cap)
    th = (1.0 - t) / (1.0 + t)
    return cap * tl.where(s >= 0, th, -th)


@triton.jit
def _decode_stage1(Q, K, V, Table, SeqLens, Translate, MidO, MidLse,
                   stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_tb,
                   stride_mb, stride_mh, stride_ms,
                   scaling, cap, window, num_splits,
                   GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_N: tl.constexpr, HAS_CAP: tl.constexpr, HAS_WINDOW: tl.constexpr,
                   HAS_TRANSLATE: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    h = tl.arange(0, BLOCK_H)
    heads = kvh * GROUP + h
    h_ok = h < GROUP
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    seq_len = tl.load(SeqLens + b).to(tl.int32)
    start = 0
    if HAS_WINDOW:
        start = tl.maximum(seq_len - window, 0)
    per_split = tl.cdiv(seq_len - start, num_splits)
    lo = start + split * per_split
    hi = tl.minimum(lo + per_split, seq_len)
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=h_ok[:, None] & d_ok[None, :],
                other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        ok = pos < hi
        slot = tl.load(Table + b * stride_tb + pos, mask=ok, other=0).to(tl.int64)
        if HAS_TRANSLATE:
            slot = tl.load(Translate + slot, mask=ok, other=0).to(tl.int64)
        kv_ok = ok[:, None] & d_ok[None, :]
        k = tl.load(K + slot[:, None] * stride_kt + kvh * stride_kh + d[None, :], mask=kv_ok, other=0.0).to(q.dtype)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scaling
        if HAS_CAP:
            s = _softcap(s, cap)
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        v = tl.load(V + slot[:, None] * stride_vt + kvh * stride_vh + d[None, :], mask=kv_ok, other=0.0).to(q.dtype)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    # NOTE: an empty split (a context shorter than num_splits) leaves l_i = 0: its lse is -inf and stage 2 skips it
    out = acc / tl.maximum(l_i, 1e-30)[:, None]
    lse = tl.where(l_i > 0, m_i + tl.log(tl.maximum(l_i, 1e-30)), float("-inf"))
    base = b * stride_mb + heads * stride_mh + split * stride_ms
    tl.store(MidO + base[:, None] + d[None, :], out, mask=h_ok[:, None] & d_ok[None, :])
    tl.store(MidLse + b * (stride_mb // stride_ms) + heads * (stride_mh // stride_ms) + split, lse, mask=h_ok)


@triton.jit
def _decode_stage2(MidO, MidLse, Out, stride_mb, stride_mh, stride_ms, stride_ob, stride_oh, num_splits,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    s_ok = s < num_splits
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    lse = tl.load(MidLse + b * (stride_mb // stride_ms) + h * (stride_mh // stride_ms) + s, mask=s_ok,
                  other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.exp(lse - m)
    o = tl.load(MidO + b * stride_mb + h * stride_mh + s[:, None] * stride_ms + d[None, :],
                mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    out = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(Out + b * stride_ob + h * stride_oh + d, out.to(Out.dtype.element_ty), mask=d_ok)


def decode_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, table: torch.Tensor,
                     seq_lens: torch.Tensor, scaling: float, num_splits: int, window: int | None = None,
                     cap: float | None = None, translate: torch.Tensor | None = None,
                     block_n: int = 32) -> torch.Tensor:
    """q [bs, heads, dim]; k/v_buffer [slots, kv_heads, dim] (the pool's; any float dtype: read in q's);
    table [bs, width] int32: row b's slots by position (positions >= seq_lens[b] are never read);
    -> [bs, heads, dim] in q's dtype. `window` W: the last W positions only; `cap`: soft-capped scores;
    `translate`: slot -> the buffers' row (a hybrid pool's window layers)."""
    bs, heads, dim = q.shape
    kv_heads = k_buffer.shape[1]
    group = heads // kv_heads
    block_d = triton.next_power_of_2(dim)
    block_h = max(16, triton.next_power_of_2(group))  # NOTE: tl.dot takes blocks of at least 16 rows
    mid_o = torch.empty(bs, heads, num_splits, block_d, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(bs, heads, num_splits, dtype=torch.float32, device=q.device)
    # NOTE: mid_lse shares mid_o's (b, h, split) strides divided by block_d: the kernels index both with them
    assert mid_lse.stride(0) * block_d == mid_o.stride(0) and mid_lse.stride(1) * block_d == mid_o.stride(1)
    _decode_stage1[(bs, kv_heads, num_splits)](
        q, k_buffer, v_buffer, table, seq_lens, translate if translate is not None else table, mid_o, mid_lse,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        table.stride(0), mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        scaling, cap or 1.0, window or 0, num_splits,
        GROUP=group, BLOCK_H=block_h, HEAD_DIM=dim, BLOCK_D=block_d, BLOCK_N=block_n, HAS_CAP=cap is not None,
        HAS_WINDOW=window is not None, HAS_TRANSLATE=translate is not None, num_stages=stages(block_d),
        **products(q.dtype))
    out = torch.empty(bs, heads, dim, dtype=q.dtype, device=q.device)
    _decode_stage2[(bs, heads)](
        mid_o, mid_lse, out, mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), out.stride(0), out.stride(1),
        num_splits, HEAD_DIM=dim, BLOCK_D=block_d, BLOCK_S=triton.next_power_of_2(num_splits))
    return out
