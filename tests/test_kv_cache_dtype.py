"""A bf16 KV cache under float32 compute (--kv-cache-dtype bfloat16): the C kernels' mixed paths
(`*_f32_bf16kv`) read bf16 K/V and widen each value as it is loaded, so at every kernel level their result is bit
for bit the float32 kernel's over the same values held in float32; and the float32 kernels are tested against
torch elsewhere (test_model_attention, test_decode_parts)."""

from __future__ import annotations

import pytest
import torch
from kernel_levels import LEVELS, kernel_at

SHAPES = [(3, 9, 64), (1, 8, 128), (2, 14, 64), (2, 6, 32), (1, 1, 48), (4, 32, 128)]


def _pool(slots: int, kv_heads: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(slots, kv_heads, dim, generator=g).to(torch.bfloat16)
    v = torch.randn(slots, kv_heads, dim, generator=g).to(torch.bfloat16)
    return k, v


def _tables(lens: list[int], slots: int, seed: int) -> tuple[torch.Tensor, int]:
    g = torch.Generator().manual_seed(seed + 1)
    max_len = max(lens)
    table = torch.zeros(len(lens), max_len, dtype=torch.int32)
    for i, n in enumerate(lens):  # scattered slots, as a pool hands them out after evictions
        table[i, :n] = torch.randperm(slots - 1, generator=g)[:n].to(torch.int32) + 1
    return table, max_len


@pytest.mark.parametrize("isa", LEVELS)
@pytest.mark.parametrize("kv_heads, heads, dim", SHAPES)
def test_decode_over_bf16_kv_is_the_float32_kernel_over_the_same_values(isa, kv_heads, heads, dim):
    kernel = kernel_at(isa)
    lens = [1, 37, 300, 2100]  # the last is attended in parts (decode_attention.c)
    k, v = _pool(2600, kv_heads, dim, seed=dim)
    table, max_len = _tables(lens, 2600, seed=dim)
    q = torch.randn(len(lens), heads, dim, generator=torch.Generator().manual_seed(3))
    seq_lens = torch.tensor(lens)
    got = kernel(q, k, v, table.reshape(-1), seq_lens, max_len, dim**-0.5)
    want = kernel(q, k.float(), v.float(), table.reshape(-1), seq_lens, max_len, dim**-0.5)
    assert got.dtype == torch.float32
    assert torch.equal(got, want)
    # and a seed (cascade's shared prefix) enters once, as in the float32 kernel
    seed = (torch.randn_like(q), torch.randn(len(lens), heads))
    assert torch.equal(kernel(q, k, v, table.reshape(-1), seq_lens, max_len, 0.1, seed=seed),
                       kernel(q, k.float(), v.float(), table.reshape(-1), seq_lens, max_len, 0.1, seed=seed))


@pytest.mark.parametrize("isa", LEVELS)
@pytest.mark.parametrize("kv_heads, heads, dim", SHAPES)
@pytest.mark.parametrize("window", [0, 50])
def test_extend_over_bf16_kv_is_the_float32_kernel_over_the_same_values(isa, kv_heads, heads, dim, window):
    kernel = kernel_at(isa)
    prefixes, news = [0, 120, 7], [33, 70, 1]
    k, v = _pool(600, kv_heads, dim, seed=dim + 1)
    g = torch.Generator().manual_seed(5)
    context = torch.randperm(599, generator=g)[: sum(prefixes) + sum(news)].to(torch.int32) + 1
    reqs, q_start, kv_start = [], 0, 0
    for p, n in zip(prefixes, news, strict=True):
        reqs.append((q_start, n, kv_start, p + n))
        q_start, kv_start = q_start + n, kv_start + p + n
    reqs = torch.tensor(reqs, dtype=torch.int64)
    q = torch.randn(sum(news), heads, dim, generator=g)
    got, got_lse = kernel.extend(q, k, v, context, reqs, dim**-0.5, with_lse=True, window=window)
    want, want_lse = kernel.extend(q, k.float(), v.float(), context, reqs, dim**-0.5, with_lse=True, window=window)
    assert torch.equal(got, want) and torch.equal(got_lse, want_lse)


@pytest.mark.parametrize("isa", LEVELS)
@pytest.mark.parametrize("kv_heads, heads, dim", SHAPES)
def test_shared_prefix_over_bf16_kv_is_the_float32_kernel_over_the_same_values(isa, kv_heads, heads, dim):
    kernel = kernel_at(isa)
    k, v = _pool(400, kv_heads, dim, seed=dim + 2)
    g = torch.Generator().manual_seed(7)
    slots = torch.randperm(399, generator=g)[:150].to(torch.int32) + 1
    q = torch.randn(11, heads, dim, generator=g)
    first = torch.tensor([0, 3, 150, 90, 0, 1, 149, 20, 0, 0, 64], dtype=torch.int32)
    for mask in (None, first):
        got = kernel.shared_prefix(q, k, v, slots, dim**-0.5, first=mask)
        want = kernel.shared_prefix(q, k.float(), v.float(), slots, dim**-0.5, first=mask)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_kernels_refuse_a_pair_they_have_no_code_for():
    kernel = kernel_at("portable")
    q = torch.randn(1, 2, 64, dtype=torch.bfloat16)
    k = torch.zeros(4, 1, 64)  # float32 K/V under bf16 queries: no kernel
    assert not kernel.extend_supports(q, k) and not kernel.supports(q, 1, torch.float32)
    with pytest.raises(ValueError, match="bf16 under float32 queries"):
        kernel(q, k, k, torch.zeros(1, dtype=torch.int32), torch.tensor([1]), 1, 0.1)


# --- the attention backends over a bf16 pool: every path attends over the values the cache holds ---------------

BACKENDS = [pytest.param(None, id="torch"), *LEVELS]


def _backend(isa, monkeypatch):
    from kernel_levels import force_level, select_everything

    from radixserve.layers.attention import create_attention_backend

    if isa is None:
        return create_attention_backend("torch", torch.device("cpu"))
    force_level(isa, monkeypatch)
    select_everything(monkeypatch)
    backend = create_attention_backend("cpu", torch.device("cpu"))
    assert backend.decode_kernel is not None and backend.decode_kernel.isa == isa
    return backend


@pytest.mark.parametrize("backend_isa", BACKENDS)
@pytest.mark.parametrize("kv_heads, heads, dim", [(2, 6, 32), (8, 8, 64), (1, 8, 128)])
@pytest.mark.parametrize("prefix_lens", [[0, 0, 0], [0, 5, 12]])
def test_extend_over_a_bf16_pool_attends_the_cached_values(backend_isa, kv_heads, heads, dim, prefix_lens,
                                                           monkeypatch):
    """New K/V in float32 go into a bf16 pool; attention (a batch with nothing cached attends the new K/V without
    reading the pool back on the torch path) matches the reference over the pool's bf16 values to float32
    rounding: far closer than the bf16 rounding it would show if a path used the unrounded new K/V."""
    from test_model_attention import _reference, _setup

    from radixserve.forward_batch import ForwardBatch
    from radixserve.layers.radix_attention import RadixAttention

    backend = _backend(backend_isa, monkeypatch)
    extend_lens = [6, 3, 9]
    seq_lens = [p + n for p, n in zip(prefix_lens, extend_lens, strict=True)]
    pool, table, rows, g = _setup(seq_lens, kv_heads, torch.bfloat16, dim=dim)
    q = torch.randn(sum(extend_lens), heads, dim, generator=g)
    k_new, v_new = (torch.randn(sum(extend_lens), kv_heads, dim, generator=g) for _ in range(2))
    locs = torch.cat([table.req_to_token[r, p:s].long() for r, p, s in zip(rows, prefix_lens, seq_lens, strict=True)])
    fb = ForwardBatch.for_extend([5] * len(locs), rows, prefix_lens, extend_lens, locs, "cpu")
    fb.req_to_token_pool, fb.token_to_kv_pool = table, pool
    backend.init_forward_metadata(fb)
    got = backend.forward(q, k_new, v_new, RadixAttention(0, heads, kv_heads, dim, dim**-0.5), fb)
    assert got.dtype == torch.float32 and torch.equal(pool.k_buffer[0][locs], k_new.to(torch.bfloat16))
    got = got.view(-1, heads, dim).double()
    start = 0
    for row, p, n in zip(rows, prefix_lens, extend_lens, strict=True):
        ref = _reference(q[start : start + n], pool, table, row, p + n, kv_heads, p)
        assert torch.allclose(got[start : start + n], ref, atol=2e-5), (row, p, n)
        start += n


@pytest.mark.parametrize("backend_isa", BACKENDS)
@pytest.mark.parametrize("kv_heads, heads, dim", [(2, 6, 32), (8, 8, 64), (1, 8, 128)])
def test_decode_over_a_bf16_pool_matches_the_reference(backend_isa, kv_heads, heads, dim, monkeypatch):
    from test_model_attention import _decode_batch

    from radixserve.layers.radix_attention import RadixAttention

    backend = _backend(backend_isa, monkeypatch)
    seq_lens = [3, 130, 64, 65, 1]
    q, k_new, v_new, fb, ref = _decode_batch(seq_lens, kv_heads, heads, torch.bfloat16, dim)
    backend.init_forward_metadata(fb)
    got = backend.forward(q.float(), k_new.float(), v_new.float(), RadixAttention(0, heads, kv_heads, dim, dim**-0.5),
                          fb)
    assert got.dtype == torch.float32
    assert torch.allclose(got.view(len(seq_lens), heads, dim).double(), ref, atol=2e-5)


# --- the model runner and the C decoder over a bf16 cache ---------------------------------------------------

STEP_LEVELS = [pytest.param("avx2", id="avx2"), pytest.param("avx512", id="avx512")]


@pytest.mark.parametrize("isa", STEP_LEVELS)
@pytest.mark.parametrize("bs", [1, 5])
def test_c_step_writes_and_reads_a_bf16_cache_as_the_python_layers_do(isa, bs, monkeypatch, tmp_path_factory):
    """float32 compute over bf16 weights with --kv-cache-dtype bfloat16: the C decoder rounds the new K/V to bf16
    as the Python layers' write does and reads them through the mixed kernel; logits and cache agree with the
    Python layers, greedy tokens are identical, and the pool is bf16 at half the bytes per token."""
    from kernel_levels import force_level
    from test_c_decoder_f32 import _decode_run, _prompt_lens, _runner
    from test_model_support import rel_err

    from radixserve.configs.row_table import DEFAULT_ROWS

    force_level(isa, monkeypatch)
    folder = _tiny_folder(tmp_path_factory)
    runs = {}
    for on in (False, True):
        runner = _runner(folder, monkeypatch, on, kv_cache_dtype="bfloat16")
        assert runner.token_to_kv_pool.k_buffer[0].dtype == torch.bfloat16 and runner.dtype == torch.float32
        assert (runner.model.c_decoder is not None) == on
        runs[on] = _decode_run(runner, bs)
    (off_logits, off_kv, _, off_tokens), (on_logits, on_kv, calls, on_tokens) = runs[False], runs[True]
    assert calls == [bs] * 4 and on_kv.dtype == torch.bfloat16
    # NOTE: the passes before the write differ from inductor's in float32's last bits, which moves a value across a
    # bf16 rounding boundary now and then (one bf16 step, 2**-8 relative): the KV agree to that, the logits closer.
    # A prefill of `prefill_passes_from` tokens or more runs the step's passes too where it is on
    if sum(_prompt_lens(bs)) < DEFAULT_ROWS.prefill_passes_from:
        assert torch.equal(on_logits[0], off_logits[0])
    else:
        assert rel_err(on_logits[0], off_logits[0]) < 1e-3
    assert rel_err(on_kv.float(), off_kv.float()) < 4e-3
    for off, on in zip(off_logits[1:], on_logits[1:], strict=True):
        assert rel_err(on, off) < 1e-3
    assert on_tokens == off_tokens


_FOLDER = {}


def _tiny_folder(tmp_path_factory):
    from test_c_decoder_f32 import folder as make_folder

    if "path" not in _FOLDER:
        _FOLDER["path"] = make_folder.__wrapped__(tmp_path_factory)
    return _FOLDER["path"]


# --- the flag, the plan and an engine on the embedded model ------------------------------------------------------

def test_flag_values_and_refusals():
    from radixserve.mem_cache.memory_pool import MHATokenToKVPool
    from radixserve.model_executor.execution_plan import resolve_kv_dtype
    from radixserve.server_args import ServerArgs

    assert resolve_kv_dtype("auto", torch.float32)[0] == torch.float32
    # --dtype auto on a CPU without bf16 products keeps the weights in bf16, and the cache with them
    assert resolve_kv_dtype("auto", torch.float32, "bfloat16")[0] == torch.bfloat16
    assert resolve_kv_dtype("float32", torch.float32, "bfloat16")[0] == torch.float32  # asked for: kept
    assert resolve_kv_dtype("auto", torch.bfloat16)[0] == torch.bfloat16
    assert resolve_kv_dtype("bf16", torch.float32)[0] == torch.bfloat16
    assert resolve_kv_dtype("bfloat16", torch.bfloat16)[0] == torch.bfloat16
    with pytest.raises(ValueError, match="float32 under bfloat16 compute is not supported"):
        resolve_kv_dtype("float32", torch.bfloat16)
    with pytest.raises(ValueError, match="fp8_e5m2.*not supported"):
        ServerArgs(kv_cache_dtype="fp8_e5m2")
    with pytest.raises(ValueError, match="kv_cache_dtype='int8' is not one of"):
        ServerArgs(kv_cache_dtype="int8")
    half = MHATokenToKVPool.bytes_per_token(3, 64, 30, torch.bfloat16)
    assert 2 * half == MHATokenToKVPool.bytes_per_token(3, 64, 30, torch.float32) == 46080


PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "List three colours:\n1.",
           "The capital of France is a city that"]


def test_engine_serves_from_a_bf16_cache(loaded):
    """The embedded SmolLM2 in float32 with a bf16 cache: the plan and server info say so, a prompt answered again
    from the radix cache (its prefix read back from the pool) gives the same tokens, the greedy answers start as
    the float32 cache's do, and nothing leaks."""
    from test_model_support import assert_engine_conserved

    from radixserve import Engine

    params = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
    answers = {}
    for kv in ("auto", "bfloat16"):
        engine = Engine(loaded_model=loaded, dtype="float32", device="cpu", max_total_tokens=1024, kv_cache_dtype=kv,
                        log_level="warning")
        try:
            runner = engine.model_runner
            expected = torch.float32 if kv == "auto" else torch.bfloat16
            assert runner.token_to_kv_pool.k_buffer[0].dtype == expected
            assert runner.platform_info()["kv_cache_dtype"] == str(expected).removeprefix("torch.")
            assert runner.execution_plan.choice("kv cache") == str(expected).removeprefix("torch.")
            first = [r["output_ids"] for r in engine.generate(PROMPTS, params)]
            again = [r["output_ids"] for r in engine.generate(PROMPTS, params)]
            assert again == first  # the second pass reads every prompt's prefix back from the cache
            assert any(r["meta_info"]["cached_tokens"] > 0 for r in engine.generate(PROMPTS[:1], params))
            answers[kv] = first
            assert_engine_conserved(engine)
        finally:
            engine.shutdown()
    assert [a[:3] for a in answers["bfloat16"]] == [a[:3] for a in answers["auto"]]


def test_dtype_auto_without_bf16_products_keeps_the_cache_in_bf16(monkeypatch):
    """Where `--dtype auto` computes in float32 over bf16 weights (a CPU without bf16 products), `--kv-cache-dtype
    auto` keeps the cache in bf16 too and the plan says why; `--kv-cache-dtype float32` still gets float32."""
    from test_model_support import assert_engine_conserved

    from radixserve import Engine, platform

    choice = platform.DtypeChoice("float32", "no native bf16 (test)" + platform.BF16_WEIGHTS_REASON, "bfloat16")
    monkeypatch.setattr(platform, "choose_dtype", lambda name, device_type: choice)
    for requested, expected in (("auto", torch.bfloat16), ("float32", torch.float32)):
        engine = Engine(dtype="auto", max_total_tokens=1024, log_level="warning", kv_cache_dtype=requested)
        try:
            runner = engine.model_runner
            plan = runner.execution_plan.as_dict()
            out = engine.generate(input_ids=[[5, 6, 7, 8]], sampling_params={"max_new_tokens": 4, "temperature": 0})
            assert_engine_conserved(engine)
        finally:
            engine.shutdown()
        assert runner.dtype == torch.float32 and runner.token_to_kv_pool.k_buffer[0].dtype == expected
        assert len(out[0]["output_ids"]) == 4
        assert plan["kv cache"]["choice"] == str(expected).removeprefix("torch.")
        assert ("like the weights" in plan["kv cache"]["reason"]) == (requested == "auto")


CASCADE_BACKENDS = ["torch", "torch-math", "cpu", "cpu-avx2", "cpu-portable"]


@pytest.mark.parametrize("name", CASCADE_BACKENDS)
def test_cascade_over_a_bf16_pool_matches_attention_without_it(name, monkeypatch):
    """Cascade (the shared prefix attended once, then each request's own part) over a bf16 pool with float32 queries
    gives what attention without cascade gives; on the CPU backend a decode batch's shared prefix runs in the C
    prefix kernel even where the plan leaves prefixes to torch, whose path would widen a copy of it per call."""
    from test_cascade_attention import _backends, _both, _decode_batch, _extend_batch, _path

    from radixserve.layers.radix_attention import RadixAttention

    _path(name, monkeypatch)
    on, off = _backends(name)
    calls = []
    if on.decode_kernel is not None:
        shared_prefix = on.decode_kernel.shared_prefix
        monkeypatch.setattr(on.decode_kernel, "shared_prefix", lambda *a, **kw: calls.append(1) or shared_prefix(*a, **kw))
    layer = RadixAttention(0, 6, 2, 32, 32**-0.5)
    q, k, v, fb = _decode_batch(40, [3, 9, 1, 20], 2, 6, 32, torch.bfloat16)
    got, want = _both(on, off, (q.float(), k.float(), v.float(), fb), layer)
    assert on.cascade_forwards["decode"] == 1 and got.dtype == torch.float32
    assert torch.allclose(got, want, atol=2e-5)
    assert bool(calls) == name.startswith("cpu")
    q, k, v, fb = _extend_batch(40, [40, 45, 52], [6, 1, 9], 2, 6, 32, torch.bfloat16)
    got, want = _both(on, off, (q.float(), k.float(), v.float(), fb), layer)
    assert on.cascade_forwards["extend"] == 1 and torch.allclose(got, want, atol=2e-5)


def test_speculative_greedy_over_a_bf16_cache_equals_plain_greedy(loaded):
    """n-gram speculation under float32 compute over a bf16 cache: verify rows write and read the cache as plain
    decode steps do, so the greedy tokens are the same with and without it, and drafts were accepted."""
    from test_model_support import assert_engine_conserved
    from test_speculative_model import CODE

    from radixserve import Engine

    prompt = loaded.tokenizer.apply_chat_template([{"role": "user", "content": f"Repeat this code exactly:\n\n{CODE}"}],
                                                  tokenize=False, add_generation_prompt=True)
    results = {}
    for algo in ("none", "ngram"):
        engine = Engine(loaded_model=loaded, dtype="float32", device="cpu", max_total_tokens=2048,
                        kv_cache_dtype="bfloat16", speculative_algorithm=algo, log_level="warning")
        try:
            assert engine.model_runner.token_to_kv_pool.k_buffer[0].dtype == torch.bfloat16
            results[algo] = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 48})
            assert_engine_conserved(engine)
        finally:
            engine.shutdown()
    assert results["ngram"]["output_ids"] == results["none"]["output_ids"]
    assert results["ngram"]["meta_info"]["spec_accepted_tokens"] > 0
