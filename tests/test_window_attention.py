"""Sliding-window attention in every path a window layer takes, against a naive windowed reference in float64:
decode on the torch paths (block-diagonal, head-major) and the C decode kernel at each level, extend (banded
SDPA) on the torch and CPU backends, with cascade forced on (window cascade in depth: test_window_cascade.py), and
contexts longer and shorter than the window."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_levels import LEVELS, force_level, select_everything
from test_model_attention import _setup
from test_model_support import one_torch_thread

from radixserve.configs.row_table import CascadePolicy
from radixserve.forward_batch import ForwardBatch
from radixserve.layers.attention import create_attention_backend
from radixserve.layers.attention.base import AttentionPlan
from radixserve.layers.attention.torch_backend import TorchAttnBackend
from radixserve.layers.radix_attention import RadixAttention

_single_thread = pytest.fixture(scope="module", autouse=True)(one_torch_thread)

DIM, W = 32, 16


def _windowed_reference(q: torch.Tensor, pool, table, row: int, kv_heads: int, first_pos: int,
                        window: int | None) -> torch.Tensor:
    """q [n, heads, dim] at positions first_pos..: query at p sees positions max(0, p - window + 1) .. p."""
    group = q.shape[1] // kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    for i in range(q.shape[0]):
        pos = first_pos + i
        lo = 0 if window is None else max(0, pos - window + 1)
        slots = table.req_to_token[row, lo : pos + 1].long()
        k, v = pool.k_buffer[0][slots].double(), pool.v_buffer[0][slots].double()
        for h in range(q.shape[1]):
            scores = (k[:, h // group] @ q[i, h].double()) / math.sqrt(DIM)
            out[i, h] = torch.softmax(scores, 0) @ v[:, h // group]
    return out


def _decode(seq_lens, kv_heads, heads, dtype=torch.float32, seed=0):
    pool, table, rows, g = _setup(seq_lens, kv_heads, dtype, seed=seed)
    q = torch.randn(len(seq_lens), heads, DIM, generator=g).to(dtype)
    last = torch.stack([table.req_to_token[r, n - 1] for r, n in zip(rows, seq_lens, strict=True)]).long()
    fb = ForwardBatch.for_decode([5] * len(rows), rows, seq_lens, last, "cpu")
    fb.req_to_token_pool, fb.token_to_kv_pool = table, pool
    k_new, v_new = pool.k_buffer[0][last].clone(), pool.v_buffer[0][last].clone()
    return q, k_new, v_new, fb, (pool, table, rows)


def _decode_refs(q, state, seq_lens, kv_heads, window):
    pool, table, rows = state
    return torch.stack([_windowed_reference(q[i : i + 1], pool, table, r, kv_heads, n - 1, window)[0]
                        for i, (r, n) in enumerate(zip(rows, seq_lens, strict=True))])


@pytest.mark.parametrize("kv_heads, heads", [(1, 4), (2, 6), (8, 8)])  # block-diagonal twice, head-major
@pytest.mark.parametrize("seq_lens", [[1, 37, 9, 70], [40, 40], [3, 16, 12]])  # the last: nothing to hide
def test_torch_decode_with_window(kv_heads, heads, seq_lens):
    q, k_new, v_new, fb, state = _decode(seq_lens, kv_heads, heads)
    backend = TorchAttnBackend(plan=AttentionPlan("torch", windows=(W,)))
    meta = backend.init_forward_metadata(fb)
    assert (W in meta.window_decode) == (max(seq_lens) > W)
    window_layer = RadixAttention(0, heads, kv_heads, DIM, DIM**-0.5, sliding_window=W)
    got = backend.forward(q, k_new, v_new, window_layer, fb).view(len(seq_lens), heads, DIM)
    assert torch.allclose(got.double(), _decode_refs(q, state, seq_lens, kv_heads, W), atol=1e-5)
    full = backend.forward(q, k_new, v_new, RadixAttention(0, heads, kv_heads, DIM, DIM**-0.5), fb)
    assert torch.allclose(full.view_as(got).double(), _decode_refs(q, state, seq_lens, kv_heads, None), atol=1e-5)


@pytest.mark.parametrize("isa", LEVELS)
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 8e-3)])
def test_c_decode_kernel_with_window(isa, dtype, atol, monkeypatch):
    force_level(isa, monkeypatch)
    select_everything(monkeypatch)
    seq_lens, kv_heads, heads = [3, 130, 64, 17, 1], 2, 6
    q, k_new, v_new, fb, state = _decode(seq_lens, kv_heads, heads, dtype)
    backend = create_attention_backend("cpu", torch.device("cpu"), windows=(W,))
    assert backend.decode_kernel is not None and backend.plan.uses("decode", dtype)
    backend.init_forward_metadata(fb)
    got = backend.forward(q, k_new, v_new, RadixAttention(0, heads, kv_heads, DIM, DIM**-0.5, sliding_window=W), fb)
    ref = _decode_refs(q, state, seq_lens, kv_heads, W)
    assert torch.allclose(got.view(len(seq_lens), heads, DIM).double(), ref, atol=atol)


def _extend(prefix_lens, extend_lens, kv_heads, heads, seed=0):
    seq_lens = [p + n for p, n in zip(prefix_lens, extend_lens, strict=True)]
    pool, table, rows, g = _setup(seq_lens, kv_heads, seed=seed)
    q = torch.randn(sum(extend_lens), heads, DIM, generator=g)
    locs = torch.cat([table.req_to_token[r, p:s].long() for r, p, s in zip(rows, prefix_lens, seq_lens, strict=True)])
    k_new, v_new = pool.k_buffer[0][locs].clone(), pool.v_buffer[0][locs].clone()
    fb = ForwardBatch.for_extend([5] * len(locs), rows, prefix_lens, extend_lens, locs, "cpu")
    fb.req_to_token_pool, fb.token_to_kv_pool = table, pool
    return q, k_new, v_new, fb, (pool, table, rows)


def _extend_refs(q, state, prefix_lens, extend_lens, kv_heads, window):
    pool, table, rows = state
    refs, start = [], 0
    for row, p, n in zip(rows, prefix_lens, extend_lens, strict=True):
        refs.append(_windowed_reference(q[start : start + n], pool, table, row, kv_heads, p, window))
        start += n
    return torch.cat(refs)


@pytest.mark.parametrize("backend_name", ["torch", "cpu"])
@pytest.mark.parametrize("prefix_lens, extend_lens", [([0, 0], [40, 9]), ([0, 5, 30, 12], [40, 3, 1, 20]),
                                                      ([0, 4], [10, 3])])  # the last: nothing to hide
def test_extend_with_window(backend_name, prefix_lens, extend_lens):
    kv_heads, heads = 2, 4
    q, k_new, v_new, fb, state = _extend(prefix_lens, extend_lens, kv_heads, heads)
    backend = create_attention_backend(backend_name, torch.device("cpu"), windows=(W,))
    backend.init_forward_metadata(fb)
    layer = RadixAttention(0, heads, kv_heads, DIM, DIM**-0.5, sliding_window=W)
    got = backend.forward(q, k_new, v_new, layer, fb).view(-1, heads, DIM).double()
    assert torch.allclose(got, _extend_refs(q, state, prefix_lens, extend_lens, kv_heads, W), atol=1e-5)


@pytest.mark.parametrize("backend_name", ["torch", "cpu"])
def test_cascade_batches_keep_window_layers_windowed(backend_name):
    """Every request shares a 24-token prefix; cascade runs for the full layer, and for the window layer cut to W
    (the shared positions 9 .. 23, which the first queries' windows reach): both equal the reference."""
    kv_heads, heads, shared = 2, 4, 24
    prefix_lens, extend_lens = [shared, shared, shared + 6], [5, 12, 2]
    q, k_new, v_new, fb, state = _extend(prefix_lens, extend_lens, kv_heads, heads)
    table = state[1].req_to_token
    for row in state[2][1:]:
        table[row, :shared] = table[state[2][0], :shared]
    backend = create_attention_backend(backend_name, torch.device("cpu"), windows=(W,))
    backend.cascade = CascadePolicy(min_prefix=8)
    meta = backend.init_forward_metadata(fb)
    assert meta.cascade_extend is not None
    assert meta.window_extend[W].prefix_slots.shape == (shared - 9,)  # a = 24 - 16 + 1
    for window in (W, None):
        layer = RadixAttention(0, heads, kv_heads, DIM, DIM**-0.5, sliding_window=window)
        got = backend.forward(q, k_new, v_new, layer, fb).view(-1, heads, DIM).double()
        assert torch.allclose(got, _extend_refs(q, state, prefix_lens, extend_lens, kv_heads, window), atol=1e-5)


def test_window_layer_needs_the_plan_to_name_its_window():
    q, k_new, v_new, fb, _ = _decode([40, 3], 1, 4)
    backend = TorchAttnBackend()
    backend.init_forward_metadata(fb)
    with pytest.raises(ValueError, match="sliding window 16"):
        backend.forward(q, k_new, v_new, RadixAttention(0, 4, 1, DIM, DIM**-0.5, sliding_window=W), fb)
    with pytest.raises(ValueError, match="at least 1"):
        RadixAttention(0, 4, 1, DIM, DIM**-0.5, sliding_window=0)
