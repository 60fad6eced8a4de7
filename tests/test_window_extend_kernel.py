"""The C extend kernel's sliding window (csrc/extend_attention.c, `DecodeKernel.extend(window=W)`) at every kernel
level, against a float64 reference: windows smaller and larger than the prompt, cached prefixes (kv_len > q_len),
several requests per call, GQA, the bf16 and float32 paths; and the CPU backend routing window layers' extends
through it (with the same result as the banded SDPA path)."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_levels import LEVELS, force_level, kernel_at, select_everything
from test_model_attention import _setup
from test_model_support import one_torch_thread

from radixserve.forward_batch import ForwardBatch
from radixserve.layers.attention import create_attention_backend
from radixserve.layers.radix_attention import RadixAttention

_single_thread = pytest.fixture(scope="module", autouse=True)(one_torch_thread)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, reqs: torch.Tensor,
               scale: float, window: int) -> torch.Tensor:
    """float64: query i of a request (position kv_len - q_len + i) sees positions within `window` (<= 0: all)."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    group = q.shape[1] // k.shape[1]
    for q_start, q_len, kv_start, kv_len in reqs.tolist():
        ctx = slots[kv_start : kv_start + kv_len].long()
        keys, values = (t[ctx].double().repeat_interleave(group, 1) for t in (k, v))
        scores = torch.einsum("qhd,khd->hqk", q[q_start : q_start + q_len].double(), keys) * scale
        q_pos = torch.arange(q_len).unsqueeze(1) + kv_len - q_len
        k_pos = torch.arange(kv_len).unsqueeze(0)
        seen = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window > 0 else True)
        out[q_start : q_start + q_len] = torch.einsum("hqk,khd->qhd", scores.masked_fill(~seen, -math.inf).softmax(-1),
                                                      values)
    return out


@pytest.mark.parametrize("isa", LEVELS)
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("dim, heads, kv_heads", [(64, 9, 3), (128, 8, 2), (48, 4, 4)])
@pytest.mark.parametrize("requests", [[(70, 0)], [(100, 50), (1, 30), (33, 0), (17, 200)]])  # (new, cached)
def test_kernel_window_matches_reference(isa, dtype, atol, dim, heads, kv_heads, requests):
    kernel = kernel_at(isa)
    g = torch.Generator().manual_seed(dim + len(requests))
    total_ctx = sum(n + p for n, p in requests)
    k, v = (torch.randn(total_ctx + 20, kv_heads, dim, generator=g).to(dtype) for _ in "kv")
    slots = torch.randperm(total_ctx + 20, generator=g)[:total_ctx].to(torch.int32)  # scattered pool slots
    q = torch.randn(sum(n for n, _ in requests), heads, dim, generator=g).to(dtype)
    rows, q_start, kv_start = [], 0, 0
    for new, cached in requests:
        rows.append((q_start, new, kv_start, new + cached))
        q_start, kv_start = q_start + new, kv_start + new + cached
    reqs = torch.tensor(rows, dtype=torch.int64)
    for window in (1, 7, 16, 40, 129, 1000, 0):  # 1000 and 0 (none): nothing hidden
        out, lse = kernel.extend(q, k, v, slots, reqs, dim**-0.5, with_lse=True, window=window)
        ref = _reference(q, k, v, slots, reqs, dim**-0.5, window)
        assert torch.allclose(out.double(), ref, atol=atol), (window, (out.double() - ref).abs().max())
        assert torch.isfinite(lse).all()
    causal, _ = kernel.extend(q, k, v, slots, reqs, dim**-0.5)
    assert torch.equal(causal, kernel.extend(q, k, v, slots, reqs, dim**-0.5, window=10_000)[0])


@pytest.mark.parametrize("isa", LEVELS)
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("prefix_lens, extend_lens", [([0, 0], [80, 9]), ([0, 5, 30, 12], [40, 3, 1, 20])])
def test_backend_routes_window_extend_through_kernel(isa, dtype, atol, prefix_lens, extend_lens, monkeypatch):
    kernel = force_level(isa, monkeypatch)
    select_everything(monkeypatch)
    window, kv_heads, heads, dim = 16, 2, 6, 64
    seq_lens = [p + n for p, n in zip(prefix_lens, extend_lens, strict=True)]
    pool, table, rows, g = _setup(seq_lens, kv_heads, dtype, dim=dim)
    q = torch.randn(sum(extend_lens), heads, dim, generator=g).to(dtype)
    locs = torch.cat([table.req_to_token[r, p:s].long() for r, p, s in zip(rows, prefix_lens, seq_lens, strict=True)])
    k_new, v_new = pool.k_buffer[0][locs].clone(), pool.v_buffer[0][locs].clone()
    fb = ForwardBatch.for_extend([5] * len(locs), rows, prefix_lens, extend_lens, locs, "cpu")
    fb.req_to_token_pool, fb.token_to_kv_pool = table, pool
    layer = RadixAttention(0, heads, kv_heads, dim, dim**-0.5, sliding_window=window)
    backend = create_attention_backend("cpu", torch.device("cpu"), windows=(window,))
    meta = backend.init_forward_metadata(fb)
    assert window in meta.window_extend and backend.extend_kernel is not None
    windows: list[int] = []
    real_extend = type(backend.extend_kernel).extend

    def spy(self, *args, **kwargs):
        windows.append(kwargs.get("window", 0))
        return real_extend(self, *args, **kwargs)

    monkeypatch.setattr(type(backend.extend_kernel), "extend", spy)
    got = backend.forward(q, k_new, v_new, layer, fb).view(-1, heads, dim).double()
    assert windows == [window] and backend.extend_kernel.isa == kernel.isa
    torch_backend = create_attention_backend("torch", torch.device("cpu"), windows=(window,))
    torch_backend.init_forward_metadata(fb)
    want = torch_backend.forward(q.float(), k_new.float(), v_new.float(), layer, _as_float(fb, pool, table))
    assert torch.allclose(got, want.view(-1, heads, dim).double(), atol=atol)


def _as_float(fb: ForwardBatch, pool, table) -> ForwardBatch:
    """fb over a float32 copy of the pool (the banded SDPA reference runs in float32)."""
    from radixserve.mem_cache.memory_pool import MHATokenToKVPool

    k, v = pool.k_buffer[0], pool.v_buffer[0]
    copy = MHATokenToKVPool(pool.size, pool.page_size, torch.float32, k.shape[1], k.shape[2], 1, "cpu")
    copy.k_buffer[0].copy_(k.float())
    copy.v_buffer[0].copy_(v.float())
    fb.token_to_kv_pool = copy
    return fb
