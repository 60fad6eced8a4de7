"""Cascade attention: the batch's shared prefix attended once, merged by log-sum-exp, equals plain attention.

Unit tests compare the cascade path of a backend with the same backend with cascade off, on random
pools whose request rows share a forced prefix of scattered slots: the torch backend, its math path,
the CPU backend as its kernel selection has it (`cpu`), and the CPU backend with every C kernel at
each kernel level (`cpu-<level>`). The end-to-end test runs a W1-like
batch through the scheduler on the embedded model with cascade on and off.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from kernel_levels import force_level, select_everything
from test_model_support import one_torch_thread

from radixserve.configs.row_table import CascadePolicy
from radixserve.forward_batch import ForwardBatch
from radixserve.kernels.attention import load_decode_kernel
from radixserve.layers.attention import cascade, create_attention_backend
from radixserve.layers.attention.torch_backend import TorchAttnBackend
from radixserve.layers.radix_attention import RadixAttention
from radixserve.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from radixserve.platform import KERNEL_ISAS
from radixserve.server_args import ServerArgs

_single_thread = pytest.fixture(scope="module", autouse=True)(one_torch_thread)

MIN_PREFIX = 8  # the unit tests' threshold; the default is CascadePolicy().min_prefix
SMALL = CascadePolicy(min_prefix=MIN_PREFIX, min_decode_batch=2, min_decode_saved=0)
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _pool_and_rows(shared: int, own_lens: list[int], kv_heads: int, dim: int, dtype: torch.dtype, seed: int = 0):
    """A pool of random K/V; request rows = the same `shared` scattered slots, then their own slots."""
    g = torch.Generator().manual_seed(seed)
    size = shared + sum(own_lens) + 16
    pool = MHATokenToKVPool(size, 1, dtype, kv_heads, dim, 1, "cpu")
    pool.k_buffer[0].copy_(torch.randn(pool.k_buffer[0].shape, generator=g))
    pool.v_buffer[0].copy_(torch.randn(pool.v_buffer[0].shape, generator=g))
    slots = (torch.randperm(size - 1, generator=g) + 1).to(torch.int32)  # never slot 0
    table = ReqToTokenPool(len(own_lens), shared + max(own_lens) + 4, "cpu")
    rows = table.alloc(len(own_lens))
    offset = shared
    for row, n in zip(rows, own_lens, strict=True):
        table.req_to_token[row, :shared] = slots[:shared]
        table.req_to_token[row, shared : shared + n] = slots[offset : offset + n]
        offset += n
    return pool, table, rows, g


def _backends(name: str, policy: CascadePolicy = SMALL):
    """Cascade on and off. "torch-math": the torch backend on the path it takes off the CPU (set by _path);
    "cpu-<level>": the CPU backend at that kernel level."""
    name = "torch" if name == "torch-math" else name.split("-")[0]
    runner = SimpleNamespace(device=torch.device("cpu"))
    on, off = create_attention_backend(name, runner), create_attention_backend(name, runner)
    on.cascade, off.cascade = policy, None
    return on, off


def _path(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if name.startswith("cpu") and load_decode_kernel() is None:
        pytest.skip("no C compiler here, so the native kernel cannot be built")
    if name.startswith("cpu-"):  # every C kernel (prefix, seeded decode and extend) at this level
        force_level(name.removeprefix("cpu-"), monkeypatch)
        select_everything(monkeypatch)
    if name == "torch-math":  # no CPU flash op, and score blocks small enough to split every call
        monkeypatch.setattr(cascade, "_CPU_FLASH", None)
        monkeypatch.setattr(cascade, "MAX_SCORE_ELEMENTS", 2000)


def _decode_batch(shared: int, own_lens: list[int], kv_heads: int, heads: int, dim: int, dtype: torch.dtype):
    pool, table, rows, g = _pool_and_rows(shared, own_lens, kv_heads, dim, dtype)
    seq_lens = [shared + n for n in own_lens]
    last = torch.stack([table.req_to_token[r, n - 1] for r, n in zip(rows, seq_lens, strict=True)]).long()
    fb = ForwardBatch.for_decode([5] * len(rows), rows, seq_lens, last, "cpu")
    fb.req_to_token_pool, fb.token_to_kv_pool = table, pool
    q = torch.randn(len(rows), heads, dim, generator=g).to(dtype)
    return q, pool.k_buffer[0][last].clone(), pool.v_buffer[0][last].clone(), fb


def _extend_batch(shared: int, prefix_lens: list[int], extend_lens: list[int], kv_heads: int, heads: int, dim: int,
                  dtype: torch.dtype):
    """Request i has a cached prefix of prefix_lens[i] >= shared tokens, the first `shared` of them shared."""
    own = [p - shared + n for p, n in zip(prefix_lens, extend_lens, strict=True)]
    pool, table, rows, g = _pool_and_rows(shared, own, kv_heads, dim, dtype)
    locs = torch.cat([table.req_to_token[r, p : p + n].long() for r, p, n in zip(rows, prefix_lens, extend_lens,
                                                                                 strict=True)])
    fb = ForwardBatch.for_extend([5] * len(locs), rows, prefix_lens, extend_lens, locs, "cpu")
    fb.req_to_token_pool, fb.token_to_kv_pool = table, pool
    q = torch.randn(len(locs), heads, dim, generator=g).to(dtype)
    return q, pool.k_buffer[0][locs].clone(), pool.v_buffer[0][locs].clone(), fb


def _both(on, off, batch, layer: RadixAttention) -> tuple[torch.Tensor, torch.Tensor]:
    got, want, _ = _both_with_metadata(on, off, batch, layer)
    return got, want


def _both_with_metadata(on, off, batch, layer: RadixAttention) -> tuple[torch.Tensor, torch.Tensor, list]:
    """Both backends' outputs, and the metadata each built for the batch."""
    q, k, v, fb = batch
    outs, metas = [], []
    for backend in (on, off):
        metas.append(backend.init_forward_metadata(fb))
        outs.append(backend.forward(q, k, v, layer, fb))
    return outs[0], outs[1], metas


BACKENDS = ["torch", "torch-math", "cpu", *(f"cpu-{isa}" for isa in KERNEL_ISAS)]


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads, heads, dim", [(3, 9, 64), (2, 2, 32), (1, 4, 48)])  # 48: the C generic path
def test_decode_cascade_matches_plain(name, dtype, kv_heads, heads, dim, monkeypatch):
    _path(name, monkeypatch)
    on, off = _backends(name)
    layer = RadixAttention(0, heads, kv_heads, dim, dim**-0.5)
    for shared, own_lens in [(70, [1, 5, 3, 40]), (MIN_PREFIX, [2, 1]), (130, [64, 65, 1])]:
        got, want, (m_on, m_off) = _both_with_metadata(on, off, _decode_batch(shared, own_lens, kv_heads, heads, dim, dtype), layer)
        assert on.cascade_forwards["decode"] >= 1 and m_on.cascade_decode is not None
        assert off.cascade_forwards["decode"] == 0 and m_off.cascade_decode is None
        assert got.dtype == dtype
        assert torch.allclose(got.float(), want.float(), atol=TOLERANCE[dtype]), (shared, own_lens)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads, heads, dim", [(3, 9, 64), (1, 4, 48)])
def test_extend_cascade_matches_plain(name, dtype, kv_heads, heads, dim, monkeypatch):
    _path(name, monkeypatch)
    on, off = _backends(name)
    layer = RadixAttention(0, heads, kv_heads, dim, dim**-0.5)
    cases = [
        (40, [40, 40, 40], [7, 1, 20]),  # every cached prefix is exactly the shared part
        (40, [40, 52, 45], [3, 9, 1]),  # longer prefixes: part (b) has a shifted causal mask
        (MIN_PREFIX, [30, MIN_PREFIX], [16, 5]),
    ]
    for shared, prefix_lens, extend_lens in cases:
        batch = _extend_batch(shared, prefix_lens, extend_lens, kv_heads, heads, dim, dtype)
        got, want, (m_on, m_off) = _both_with_metadata(on, off, batch, layer)
        assert m_on.cascade_extend is not None and m_off.cascade_extend is None
        assert torch.allclose(got.float(), want.float(), atol=TOLERANCE[dtype]), (shared, prefix_lens)
    assert on.cascade_forwards["extend"] == len(cases)


def test_torch_math_path_matches_cpu_flash(monkeypatch):
    """The device-agnostic fallback of attention_with_lse (used off the CPU) against the CPU flash op."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, heads, n, 16, generator=g) for heads, n in ((6, 5), (2, 9), (2, 9)))
    bias = torch.zeros(2, 1, 1, 9).masked_fill_(torch.rand(2, 1, 1, 9, generator=g) > 0.7, float("-inf"))
    bias[..., 0] = 0  # no query row fully masked
    cases = [(k, v, {}), (k, v, {"bias": bias}), (k[:, :, :5], v[:, :, :5], {"causal": True})]
    want = [cascade.attention_with_lse(q, keys, values, 0.25, **kw) for keys, values, kw in cases]
    monkeypatch.setattr(cascade, "_CPU_FLASH", None)
    monkeypatch.setattr(cascade, "MAX_SCORE_ELEMENTS", 2 * 6 * 9 * 2)  # blocks of 2 query rows
    for (keys, values, kw), (out, lse) in zip(cases, want, strict=True):
        got_out, got_lse = cascade.attention_with_lse(q, keys, values, 0.25, **kw)
        assert torch.allclose(got_out, out, atol=1e-5) and torch.allclose(got_lse, lse, atol=1e-5), kw


def test_merge_partials_is_exact():
    g = torch.Generator().manual_seed(4)
    scores, values = torch.randn(3, 10, generator=g).double(), torch.randn(10, 4, generator=g).double()
    part = [(torch.softmax(s, -1) @ values[sl], torch.logsumexp(s, -1))
            for s, sl in ((scores[:, :6], slice(0, 6)), (scores[:, 6:], slice(6, 10)))]
    merged = cascade.merge_partials(part[0][0], part[0][1], part[1][0], part[1][1])
    assert torch.allclose(merged.double(), torch.softmax(scores, -1) @ values, atol=1e-6)
    empty = cascade.merge_partials(part[0][0], part[0][1], torch.zeros(3, 4), torch.full((3,), float("-inf")))
    assert torch.allclose(empty.double(), part[0][0], atol=1e-6)  # an empty part b leaves part a


def test_detection():
    on, _ = _backends("torch", CascadePolicy(min_prefix=16, min_decode_batch=2, min_decode_saved=0))
    q, k, v, fb = _decode_batch(40, [3, 5, 2], 1, 2, 16, torch.float32)
    table = fb.req_to_token_pool.req_to_token
    assert cascade.shared_prefix_len(fb, 42) == 40  # rows diverge right after the shared part
    assert cascade.shared_prefix_len(fb, 25) == 25  # all equal up to the limit
    table[fb.req_pool_indices[1], 23] = 0
    assert cascade.shared_prefix_len(fb, 42) == 23  # diverging in the middle
    meta = on.init_forward_metadata(fb)
    assert meta.cascade_decode.prefix_slots.shape == (23,) and on.cascade_forwards["decode"] == 1
    table[fb.req_pool_indices[2], 0] = 0
    assert cascade.shared_prefix_len(fb, 42) == 0
    meta = on.init_forward_metadata(fb)  # rows differ at slot 0: no cascade
    assert meta.cascade_decode is None and meta.decode is not None and on.cascade_forwards["decode"] == 1


def test_detection_thresholds_and_flag():
    policy = lambda **kw: CascadePolicy(**{"min_prefix": 40, "min_decode_batch": 2,  # noqa: E731
                                                   "min_decode_saved": 0, **kw})
    q, k, v, fb = _decode_batch(40, [3, 5], 1, 2, 16, torch.float32)
    assert cascade.plan_decode(fb, policy()) is not None
    assert cascade.plan_decode(fb, policy(min_prefix=41)) is None  # P < threshold
    assert cascade.plan_decode(fb, policy(min_decode_saved=40)) is not None  # (bs - 1) * P = 40 re-reads saved
    assert cascade.plan_decode(fb, policy(min_decode_saved=41)) is None
    assert cascade.plan_decode(fb, policy(min_decode_batch=3)) is None  # 2 requests
    one = ForwardBatch.for_decode([5], fb.req_pool_indices[:1].tolist(), fb.seq_lens_cpu[:1], fb.out_cache_loc[:1],
                                  "cpu")
    one.req_to_token_pool, one.token_to_kv_pool = fb.req_to_token_pool, fb.token_to_kv_pool
    assert cascade.plan_decode(one, policy(min_prefix=8)) is None  # bs == 1
    q, k, v, fb = _extend_batch(40, [40, 50], [3, 2], 1, 2, 16, torch.float32)
    assert cascade.plan_extend(fb, policy()) is not None
    fb.extend_prefix_lens_cpu = [39, 50]  # P is capped by the shortest cached prefix: queries see all of it
    assert cascade.plan_extend(fb, policy()) is None
    assert cascade.plan_extend(fb, policy(min_prefix=8)).prefix_slots.shape == (39,)
    flagged = create_attention_backend("torch", torch.device("cpu"),
                                       cascade=not ServerArgs(disable_cascade_attention=True).disable_cascade_attention)
    default = TorchAttnBackend()
    assert flagged.cascade is None and default.cascade == CascadePolicy()
    own = [3, 5, 1, 2] * (default.cascade.min_decode_batch // 4)
    long_prefix = _decode_batch(default.cascade.min_prefix + 10, own, 1, 2, 16, torch.float32)[3]
    assert (len(own) - 1) * (default.cascade.min_prefix + 10) >= default.cascade.min_decode_saved
    m_flagged, m_default = (backend.init_forward_metadata(long_prefix) for backend in (flagged, default))
    assert m_flagged.cascade_decode is None and flagged.cascade_forwards == {"decode": 0, "extend": 0}
    assert m_default.cascade_decode is not None and default.cascade_forwards["decode"] == 1


def test_prefix_slots_do_not_alias_the_table():
    """The overlap loop may rewrite req_to_token once init_forward_metadata returns."""
    on, _ = _backends("torch")
    q, k, v, fb = _decode_batch(20, [3, 5], 1, 2, 16, torch.float32)
    meta = on.init_forward_metadata(fb)
    before = meta.cascade_decode.prefix_slots.clone()
    fb.req_to_token_pool.req_to_token.fill_(0)
    assert torch.equal(meta.cascade_decode.prefix_slots, before)


SHARED = 40
# a W1-like batch: one shared prefix + short own questions of unequal lengths
W1_LIKE = [[1000 + (7 * i) % 5000 for i in range(SHARED)] + [3000 + 13 * r + i for i in range(4 + r)] for r in range(4)]
E2E_POLICY = CascadePolicy(min_prefix=32, min_decode_batch=2, min_decode_saved=64)  # NOTE: scaled down


@pytest.mark.slow
def test_end_to_end_shared_prefix_batch_matches_cascade_off(loaded):
    """W1_LIKE through the scheduler's normal loop on the embedded model, float32, greedy."""
    from test_scheduler import Harness

    prompts = W1_LIKE
    outputs, stats = [], []
    for disable in (False, True):
        h = Harness(loaded, max_total_tokens=1024, disable_cascade_attention=disable)
        backend = h.sched.model_runner.attn_backend
        if not disable:
            backend.cascade = E2E_POLICY
        for i, p in enumerate(prompts):
            h.submit(f"r{i}", p, max_new_tokens=6, ignore_eos=True)
        h.drain()
        outputs.append([h.ids(f"r{i}") for i in range(len(prompts))])
        stats.append(dict(backend.cascade_forwards))
    assert stats[1] == {"decode": 0, "extend": 0}
    assert stats[0]["decode"] >= 5 and stats[0]["extend"] >= 1, stats
    assert outputs[0] == outputs[1]


@pytest.mark.slow
def test_end_to_end_overlap_loop_matches_cascade_off(loaded):
    """W1_LIKE through the Engine's overlap loop (the default), which relies on init_forward_metadata being
    the forward's only reader of req_to_token."""
    from radixserve import Engine

    outputs, stats = [], []
    for disable in (False, True):
        engine = Engine(loaded_model=loaded, dtype="float32", device="cpu", max_total_tokens=1024,
                        disable_cascade_attention=disable, log_level="warning")
        try:
            backend = engine.model_runner.attn_backend
            if not disable:
                backend.cascade = E2E_POLICY
            results = engine.generate(input_ids=W1_LIKE, sampling_params={"temperature": 0.0, "max_new_tokens": 6,
                                                                          "ignore_eos": True})
            outputs.append([r["output_ids"] for r in results])
            stats.append(dict(backend.cascade_forwards))
            state = engine.get_internal_state()
            assert state["kv_conservation"] is not None and "error" not in state["kv_conservation"], state
            assert state["protected_tokens"] == 0 and state["num_running_reqs"] == 0
        finally:
            engine.shutdown()
    assert stats[1] == {"decode": 0, "extend": 0}
    assert stats[0]["decode"] >= 3 and stats[0]["extend"] >= 1, stats
    assert outputs[0] == outputs[1]
