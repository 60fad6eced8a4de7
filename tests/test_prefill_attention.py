"""The C causal extend (prefill) kernel (csrc/extend_attention.c) against SDPA, in the CPU backend, and end to end.

Kernel tests read K/V through scattered pool slots, several requests per call, with plain and shifted
causal diagonals (a cached prefix), once per kernel level this CPU runs (tests/kernel_levels.py). The
backend test compares CpuAttnBackend's extend with the torch backend's at each level; the end-to-end test
runs the embedded model greedily with the kernel on and off.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from kernel_levels import LEVELS, force_level, kernel_at, select_everything
from test_model_support import one_torch_thread

from radixserve.configs.row_table import DEFAULT_ROWS
from radixserve.forward_batch import ForwardBatch
from radixserve.kernels import attention as native
from radixserve.kernels.attention import DecodeKernel
from radixserve.layers.attention import cascade, create_attention_backend
from radixserve.layers.attention.torch_backend import (
    PREFILL_KERNEL_ENV,
    CpuAttnBackend,
    TorchAttnBackend,
)
from radixserve.layers.radix_attention import RadixAttention
from radixserve.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

_single_thread = pytest.fixture(scope="module", autouse=True)(one_torch_thread)

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
LENGTHS = [1, 15, 16, 17, 100, 513]


@pytest.fixture(scope="module", params=LEVELS)
def kernel(request) -> DecodeKernel:
    """The C kernels of each level this CPU can run (whatever native.SELECTED lets the backend use)."""
    return kernel_at(request.param)


def _random(shape: tuple[int, ...], g: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(shape, generator=g).to(dtype)


def _problem(q_lens: list[int], prefix_lens: list[int], kv_heads: int, heads: int, dim: int, dtype: torch.dtype,
             seed: int = 0):
    """Random queries, a pool of random K/V, and each request's context on scattered slots."""
    g = torch.Generator().manual_seed(seed)
    kv_lens = [p + n for p, n in zip(prefix_lens, q_lens, strict=True)]
    slots = sum(kv_lens) + 7
    k_buf, v_buf = _random((slots, kv_heads, dim), g, dtype), _random((slots, kv_heads, dim), g, dtype)
    q = _random((sum(q_lens), heads, dim), g, dtype)
    indices = torch.randperm(slots, generator=g)[: sum(kv_lens)].to(torch.int32)
    reqs = torch.tensor([(qs, n, ks, m) for qs, n, ks, m in zip(cascade.offsets(q_lens), q_lens,
                                                                cascade.offsets(kv_lens), kv_lens, strict=True)])
    return q, k_buf, v_buf, indices, reqs


def _sdpa(q, k_buf, v_buf, indices, reqs, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference in float32: (out [tokens, heads, dim], lse [tokens, heads]) request by request."""
    outs, lses = [], []
    for q_start, q_len, kv_start, kv_len in reqs.tolist():
        slots = indices[kv_start : kv_start + kv_len].long()
        qs, ks, vs = (x.float().transpose(0, 1) for x in (q[q_start : q_start + q_len], k_buf[slots], v_buf[slots]))
        group = qs.shape[0] // ks.shape[0]
        ks, vs = ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0)
        visible = cascade.shifted_causal(kv_len - q_len, q_len, q.device)
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=visible, scale=scale).transpose(0, 1))
        scores = (qs @ ks.transpose(1, 2) * scale).masked_fill(~visible, float("-inf"))
        lses.append(torch.logsumexp(scores, -1).transpose(0, 1))
    return torch.cat(outs), torch.cat(lses)


def _check(kernel, q_lens, prefix_lens, kv_heads, heads, dim, dtype, threads: int = 1) -> None:
    q, k_buf, v_buf, indices, reqs = _problem(q_lens, prefix_lens, kv_heads, heads, dim, dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, lse = kernel.extend(q, k_buf, v_buf, indices, reqs, dim**-0.5, with_lse=True)
    finally:
        torch.set_num_threads(before)
    want_out, want_lse = _sdpa(q, k_buf, v_buf, indices, reqs, dim**-0.5)
    assert out.dtype == dtype and out.shape == q.shape
    err = (out.float() - want_out).abs().max().item()
    assert err <= TOLERANCE[dtype], (q_lens, prefix_lens, err)
    assert torch.allclose(lse, want_lse, atol=1e-4), (q_lens, prefix_lens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads, heads, dim", [(3, 9, 64), (2, 2, 64), (1, 3, 128), (2, 6, 48)])  # 48: bf16 portable
def test_kernel_matches_sdpa(kernel, dtype, kv_heads, heads, dim):
    for n in LENGTHS:  # one request per call, no prefix
        _check(kernel, [n], [0], kv_heads, heads, dim, dtype)
    _check(kernel, LENGTHS, [0] * len(LENGTHS), kv_heads, heads, dim, dtype)  # the whole batch in one call


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads, heads, dim", [(3, 9, 64), (2, 6, 48)])
def test_kernel_shifted_diagonal(kernel, dtype, kv_heads, heads, dim):
    """Requests with cached prefixes: query i sees context keys 0 .. prefix + i."""
    _check(kernel, [1, 17, 100, 16, 5], [40, 3, 130, 0, 64], kv_heads, heads, dim, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 4])
def test_kernel_every_unit_size(kernel, dtype, group):
    """A unit of up to 2 x the vector width's rows runs as a block of one vector when its rows fit one (a short
    extend, a request's last rows), else of two, and bf16 with vdpbf16ps as its halves: every row count from 1
    to past two blocks of AVX-512, over a cached prefix and without one."""
    for n in range(1, 36 // group):
        _check(kernel, [n, n], [0, 21], 2, 2 * group, 64, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_rows_do_not_depend_on_the_block_width(kernel, dtype):
    """A row's arithmetic is the same in a block of one vector and of two: the first rows of a 32-token prompt
    (run in blocks of two vectors) equal, bit for bit, the same prompt cut to 8 or 16 tokens (blocks of one at
    AVX2 or AVX-512), whose rows see the same keys."""
    q, k_buf, v_buf, indices, _ = _problem([32], [0], 1, 1, 64, dtype, seed=3)
    whole, _ = kernel.extend(q, k_buf, v_buf, indices, torch.tensor([(0, 32, 0, 32)]), 0.125)
    for n in (8, 16):
        cut, _ = kernel.extend(q[:n], k_buf, v_buf, indices, torch.tensor([(0, n, 0, n)]), 0.125)
        assert torch.equal(cut, whole[:n]), n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_two_threads(kernel, dtype):
    _check(kernel, [513, 3, 64], [0, 70, 1], 3, 9, 64, dtype, threads=2)


def test_kernel_seed_merges_exactly(kernel):
    """Rows seeded with (out, lse) over a request's cached prefix, then run over its own tokens, equal
    attention over the whole context (how cascade extend uses it)."""
    dim, q_lens, prefix, scale = 64, [9, 20], 30, 64**-0.5
    q, k_buf, v_buf, indices, reqs = _problem(q_lens, [prefix, prefix], 1, 3, dim, torch.float32, seed=5)
    want, _ = _sdpa(q, k_buf, v_buf, indices, reqs, scale)
    seed_out, seed_lse = torch.empty_like(q), torch.empty(q.shape[:2])
    own, own_reqs = [], []
    for q_start, q_len, kv_start, _ in reqs.tolist():
        rows = slice(q_start, q_start + q_len)
        seed_out[rows], seed_lse[rows] = kernel.shared_prefix(q[rows], k_buf, v_buf,
                                                              indices[kv_start : kv_start + prefix], scale)
        own_reqs.append((q_start, q_len, sum(len(o) for o in own), q_len))
        own.append(indices[kv_start + prefix : kv_start + prefix + q_len])
    got, _ = kernel.extend(q, k_buf, v_buf, torch.cat(own), torch.tensor(own_reqs), scale, seed=(seed_out, seed_lse))
    assert torch.allclose(got, want, atol=1e-5)


def test_kernel_rejects_bad_shapes(kernel):
    q, k_buf, v_buf, indices, reqs = _problem([5], [0], 2, 6, 64, torch.float32)
    bad = reqs.clone()
    bad[0, 3] = 4  # kv_len < q_len
    with pytest.raises(ValueError, match="rejected"):
        kernel.extend(q, k_buf, v_buf, indices, bad, 0.125)
    with pytest.raises(ValueError, match="rejected"):
        kernel.extend(q[:, :5], k_buf, v_buf, indices, reqs, 0.125)  # 5 heads over 2 kv heads
    for dtype in (torch.float32, torch.bfloat16):  # whether to use it is the plan's, not the kernel's
        assert kernel.extend_supports(q.to(dtype), k_buf.to(dtype))
    assert not kernel.extend_supports(q.bfloat16(), k_buf)  # the pool's dtype differs


def _extend_batch(prefix_lens: list[int], extend_lens: list[int], kv_heads: int, heads: int, dim: int,
                  dtype: torch.dtype, seed: int = 0):
    """A random pool; request i has prefix_lens[i] cached tokens and extend_lens[i] new ones, on scattered slots."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [p + n for p, n in zip(prefix_lens, extend_lens, strict=True)]
    size = sum(seq_lens) + 16
    pool = MHATokenToKVPool(size, 1, dtype, kv_heads, dim, 1, "cpu")
    pool.k_buffer[0].copy_(torch.randn(pool.k_buffer[0].shape, generator=g))
    pool.v_buffer[0].copy_(torch.randn(pool.v_buffer[0].shape, generator=g))
    slots = (torch.randperm(size - 1, generator=g) + 1).to(torch.int32)  # never slot 0
    table = ReqToTokenPool(len(seq_lens), max(seq_lens) + 4, "cpu")
    rows = table.alloc(len(seq_lens))
    for row, n, start in zip(rows, seq_lens, cascade.offsets(seq_lens), strict=True):
        table.req_to_token[row, :n] = slots[start : start + n]
    locs = torch.cat([table.req_to_token[r, p:s].long() for r, p, s in zip(rows, prefix_lens, seq_lens, strict=True)])
    fb = ForwardBatch.for_extend([5] * len(locs), rows, prefix_lens, extend_lens, locs, "cpu")
    fb.req_to_token_pool, fb.token_to_kv_pool = table, pool
    q = torch.randn(len(locs), heads, dim, generator=g).to(dtype)
    return q, pool.k_buffer[0][locs].clone(), pool.v_buffer[0][locs].clone(), fb


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = []
    extend = DecodeKernel.extend

    def counted(self, *args, **kwargs):
        calls.append(1)
        return extend(self, *args, **kwargs)

    monkeypatch.setattr(DecodeKernel, "extend", counted)
    return calls


@pytest.mark.parametrize("isa", LEVELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prefix_lens, extend_lens", [([0, 0, 0], [17, 1, 100]), ([0, 30, 5], [40, 2, 16])])
def test_cpu_backend_extend_matches_torch_backend(isa, monkeypatch, dtype, prefix_lens, extend_lens):
    """At each level: the kernel runs exactly where native.SELECTED chose it (and always when everything is
    selected), and the backend's output equals the torch backend's either way."""
    force_level(isa, monkeypatch)
    calls = _counting(monkeypatch)
    runner = SimpleNamespace(device=torch.device("cpu"))
    plain = TorchAttnBackend(runner)
    layer = RadixAttention(0, 9, 3, 64, 64**-0.5)
    q, k, v, fb = _extend_batch(prefix_lens, extend_lens, 3, 9, 64, dtype)
    for selection in ("measured", "everything"):
        if selection == "everything":
            select_everything(monkeypatch)
        cpu = create_attention_backend("cpu", runner)
        assert isinstance(cpu, CpuAttnBackend) and cpu.decode_kernel is not None and cpu.decode_kernel.isa == isa
        chosen = cpu.plan.uses("extend", dtype)
        assert chosen == ("extend" in native.SELECTED[(cpu.plan.kernel_class, dtype)])
        assert (cpu.extend_kernel is not None) == any(cpu.plan.uses("extend", d) for d in cpu.plan.kernels)
        outs = []
        for backend in (cpu, plain):
            backend.init_forward_metadata(fb)
            outs.append(backend.forward(q, k, v, layer, fb))
        assert len(calls) == int(chosen), (selection, chosen)
        assert outs[0].dtype == dtype
        assert torch.allclose(outs[0].float(), outs[1].float(), atol=TOLERANCE[dtype])
        calls.clear()


def test_long_requests_stay_on_sdpa(monkeypatch):
    """A batch with a request of more new tokens than the measured crossover runs SDPA, not the kernel."""
    select_everything(monkeypatch)
    calls = _counting(monkeypatch)
    backend = create_attention_backend("cpu", SimpleNamespace(device=torch.device("cpu")))
    if backend.extend_kernel is None:
        pytest.skip("no C compiler here, so the native kernel cannot be built")
    layer = RadixAttention(0, 2, 1, 32, 32**-0.5)
    for lens, want in (([DEFAULT_ROWS.extend_kernel_new_tokens, 3], 1), ([DEFAULT_ROWS.extend_kernel_new_tokens + 1, 3], 0)):
        q, k, v, fb = _extend_batch([0, 0], lens, 1, 2, 32, torch.float32)
        backend.init_forward_metadata(fb)
        backend.forward(q, k, v, layer, fb)
        assert len(calls) == want, lens
        calls.clear()


def test_switch_off_keeps_sdpa(monkeypatch):
    calls = _counting(monkeypatch)
    monkeypatch.setenv(PREFILL_KERNEL_ENV, "0")
    backend = create_attention_backend("cpu", SimpleNamespace(device=torch.device("cpu")))
    if backend.decode_kernel is None:
        pytest.skip("no C compiler here, so the native kernel cannot be built")
    assert backend.extend_kernel is None
    q, k, v, fb = _extend_batch([0, 8], [20, 3], 1, 2, 32, torch.float32)
    assert backend.init_forward_metadata(fb).extend.kernel_reqs is None
    backend.forward(q, k, v, RadixAttention(0, 2, 1, 32, 32**-0.5), fb)
    assert not calls


PROMPTS = [[1000 + (7 * i + r) % 5000 for i in range(n)] for r, n in enumerate([70, 5, 33])]


@pytest.mark.slow
def test_end_to_end_greedy_kernel_on_vs_off(loaded, monkeypatch):
    """The embedded model in float32 through the scheduler: same greedy tokens with the kernel on and off.

    The second round re-sends the prompts plus a few tokens, so its extends run over cached prefixes."""
    from test_scheduler import Harness

    calls = _counting(monkeypatch)
    outputs = []
    for switch in ("1", "0"):
        monkeypatch.setenv(PREFILL_KERNEL_ENV, switch)
        h = Harness(loaded, max_total_tokens=1024, disable_cascade_attention=True)
        backend = h.sched.model_runner.attn_backend
        # NOTE: the kernel is loaded only where the plan uses it: the switch on and a class it was measured on
        selected = backend.plan.uses("extend", torch.float32)
        assert (backend.extend_kernel is not None) == (switch == "1" and selected)
        for round_ in range(2):
            for i, p in enumerate(PROMPTS):
                h.submit(f"r{round_}.{i}", p + [2000 + i] * round_ * 3, max_new_tokens=5, ignore_eos=True)
            h.drain()
        outputs.append([h.ids(f"r{r}.{i}") for r in range(2) for i in range(len(PROMPTS))])
        if switch == "1":  # NOTE: the kernel runs only where it was measured faster on this CPU class
            assert bool(calls) == selected, f"kernel level {backend.plan.level}, selected {selected}, calls {len(calls)}"
            calls_on = len(calls)
    assert len(calls) == calls_on  # none with the switch off
    assert outputs[0] == outputs[1]


# ---- the AMX extend kernel (amx_extend.py): bf16 on CPUs with AMX-BF16 ----------------------------------

def _amx_kernel():
    from radixserve.kernels.attention_amx import load_amx_extend_kernel

    kernel = load_amx_extend_kernel()
    if kernel is None:
        pytest.skip("needs AMX-BF16 visible (not hidden by RADIXSERVE_CPU_ISA), a C compiler and the OS's permission")
    return kernel


def _check_amx(q_lens, prefix_lens, kv_heads, heads, dim, threads: int = 1) -> None:
    q, k_buf, v_buf, indices, reqs = _problem(q_lens, prefix_lens, kv_heads, heads, dim, torch.bfloat16)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, lse = _amx_kernel().extend(q, k_buf, v_buf, indices, reqs, dim**-0.5)
    finally:
        torch.set_num_threads(before)
    want, _ = _sdpa(q, k_buf, v_buf, indices, reqs, dim**-0.5)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape and lse is None
    err = (out.float() - want).abs().max().item()
    assert err <= TOLERANCE[torch.bfloat16], (q_lens, prefix_lens, err)


@pytest.mark.parametrize("kv_heads, heads, dim", [(3, 9, 64), (2, 2, 64), (1, 3, 128), (4, 4, 32), (1, 8, 256)])
def test_amx_kernel_matches_sdpa(kv_heads, heads, dim):
    for n in LENGTHS:  # across the 16-query and 32-key blocks
        _check_amx([n], [0], kv_heads, heads, dim)
    _check_amx(LENGTHS, [0] * len(LENGTHS), kv_heads, heads, dim)


def test_amx_kernel_shifted_diagonal_and_two_threads():
    _check_amx([1, 17, 100, 16, 5], [40, 3, 130, 0, 64], 3, 9, 64)
    _check_amx([513, 3, 64, 1], [0, 70, 1, 31], 3, 9, 64, threads=2)


@pytest.mark.parametrize("dim", [32, 64, 128])
def test_amx_kernel_when_later_keys_dominate(dim):
    """Scores that rise along the context (by ~4 per 32-key block, and a jump of 30 at key 200): the running
    max is raised again and again, which for dim <= 64 rescales the output held in the tiles."""
    q, k_buf, v_buf, indices, reqs = _problem([300], [0], 1, 2, dim, torch.bfloat16, seed=5)
    direction = torch.ones(dim) / dim**0.5
    q[:] = (direction * 2.0).to(torch.bfloat16)
    rise = torch.arange(300, dtype=torch.float32) * 0.125 * dim**0.5 / 2 + 30.0 * (torch.arange(300) >= 200)
    k_buf[indices.long(), 0] = (direction * rise[:, None] * dim**0.5 / 2 + 0.1 * k_buf[indices.long(), 0].float()).to(torch.bfloat16)
    out, _ = _amx_kernel().extend(q, k_buf, v_buf, indices, reqs, dim**-0.5)
    want, _ = _sdpa(q, k_buf, v_buf, indices, reqs, dim**-0.5)
    assert (out.float() - want).abs().max().item() <= TOLERANCE[torch.bfloat16]


def test_amx_kernel_takes_only_what_it_computes():
    kernel = _amx_kernel()
    q, k_buf, v_buf, indices, reqs = _problem([5], [0], 1, 2, 64, torch.bfloat16)
    assert kernel.extend_supports(q, k_buf)
    assert not kernel.extend_supports(q.float(), k_buf.float())  # bf16 only
    assert not kernel.extend_supports(q[..., :48].contiguous(), k_buf[..., :48].contiguous())  # dim % 32
    with pytest.raises(ValueError, match="no seed"):
        kernel.extend(q, k_buf, v_buf, indices, reqs, 0.125, with_lse=True)
    bad = reqs.clone()
    bad[0, 3] = 4  # kv_len < q_len: the last query would see no key
    with pytest.raises(ValueError, match="rejected"):
        kernel.extend(q, k_buf, v_buf, indices, bad, 0.125)


def test_cpu_backend_runs_bf16_extend_on_amx(monkeypatch):
    """Auto level on an AMX CPU: bf16 extends (any length, with or without cached prefixes) go to the AMX
    kernel and equal the torch backend; float32 and cascade extends do not; the switch turns it off."""
    from radixserve.kernels.attention_amx import AmxExtendKernel

    _amx_kernel()
    calls = []
    extend = AmxExtendKernel.extend
    monkeypatch.setattr(AmxExtendKernel, "extend", lambda self, *a, **k: calls.append(1) or extend(self, *a, **k))
    runner = SimpleNamespace(device=torch.device("cpu"))
    layer = RadixAttention(0, 9, 3, 64, 64**-0.5)
    for dtype, prefix_lens, extend_lens, want in ((torch.bfloat16, [0, 30, 5], [600, 2, 16], 1),
                                                  (torch.float32, [0, 0], [17, 40], 0)):
        q, k, v, fb = _extend_batch(prefix_lens, extend_lens, 3, 9, 64, dtype)
        outs = []
        for backend in (create_attention_backend("cpu", runner), TorchAttnBackend(runner)):
            backend.init_forward_metadata(fb)
            outs.append(backend.forward(q, k, v, layer, fb))
        assert len(calls) == want, dtype
        assert torch.allclose(outs[0].float(), outs[1].float(), atol=TOLERANCE[dtype])
        calls.clear()
    q, k, v, fb = _extend_batch([300, 300], [20, 20], 3, 9, 64, torch.bfloat16)
    table, rows = fb.req_to_token_pool.req_to_token, fb.req_pool_indices
    table[rows[1], :300] = table[rows[0], :300]  # both requests now share a cached 300-token prefix
    outs = []
    for backend in (create_attention_backend("cpu", runner), TorchAttnBackend(runner)):
        assert backend.init_forward_metadata(fb).cascade_extend is not None
        outs.append(backend.forward(q, k, v, layer, fb))
    assert not calls  # NOTE: cascade extend needs seeds and log-sum-exps, which this kernel does not take
    assert torch.allclose(outs[0].float(), outs[1].float(), atol=TOLERANCE[torch.bfloat16])
    monkeypatch.setenv(PREFILL_KERNEL_ENV, "0")
    assert create_attention_backend("cpu", runner).amx_extend is None
