"""Attention backends against a naive per-request reference, on a pool with scattered slots."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_levels import LEVELS, force_level, kernel_at, select_everything
from test_model_support import one_torch_thread

from radixserve.forward_batch import ForwardBatch
from radixserve.layers.attention import attention_backend_names, create_attention_backend
from radixserve.layers.attention.torch_backend import (
    TorchAttnBackend,
    decode_block_diagonal,
    decode_head_major,
)
from radixserve.layers.radix_attention import RadixAttention
from radixserve.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

_single_thread = pytest.fixture(scope="module", autouse=True)(one_torch_thread)

DIM = 32


def _setup(seq_lens: list[int], kv_heads: int, dtype=torch.float32, seed: int = 0, dim: int = DIM):
    g = torch.Generator().manual_seed(seed)
    size = sum(seq_lens) + 40
    pool = MHATokenToKVPool(size, 1, dtype, kv_heads, dim, 1, "cpu")
    pool.k_buffer[0].copy_(torch.randn(pool.k_buffer[0].shape, generator=g))
    pool.v_buffer[0].copy_(torch.randn(pool.v_buffer[0].shape, generator=g))
    table = ReqToTokenPool(len(seq_lens), max(seq_lens) + 4, "cpu")
    slots = (torch.randperm(size - 1, generator=g) + 1)[: sum(seq_lens)]  # scattered, never slot 0
    rows = table.alloc(len(seq_lens))
    offset = 0
    for row, n in zip(rows, seq_lens, strict=True):
        table.req_to_token[row, :n] = slots[offset : offset + n].to(torch.int32)
        offset += n
    return pool, table, rows, g


def _reference(q: torch.Tensor, pool, table, row: int, seq_len: int, kv_heads: int, causal_from: int) -> torch.Tensor:
    """q [n, heads, dim] at positions causal_from..; attends over slots of positions 0..pos."""
    slots = table.req_to_token[row, :seq_len].long()
    k, v = pool.k_buffer[0][slots].double(), pool.v_buffer[0][slots].double()
    group, dim = q.shape[1] // kv_heads, q.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    for i in range(q.shape[0]):
        visible = causal_from + i + 1
        for h in range(q.shape[1]):
            scores = (k[:visible, h // group] @ q[i, h].double()) / math.sqrt(dim)
            out[i, h] = torch.softmax(scores, 0) @ v[:visible, h // group]
    return out


def _decode_batch(seq_lens, kv_heads, heads, dtype=torch.float32, dim=DIM):
    pool, table, rows, g = _setup(seq_lens, kv_heads, dtype, dim=dim)
    q = torch.randn(len(seq_lens), heads, dim, generator=g).to(dtype)
    last = torch.stack([table.req_to_token[r, n - 1] for r, n in zip(rows, seq_lens, strict=True)]).long()
    fb = ForwardBatch.for_decode([5] * len(rows), rows, seq_lens, last, "cpu")
    fb.req_to_token_pool, fb.token_to_kv_pool = table, pool
    k_new, v_new = pool.k_buffer[0][last].clone(), pool.v_buffer[0][last].clone()
    refs = [_reference(q[i : i + 1], pool, table, r, n, kv_heads, n - 1)[0] for i, (r, n) in
            enumerate(zip(rows, seq_lens, strict=True))]
    return q, k_new, v_new, fb, torch.stack(refs)


@pytest.mark.parametrize("kv_heads, heads", [(1, 4), (2, 6), (4, 8), (8, 8)])
def test_decode_paths_match_reference(kv_heads, heads):
    seq_lens = [1, 37, 9, 70]
    q, k_new, v_new, fb, ref = _decode_batch(seq_lens, kv_heads, heads)
    backend = TorchAttnBackend()
    backend.init_forward_metadata(fb)
    layer = RadixAttention(0, heads, kv_heads, DIM, DIM**-0.5)
    got = backend.forward(q, k_new, v_new, layer, fb).view(len(seq_lens), heads, DIM)
    assert torch.allclose(got.double(), ref, atol=1e-5)
    k_all, v_all = fb.token_to_kv_pool.get_kv_buffer(0)
    for path in (decode_block_diagonal, decode_head_major):
        out = path(q, k_all, v_all, fb.attn_metadata.decode, DIM**-0.5).view(len(seq_lens), heads, DIM)
        assert torch.allclose(out.double(), ref, atol=1e-5), path.__name__


@pytest.mark.parametrize("isa", LEVELS)
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 8e-3)])
# 48: not a multiple of 32 (no bf16 pairs); (1, 8, 128): the V columns in blocks (8 rows x 8 columns of
# 16 lanes do not fit the registers); (2, 6, 32): a shape the AVX-512 code has no constant case for; the
# constant cases of Qwen2.5-1.5B (6 x 128), Llama-3.2-3B (3 x 128), Gemma 3 1B/270M (4 x 256), Gemma 2 2B (2 x 256)
@pytest.mark.parametrize("kv_heads, heads, dim", [(2, 6, 32), (3, 9, 64), (1, 4, 48), (1, 8, 128), (2, 12, 128),
                                                  (8, 24, 128), (1, 4, 256), (4, 8, 256)])
def test_native_decode_kernel_matches_reference(isa, dtype, atol, kv_heads, heads, dim, monkeypatch):
    force_level(isa, monkeypatch)
    select_everything(monkeypatch)
    seq_lens = [3, 130, 64, 65, 1]  # across and exactly at the kernel's 64-token chunks
    q, k_new, v_new, fb, ref = _decode_batch(seq_lens, kv_heads, heads, dtype, dim)
    backend = create_attention_backend("cpu", torch.device("cpu"))
    assert backend.decode_kernel is not None and backend.decode_kernel.isa == isa
    backend.init_forward_metadata(fb)
    got = backend.forward(q, k_new, v_new, RadixAttention(0, heads, kv_heads, dim, dim**-0.5), fb)
    assert got.dtype == dtype
    assert torch.allclose(got.view(len(seq_lens), heads, dim).double(), ref, atol=atol)


@pytest.mark.parametrize("isa", LEVELS)
def test_native_decode_kernel_single_request_uses_head_split(isa):
    """One request on two threads goes through the per-(request, kv head) split."""
    kernel = kernel_at(isa)
    q, _, _, fb, ref = _decode_batch([300], 3, 9, torch.bfloat16, 64)
    k_all, v_all = fb.token_to_kv_pool.get_kv_buffer(0)
    indices = fb.req_to_token_pool.req_to_token[fb.req_pool_indices, :300].reshape(-1)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = kernel(q, k_all, v_all, indices, fb.seq_lens, 300, 64**-0.5)
    finally:
        torch.set_num_threads(before)
    assert torch.allclose(got.double(), ref, atol=8e-3)


def test_extend_with_and_without_prefix_matches_reference():
    kv_heads, heads = 2, 4
    prefix_lens, extend_lens = [0, 5, 12], [6, 3, 1]
    seq_lens = [p + n for p, n in zip(prefix_lens, extend_lens, strict=True)]
    pool, table, rows, g = _setup(seq_lens, kv_heads)
    q = torch.randn(sum(extend_lens), heads, DIM, generator=g)
    locs = torch.cat([table.req_to_token[r, p:s].long() for r, p, s in zip(rows, prefix_lens, seq_lens, strict=True)])
    k_new, v_new = pool.k_buffer[0][locs].clone(), pool.v_buffer[0][locs].clone()
    fb = ForwardBatch.for_extend([5] * len(locs), rows, prefix_lens, extend_lens, locs, "cpu")
    fb.req_to_token_pool, fb.token_to_kv_pool = table, pool
    backend = TorchAttnBackend()
    backend.init_forward_metadata(fb)
    got = backend.forward(q, k_new, v_new, RadixAttention(0, heads, kv_heads, DIM, DIM**-0.5), fb)
    got = got.view(-1, heads, DIM).double()
    start = 0
    for row, p, n in zip(rows, prefix_lens, extend_lens, strict=True):
        ref = _reference(q[start : start + n], pool, table, row, p + n, kv_heads, p)
        assert torch.allclose(got[start : start + n], ref, atol=1e-5)
        start += n


def test_registry():
    assert {"auto", "torch", "cpu"} <= set(attention_backend_names())
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        create_attention_backend("flash", torch.device("cpu"))
    assert type(create_attention_backend("auto", torch.device("meta"))) is TorchAttnBackend
    assert create_attention_backend("torch", torch.device("cpu")).cascade is not None
    assert create_attention_backend("torch", torch.device("cpu"), cascade=False).cascade is None
