"""The Triton attention kernels and backend against a float64 reference, on the CPU in Triton's interpreter
(TRITON_INTERPRET=1, set here before triton is imported; on a CUDA machine the same tests run compiled).

Page sizes 1 and 16 (slots laid out page by page, two requests sharing their first pages as the radix cache shares
a prefix), GQA ratios 1 to 4, sliding windows, soft-capped scores, a hybrid pool's slot translation, ragged batches
and cached prefixes. The interpreter runs a program at a time in numpy, so every shape is tiny; the wider sweep is
under `long`."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # NOTE: read when the kernels are decorated: before the import
pytest.importorskip("triton")

from radixserve.forward_batch import ForwardBatch  # noqa: E402
from radixserve.layers.attention.torch_backend import TorchAttnBackend  # noqa: E402
from radixserve.layers.attention.triton_backend import TritonAttnBackend, TritonAttnMetadata  # noqa: E402
from radixserve.layers.attention.triton_ops.decode_attention import decode_attention  # noqa: E402
from radixserve.layers.attention.triton_ops.extend_attention import extend_attention  # noqa: E402
from radixserve.layers.radix_attention import RadixAttention  # noqa: E402
from radixserve.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CPU_DEVICE = torch.device("cpu")
DIM = 16
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def _slot_rows(seq_lens: list[int], page: int, shared: int, generator: torch.Generator) -> torch.Tensor:
    """int32 [bs, width]: each request's slots by position, whole pages drawn at random from the pool's pages 1..;
    every request's first `shared` positions (whole pages) are request 0's (a cached prefix the tree shares)."""
    width = max(seq_lens)
    pages_needed = sum(-(-n // page) for n in seq_lens)
    pages = (torch.randperm(pages_needed + 4, generator=generator)[:pages_needed] + 1).tolist()
    rows = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    for b, n in enumerate(seq_lens):
        for pos in range(n):
            if pos % page == 0:
                current = pages.pop()
            rows[b, pos] = current * page + pos % page
        if b and shared:
            rows[b, :shared] = rows[0, :shared]
    return rows


def _buffers(rows: torch.Tensor, page: int, kv_heads: int, dtype: torch.dtype, generator: torch.Generator):
    slots = (int(rows.max()) // page + 2) * page
    k = torch.randn(slots, kv_heads, DIM, generator=generator).to(dtype)
    v = torch.randn(slots, kv_heads, DIM, generator=generator).to(dtype)
    return k, v


def _reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, q_positions: torch.Tensor,
               window: int | None, cap: float | None) -> torch.Tensor:
    """float64: q [n, heads, dim] at `q_positions` over keys/values [m, kv_heads, dim] at positions 0..m-1."""
    heads, kv_heads = q.shape[1], keys.shape[1]
    k = keys.double().repeat_interleave(heads // kv_heads, 1)
    v = values.double().repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("nhd,mhd->hnm", q.double(), k) * DIM**-0.5
    if cap is not None:
        scores = cap * torch.tanh(scores / cap)
    pos = torch.arange(keys.shape[0])
    visible = pos[None, :] <= q_positions[:, None]
    if window is not None:
        visible &= pos[None, :] > q_positions[:, None] - window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hnm,mhd->nhd", torch.softmax(scores, -1), v)


DECODE_CASES = [  # page, kv_heads, group, seq_lens, window, cap, dtype, splits
    (1, 2, 1, [1, 9, 33], None, None, torch.float32, 4),
    (16, 1, 3, [40, 17, 5], 8, None, torch.float32, 3),
    (16, 2, 4, [20, 31], 12, 5.0, torch.bfloat16, 2),
]


@pytest.mark.parametrize("page, kv_heads, group, seq_lens, window, cap, dtype, splits", DECODE_CASES)
def test_decode_matches_float64(page, kv_heads, group, seq_lens, window, cap, dtype, splits):
    _check_decode(page, kv_heads, group, seq_lens, window, cap, dtype, splits, translate=False)


def test_decode_translates_hybrid_window_slots():
    """A hybrid pool's window layer: each slot is read at full_to_window[slot] (a permutation here)."""
    _check_decode(16, 2, 2, [30, 7], 10, None, torch.float32, 2, translate=True)


def _check_decode(page, kv_heads, group, seq_lens, window, cap, dtype, splits, translate):
    gen = torch.Generator().manual_seed(len(seq_lens) * 31 + page)
    rows = _slot_rows(seq_lens, page, shared=page if min(seq_lens) > page else 0, generator=gen)
    k_buf, v_buf = _buffers(rows, page, kv_heads, dtype, gen)
    table = None
    if translate:  # NOTE: the buffers are indexed by window slot; rows name full slots
        table = torch.randperm(k_buf.shape[0], generator=gen).to(torch.int32)
    q = torch.randn(len(seq_lens), kv_heads * group, DIM, generator=gen).to(dtype)
    out = decode_attention(q.to(DEVICE), k_buf.to(DEVICE), v_buf.to(DEVICE), rows.to(DEVICE),
                           torch.tensor(seq_lens, device=DEVICE), DIM**-0.5, splits, window, cap,
                           None if table is None else table.to(DEVICE)).cpu()
    assert out.dtype == dtype
    for b, n in enumerate(seq_lens):
        slots = rows[b, :n].long()
        if table is not None:
            slots = table[slots].long()
        want = _reference(q[b : b + 1], k_buf[slots], v_buf[slots], torch.tensor([n - 1]), window, cap)
        assert torch.allclose(out[b : b + 1].double(), want, atol=TOLERANCE[dtype]), (b, n)


EXTEND_CASES = [  # page, kv_heads, group, prefix_lens, extend_lens, window, cap, dtype
    (1, 2, 1, [0, 0], [5, 19], None, None, torch.float32),
    (16, 1, 2, [32, 16, 0], [7, 1, 20], 12, None, torch.float32),
    (16, 2, 2, [16, 3], [18, 4], None, 8.0, torch.bfloat16),
]


@pytest.mark.parametrize("page, kv_heads, group, prefix_lens, extend_lens, window, cap, dtype", EXTEND_CASES)
def test_extend_matches_float64(page, kv_heads, group, prefix_lens, extend_lens, window, cap, dtype):
    _check_extend(page, kv_heads, group, prefix_lens, extend_lens, window, cap, dtype)


def _check_extend(page, kv_heads, group, prefix_lens, extend_lens, window, cap, dtype, block=16):
    gen = torch.Generator().manual_seed(sum(prefix_lens) + page)
    seq_lens = [p + n for p, n in zip(prefix_lens, extend_lens, strict=True)]
    rows = _slot_rows(seq_lens, page, shared=min(prefix_lens) // page * page, generator=gen)
    k_buf, v_buf = _buffers(rows, page, kv_heads, dtype, gen)
    tokens, heads = sum(extend_lens), kv_heads * group
    q = torch.randn(tokens, heads, DIM, generator=gen).to(dtype)
    starts = torch.tensor([0, *torch.tensor(extend_lens).cumsum(0)[:-1].tolist()])
    new_slots = torch.cat([rows[b, p:s] for b, (p, s) in enumerate(zip(prefix_lens, seq_lens, strict=True))]).long()
    k_new, v_new = k_buf[new_slots], v_buf[new_slots]
    args = [t.to(DEVICE) for t in (q, k_new, v_new, k_buf, v_buf, rows, torch.tensor(prefix_lens),
                                   torch.tensor(extend_lens), starts)]
    out = extend_attention(*args, max(extend_lens), DIM**-0.5, window, cap, block_m=block, block_n=block).cpu()
    for b, (p, s) in enumerate(zip(prefix_lens, seq_lens, strict=True)):
        slots = rows[b, :s].long()
        want = _reference(q[starts[b] : starts[b] + s - p], k_buf[slots], v_buf[slots], torch.arange(p, s),
                          window, cap)
        got = out[starts[b] : starts[b] + s - p].double()
        assert torch.allclose(got, want, atol=TOLERANCE[dtype]), (b, (got - want).abs().max())


def _batch(mode: str, prefix_lens: list[int], extend_lens: list[int], kv_heads: int, heads: int):
    """A ForwardBatch over real pools (page size 1), new K/V already in the pool, and its q, k, v."""
    gen = torch.Generator().manual_seed(7)
    seq_lens = [p + n for p, n in zip(prefix_lens, extend_lens, strict=True)]
    pool = MHATokenToKVPool(256, 1, torch.float32, kv_heads, DIM, 1, DEVICE)
    req_to_token = ReqToTokenPool(4, 64, DEVICE)
    rows = _slot_rows(seq_lens, 1, 0, gen)
    for b, n in enumerate(seq_lens):
        req_to_token.req_to_token[b + 1, :n] = rows[b, :n].to(DEVICE)
        pool.k_buffer[0][rows[b, :n].long()] = torch.randn(n, kv_heads, DIM, generator=gen).to(DEVICE)
        pool.v_buffer[0][rows[b, :n].long()] = torch.randn(n, kv_heads, DIM, generator=gen).to(DEVICE)
    new = torch.cat([rows[b, p:s] for b, (p, s) in enumerate(zip(prefix_lens, seq_lens, strict=True))])
    indices = list(range(1, len(seq_lens) + 1))
    if mode == "decode":
        fb = ForwardBatch.for_decode(None, indices, seq_lens, new, DEVICE)
    else:
        fb = ForwardBatch.for_extend([0] * len(new), indices, prefix_lens, extend_lens, new, DEVICE)
    fb.req_to_token_pool, fb.token_to_kv_pool = req_to_token, pool
    q = torch.randn(len(new), heads, DIM, generator=gen).to(DEVICE)
    k, v = pool.k_buffer[0][new.long()].clone(), pool.v_buffer[0][new.long()].clone()
    return q, k, v, fb


@pytest.mark.parametrize("mode, prefix_lens, extend_lens", [("decode", [4, 30], [1, 1]),
                                                            ("extend", [0, 21], [6, 9])])
def test_backend_matches_the_torch_backend(mode, prefix_lens, extend_lens):
    """Through ForwardBatch: the typed metadata on the batch, the K/V write, the kernels, the output shape."""
    q, k, v, fb = _batch(mode, prefix_lens, extend_lens, kv_heads=1, heads=3)
    layer = RadixAttention(0, 3, 1, DIM, DIM**-0.5)
    triton_backend, torch_backend = TritonAttnBackend(), TorchAttnBackend(use_cascade=False)
    meta = triton_backend.init_forward_metadata(fb)
    assert isinstance(meta, TritonAttnMetadata) and fb.attn_metadata is meta and not meta.graph
    got = triton_backend.forward(q, k, v, layer, fb)
    torch_backend.init_forward_metadata(fb)
    want = torch_backend.forward(q, k, v, layer, fb)
    assert got.shape == (q.shape[0], 3 * DIM)
    assert torch.allclose(got, want, atol=2e-5)


def test_metadata_is_a_copy_of_the_rows():
    """The overlap loop may rewrite req_to_token once init_forward_metadata returns: the table must not alias it."""
    _, _, _, fb = _batch("decode", [5, 9], [1, 1], kv_heads=1, heads=1)
    meta = TritonAttnBackend().init_forward_metadata(fb)
    before = meta.table.clone()
    fb.req_to_token_pool.req_to_token.fill_(0)
    assert torch.equal(meta.table, before) and before.shape == (2, 10)


@pytest.mark.long
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("window, cap", [(None, None), (5, None), (None, 10.0), (24, 3.0)])
def test_sweep(page, group, window, cap):
    for dtype in (torch.float32, torch.bfloat16):
        _check_decode(page, 2, group, [1, 16, 17, 70], window, cap, dtype, 4, translate=False)
        _check_extend(page, 2, group, [0, 32, 48], [33, 1, 17], window, cap, dtype, block=32)


@pytest.mark.skipif(DEVICE.type == "cuda", reason="CPU batches: on a GPU, test_cuda_graphs.py runs Gemma 3's hybrid pool")
@pytest.mark.parametrize("mode", ["decode", "extend"])
def test_hybrid_pool_window_layer_matches_the_torch_backend(mode):
    """A window layer over a hybrid pool: window slots through full_to_window, positions outside every window
    tombstoned (their window slot is 0, holding junk that a read would show)."""
    from test_cascade_attention import _decode_batch, _extend_batch
    from test_window_cascade import W, _hybrid

    from radixserve.layers.attention.base import AttentionPlan

    if mode == "decode":
        batch = _decode_batch(40, [1, 30, 3], 1, 2, DIM, torch.float32)
    else:
        batch = _extend_batch(40, [40, 52], [7, 20], 1, 2, DIM, torch.float32)
    row = batch[3].req_to_token_pool.req_to_token[batch[3].req_pool_indices[0]]
    q, k, v, fb = _hybrid(batch, row[:20])  # NOTE: every query's window starts past position 20
    layer = RadixAttention(0, 2, 1, DIM, DIM**-0.5, sliding_window=W)
    triton_backend = TritonAttnBackend(num_kv_splits=2)
    meta = triton_backend.init_forward_metadata(fb)
    assert torch.equal(meta.window_out_loc, fb.token_to_kv_pool.full_to_window[fb.out_cache_loc.long()])
    got = triton_backend.forward(q, k, v, layer, fb)
    torch_backend = TorchAttnBackend(use_cascade=False, plan=AttentionPlan("torch", False, windows=(W,)))
    torch_backend.init_forward_metadata(fb)
    want = torch_backend.forward(q, k, v, layer, fb)
    assert torch.allclose(got, want, atol=2e-5)


def test_auto_picks_triton_on_cuda_and_the_plan_says_why():
    from radixserve.layers.attention.registry import plan_attention, resolve_with_reason
    from radixserve.model_executor.execution_plan import _attention_entries, _cascade_refusal
    from radixserve.server_args import ServerArgs

    cuda = torch.device("cuda")  # NOTE: only its type is read
    name, reason = resolve_with_reason("auto", cuda)
    assert name == "triton" and "auto on CUDA" in reason
    assert resolve_with_reason("auto", CPU_DEVICE)[0] == "cpu"
    plan = plan_attention("auto", cuda, cascade=True, windows=(8,))
    assert plan.backend == "triton" and not plan.cascade and plan.windows == (8,)
    args = ServerArgs()
    no_cascade = _cascade_refusal(args, cuda, torch.bfloat16, None)
    assert "no cascade path" in no_cascade
    entries = {e.part: e for e in _attention_entries(plan, torch.bfloat16, args, no_cascade)}
    assert entries["attention backend"].choice == "triton" and entries["attention backend"].reason == reason
    assert entries["attention decode"].choice.startswith("triton split-K")
    assert entries["attention shared prefix"].choice == "off"
