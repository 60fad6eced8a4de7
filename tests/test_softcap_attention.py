"""Soft-capped attention (layers/attention/softcap.py) against a naive capped reference in float64: decode and
extend, with and without a window, GQA and MHA, on the torch and CPU backends (whose C kernels cannot cap, so a
capped layer must never reach them), with cascade forced on, and through the hybrid pool's window slots."""

from __future__ import annotations

import math

import pytest
import torch
from test_model_support import one_torch_thread
from test_window_attention import DIM, W, _decode, _extend

from radixserve.configs.row_table import CascadePolicy
from radixserve.layers.attention import create_attention_backend, softcap
from radixserve.layers.radix_attention import RadixAttention

_single_thread = pytest.fixture(scope="module", autouse=True)(one_torch_thread)

CAP = 1.5  # scores of random q/k are ~N(0, 1) here: a cap this low changes every row


def _capped_reference(q: torch.Tensor, pool, table, row: int, kv_heads: int, first_pos: int, window: int | None,
                      cap: float | None) -> torch.Tensor:
    """q [n, heads, dim] at positions first_pos..: query at p sees max(0, p - window + 1) .. p, scores capped."""
    group = q.shape[1] // kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    for i in range(q.shape[0]):
        pos = first_pos + i
        lo = 0 if window is None else max(0, pos - window + 1)
        slots = table.req_to_token[row, lo : pos + 1].long()
        k, v = pool.k_buffer[0][slots].double(), pool.v_buffer[0][slots].double()
        for h in range(q.shape[1]):
            scores = (k[:, h // group] @ q[i, h].double()) / math.sqrt(DIM)
            if cap is not None:
                scores = cap * torch.tanh(scores / cap)
            out[i, h] = torch.softmax(scores, 0) @ v[:, h // group]
    return out


def _decode_refs(q, state, seq_lens, kv_heads, window, cap=CAP):
    pool, table, rows = state
    return torch.stack([_capped_reference(q[i : i + 1], pool, table, r, kv_heads, n - 1, window, cap)[0]
                        for i, (r, n) in enumerate(zip(rows, seq_lens, strict=True))])


def _extend_refs(q, state, prefix_lens, extend_lens, kv_heads, window, cap=CAP):
    pool, table, rows = state
    refs, start = [], 0
    for row, p, n in zip(rows, prefix_lens, extend_lens, strict=True):
        refs.append(_capped_reference(q[start : start + n], pool, table, row, kv_heads, p, window, cap))
        start += n
    return torch.cat(refs)


def _layer(heads: int, kv_heads: int, window: int | None, cap: float | None = CAP) -> RadixAttention:
    return RadixAttention(0, heads, kv_heads, DIM, DIM**-0.5, sliding_window=window, logit_cap=cap)


@pytest.mark.parametrize("backend_name", ["torch", "cpu"])
@pytest.mark.parametrize("kv_heads, heads", [(1, 4), (2, 6), (4, 4)])
@pytest.mark.parametrize("window", [None, W])
def test_capped_decode(backend_name, kv_heads, heads, window):
    seq_lens = [1, 37, 9, 70, 16]
    q, k_new, v_new, fb, state = _decode(seq_lens, kv_heads, heads)
    backend = create_attention_backend(backend_name, torch.device("cpu"), windows=(W,))
    backend.init_forward_metadata(fb)
    got = backend.forward(q, k_new, v_new, _layer(heads, kv_heads, window), fb).view(len(seq_lens), heads, DIM)
    want = _decode_refs(q, state, seq_lens, kv_heads, window)
    assert torch.allclose(got.double(), want, atol=1e-5)
    # NOTE: the cap changes the answer (else this could not tell capped from plain attention)
    assert not torch.allclose(want, _decode_refs(q, state, seq_lens, kv_heads, window, cap=None), atol=1e-2)


@pytest.mark.parametrize("backend_name", ["torch", "cpu"])
@pytest.mark.parametrize("kv_heads, heads", [(1, 4), (2, 4)])
@pytest.mark.parametrize("window", [None, W])
@pytest.mark.parametrize("prefix_lens, extend_lens", [([0, 0], [40, 9]), ([0, 5, 30, 12], [40, 3, 1, 20])])
def test_capped_extend(backend_name, kv_heads, heads, window, prefix_lens, extend_lens):
    q, k_new, v_new, fb, state = _extend(prefix_lens, extend_lens, kv_heads, heads)
    backend = create_attention_backend(backend_name, torch.device("cpu"), windows=(W,))
    backend.init_forward_metadata(fb)
    got = backend.forward(q, k_new, v_new, _layer(heads, kv_heads, window), fb).view(-1, heads, DIM).double()
    assert torch.allclose(got, _extend_refs(q, state, prefix_lens, extend_lens, kv_heads, window), atol=1e-5)


def test_capped_extend_in_query_blocks(monkeypatch):
    """Long requests' queries go in blocks (SCORE_BLOCK_ELEMENTS); here blocks of a few rows, with a window."""
    monkeypatch.setattr(softcap, "SCORE_BLOCK_ELEMENTS", 4 * 60)
    prefix_lens, extend_lens, kv_heads, heads = [0, 12], [45, 17], 2, 4
    q, k_new, v_new, fb, state = _extend(prefix_lens, extend_lens, kv_heads, heads)
    backend = create_attention_backend("torch", torch.device("cpu"), windows=(W,))
    backend.init_forward_metadata(fb)
    for window in (None, W):
        got = backend.forward(q, k_new, v_new, _layer(heads, kv_heads, window), fb).view(-1, heads, DIM).double()
        assert torch.allclose(got, _extend_refs(q, state, prefix_lens, extend_lens, kv_heads, window), atol=1e-5)


def test_cascade_batches_leave_capped_layers_capped():
    """A backend with cascade forced on (the plan turns it off for capped models): capped layers still cap."""
    kv_heads, heads, shared = 2, 4, 24
    prefix_lens, extend_lens = [shared, shared, shared], [5, 12, 2]
    q, k_new, v_new, fb, state = _extend(prefix_lens, extend_lens, kv_heads, heads)
    table = state[1].req_to_token
    for row in state[2][1:]:
        table[row, :shared] = table[state[2][0], :shared]
    backend = create_attention_backend("cpu", torch.device("cpu"), windows=(W,))
    backend.cascade = CascadePolicy(min_prefix=8)
    meta = backend.init_forward_metadata(fb)
    assert meta.cascade_extend is not None and meta.extend is None
    for window in (W, None):
        got = backend.forward(q, k_new, v_new, _layer(heads, kv_heads, window), fb).view(-1, heads, DIM).double()
        assert torch.allclose(got, _extend_refs(q, state, prefix_lens, extend_lens, kv_heads, window), atol=1e-5)


def test_cascade_decode_batches_leave_capped_layers_capped():
    kv_heads, heads, shared, seq_lens = 2, 4, 24, [30, 41, 27]
    q, k_new, v_new, fb, state = _decode(seq_lens, kv_heads, heads)
    table = state[1].req_to_token
    for row in state[2][1:]:
        table[row, :shared] = table[state[2][0], :shared]
    backend = create_attention_backend("cpu", torch.device("cpu"), windows=(W,))
    backend.cascade = CascadePolicy(min_prefix=8, min_decode_batch=2, min_decode_saved=1)
    meta = backend.init_forward_metadata(fb)
    assert meta.cascade_decode is not None and meta.decode is None
    for window in (W, None):
        got = backend.forward(q, k_new, v_new, _layer(heads, kv_heads, window), fb).view(-1, heads, DIM)
        assert torch.allclose(got.double(), _decode_refs(q, state, seq_lens, kv_heads, window), atol=1e-5)


def test_capped_decode_bf16_close_to_reference():
    seq_lens, kv_heads, heads = [5, 40, 21], 2, 4
    q, k_new, v_new, fb, state = _decode(seq_lens, kv_heads, heads, dtype=torch.bfloat16)
    backend = create_attention_backend("cpu", torch.device("cpu"), windows=(W,))
    backend.init_forward_metadata(fb)
    for window in (None, W):
        got = backend.forward(q, k_new, v_new, _layer(heads, kv_heads, window), fb).view(-1, heads, DIM)
        assert got.dtype == torch.bfloat16
        assert torch.allclose(got.double(), _decode_refs(q, state, seq_lens, kv_heads, window), atol=2e-2)


def test_logit_cap_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        RadixAttention(0, 4, 1, DIM, DIM**-0.5, logit_cap=0.0)
    assert not softcap.takes(RadixAttention(0, 4, 1, DIM, DIM**-0.5))
