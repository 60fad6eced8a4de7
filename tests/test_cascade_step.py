"""Cascade attention in the one-call C decoder, and cascade's part (a) on AMX tiles.

- The AMX prefix kernel (`AmxExtendKernel.shared_prefix`, csrc/extend_amx.c) against torch's attention over the
  same gathered keys: output and log-sum-exp, GQA ratios 1-8, head dims 32-256, across its 16-query and 32-key
  blocks, one and two threads; what it refuses.
- The CPU backend on an AMX CPU runs both modes' part (a) there, and not for a window layer's plan (whose
  queries carry lower bounds the kernel does not take).
- A decode batch that shares a prefix runs cascade inside the C step wherever part (a) is a C function (the AMX
  kernel in bf16; the C prefix kernel under float32 compute over a bf16 cache): logits and KV equal to the
  Python layers', which call the same functions (bit-equal in bf16; to float32 rounding in the float32 build,
  whose passes differ from inductor's as in test_c_decoder_f32.py). Elsewhere the step declines such a batch and the Python layers
  run it. The conservation identity holds after each run.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from direct_driver import DirectDriver
from test_c_decoder import Recorder
from test_model_support import rel_err, save_tiny_tokenizer

from radixserve.layers.attention import create_attention_backend
from radixserve.layers.attention.cascade import _prefix_torch
from radixserve.layers.attention.torch_backend import TorchAttnBackend
from radixserve.layers.radix_attention import RadixAttention
from radixserve.mem_cache.conservation import check_conservation
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.server_args import ServerArgs


def _amx_kernel():
    from radixserve.kernels.attention_amx import load_amx_extend_kernel

    kernel = load_amx_extend_kernel()
    if kernel is None:
        pytest.skip("needs AMX-BF16 visible (not hidden by RADIXSERVE_CPU_ISA), a C compiler and the OS's permission")
    return kernel


def _prefix_problem(n: int, prefix_len: int, kv_heads: int, heads: int, dim: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    pool = prefix_len + 50
    k_buf = torch.randn(pool, kv_heads, dim, generator=g).to(torch.bfloat16)
    v_buf = torch.randn(pool, kv_heads, dim, generator=g).to(torch.bfloat16)
    slots = torch.randperm(pool, generator=g)[:prefix_len].to(torch.int32)  # scattered, as in a served pool
    q = torch.randn(n, heads, dim, generator=g).to(torch.bfloat16)
    return q, k_buf, v_buf, slots


@pytest.mark.parametrize("kv_heads, heads, dim", [(3, 9, 64), (2, 2, 64), (1, 3, 128), (4, 4, 32), (1, 8, 256),
                                                  (2, 16, 128), (2, 6, 96)])
def test_amx_prefix_matches_torch(kv_heads, heads, dim):
    kernel = _amx_kernel()
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for n, prefix_len in [(1, 1), (15, 31), (16, 32), (17, 33), (32, 300), (3, 1000)]:
                q, k_buf, v_buf, slots = _prefix_problem(n, prefix_len, kv_heads, heads, dim)
                out, lse = kernel.shared_prefix(q, k_buf, v_buf, slots, dim**-0.5)
                want, want_lse = _prefix_torch(q, k_buf, v_buf, slots, dim**-0.5)
                assert out.dtype == torch.bfloat16 and out.shape == q.shape and lse.shape == (n, heads)
                assert (out.float() - want.float()).abs().max().item() <= 2e-2, (n, prefix_len, threads)
                assert (lse - want_lse.float()).abs().max().item() <= 1e-3, (n, prefix_len, threads)
    finally:
        torch.set_num_threads(before)


def test_amx_prefix_when_later_keys_dominate():
    """Scores rising along the prefix (dim 64 keeps the output in the tiles and rescales it lazily)."""
    kernel = _amx_kernel()
    q, k_buf, v_buf, slots = _prefix_problem(20, 300, 1, 2, 64, seed=3)
    direction = torch.ones(64) / 8
    q[:] = (direction * 2.0).to(torch.bfloat16)
    rise = torch.arange(300, dtype=torch.float32) * 0.5 + 30.0 * (torch.arange(300) >= 200)
    k_buf[slots.long(), 0] = (direction * rise[:, None] * 4 + 0.1 * k_buf[slots.long(), 0].float()).to(torch.bfloat16)
    out, lse = kernel.shared_prefix(q, k_buf, v_buf, slots, 0.125)
    want, want_lse = _prefix_torch(q, k_buf, v_buf, slots, 0.125)
    assert (out.float() - want.float()).abs().max().item() <= 2e-2
    assert (lse - want_lse.float()).abs().max().item() <= 1e-2


def test_amx_prefix_takes_only_what_it_computes():
    kernel = _amx_kernel()
    q, k_buf, v_buf, slots = _prefix_problem(4, 40, 2, 4, 64)
    assert kernel.prefix_supports(q, 2, torch.bfloat16)
    assert not kernel.prefix_supports(q.float(), 2, torch.float32)  # bf16 only
    assert not kernel.prefix_supports(q, 2, torch.float32)
    assert not kernel.prefix_supports(q[..., :48].contiguous(), 2)  # dim % 32
    assert kernel.prefix_address(torch.bfloat16, torch.bfloat16) and kernel.prefix_address(torch.float32,
                                                                                            torch.bfloat16) is None
    with pytest.raises(ValueError, match="window bounds"):
        kernel.shared_prefix(q, k_buf, v_buf, slots, 0.125, first=torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="rejected"):
        kernel.shared_prefix(q, k_buf, v_buf, slots[:0], 0.125)  # an empty prefix is not cascade
    with pytest.raises(ValueError, match="takes bf16"):
        kernel.shared_prefix(q.float(), k_buf.float(), v_buf.float(), slots, 0.125)


def test_cpu_backend_runs_part_a_on_amx(monkeypatch):
    """bf16 decode and extend batches over a shared prefix: part (a) on the tiles, equal to the torch backend."""
    from test_cascade_attention import _decode_batch, _extend_batch

    from radixserve.kernels.attention_amx import AmxExtendKernel

    _amx_kernel()
    calls = []
    shared_prefix = AmxExtendKernel.shared_prefix
    monkeypatch.setattr(AmxExtendKernel, "shared_prefix",
                        lambda self, *a, **k: calls.append(1) or shared_prefix(self, *a, **k))
    runner = SimpleNamespace(device=torch.device("cpu"))
    layer = RadixAttention(0, 9, 3, 64, 64**-0.5)
    for batch in (_decode_batch(300, [1, 5, 3, 40] * 4, 3, 9, 64, torch.bfloat16),
                  _extend_batch(300, [300, 310, 320], [7, 1, 20], 3, 9, 64, torch.bfloat16)):
        q, k, v, fb = batch
        outs = []
        for backend in (create_attention_backend("cpu", runner), TorchAttnBackend(runner)):
            backend.init_forward_metadata(fb)
            assert sum(backend.cascade_forwards.values()) == 1
            outs.append(backend.forward(q, k, v, layer, fb))
        assert len(calls) == 1
        assert torch.allclose(outs[0].float(), outs[1].float(), atol=2e-2)
        calls.clear()
    backend = create_attention_backend("cpu", runner)
    q = torch.empty(1, 9, 64, dtype=torch.bfloat16)
    assert isinstance(backend.prefix_kernel_for(q, 3, torch.bfloat16), AmxExtendKernel)
    assert not isinstance(backend.prefix_kernel_for(q, 3, torch.bfloat16, bounds=True), AmxExtendKernel)


# ---- cascade inside the C decoder ------------------------------------------------------------------------

SHARED, BATCH = 300, 16  # what CascadePolicy takes for decode: a prefix >= 256 tokens, >= 16 requests


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny Llama (head_dim 64, GQA 2) in shapes both C step builds take."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    path = tmp_path_factory.mktemp("llama-d64-cascade")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.2, rms_norm_eps=1e-6, eos_token_id=1, bos_token_id=2)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(str(path))
    save_tiny_tokenizer(path)
    return path


def _shared_prefix_run(runner: ModelRunner):
    """BATCH requests over one SHARED-token prefix (the same slots) + 1-20 own tokens, then three decode steps:
    the logits, the KV of every slot, the C step's calls, the decode forwards that ran cascade."""
    driver = DirectDriver(runner)
    first = driver.new_request()
    driver.extend([first], [[(5 * j) % 250 + 3 for j in range(SHARED)]])
    reqs = [first] + [driver.new_request(share_prefix_of=first, prefix_len=SHARED) for _ in range(BATCH - 1)]
    driver.extend(reqs, [[(7 * i + j) % 250 + 3 for j in range(1 + 3 * i % 20)] for i in range(BATCH)])
    recorder = None
    if runner.model.c_decoder is not None:
        recorder = runner.model.c_decoder = Recorder(runner.model.c_decoder)
    logits = [driver.decode(reqs, [(i + s) % 200 + 3 for i in range(BATCH)]) for s in range(3)]
    slots = torch.cat([runner.req_to_token_pool.req_to_token[r.row, : len(r.token_ids)] for r in reqs]).long()
    kv = torch.stack([torch.cat([b[slots].float() for b in runner.token_to_kv_pool.get_kv_buffer(i)])
                      for i in range(runner.model.config.num_layers)])
    cascades = runner.attn_backend.cascade_forwards["decode"]
    driver.release_all()
    check_conservation(runner.token_to_kv_pool_allocator, None, runner.req_to_token_pool, [])
    return logits, kv, [] if recorder is None else recorder.calls, cascades


def _runner(folder, monkeypatch, on: bool, **kw) -> ModelRunner:
    monkeypatch.setenv("RADIXSERVE_DECODE_STEP", "1" if on else "0")
    return ModelRunner(ServerArgs(model_path=str(folder), device="cpu", max_total_tokens=8192,
                                  attention_backend="cpu", **kw))


@pytest.mark.parametrize("kw", [
    pytest.param({"dtype": "bfloat16", "linear_method": "onednn_gemv"}, id="bf16"),
    pytest.param({"dtype": "float32", "linear_method": "bf16_weights", "kv_cache_dtype": "bfloat16"},
                 id="f32-bf16kv"),
])
def test_c_step_runs_cascade_like_the_python_layers(folder, monkeypatch, kw):
    from radixserve.layers.gemv import load_gemv_kernel

    if kw["dtype"] == "bfloat16" and load_gemv_kernel() is None:
        pytest.skip("the bf16 C step needs AVX512-BF16 (the GEMV kernel), not visible here")
    runs = {}
    for on in (False, True):
        runner = _runner(folder, monkeypatch, on, **kw)
        if on and runner.model.c_decoder is None:
            pytest.skip(f"no C decoder for {kw['dtype']} on this CPU: {runner.device_setup.describe()}")
        runs[on] = _shared_prefix_run(runner)
        if on:
            q = torch.empty(1, 4, 64, dtype=runner.dtype)
            part_a = runner.attn_backend.prefix_kernel_for(q, 2, runner.token_to_kv_pool.dtype, decode=True)
    (off_logits, off_kv, _, off_cascades), (on_logits, on_kv, calls, on_cascades) = runs[False], runs[True]
    assert off_cascades == on_cascades == 3  # every decode step split its attention
    # NOTE: the step takes a cascade batch exactly where part (a) is a C function the Python layers call too
    assert calls == ([BATCH] * 3 if part_a is not None else [])
    if kw["dtype"] == "bfloat16":
        assert all(torch.equal(on, off) for off, on in zip(off_logits, on_logits, strict=True))
        assert torch.equal(on_kv, off_kv)
    else:
        # NOTE: as in test_kv_cache_dtype.py: float32 rounding differences flip some bf16 roundings of the cache
        assert max(rel_err(on, off) for off, on in zip(off_logits, on_logits, strict=True)) < 1e-3
        assert rel_err(on_kv, off_kv) < 4e-3
    assert [t.argmax(-1).tolist() for t in on_logits] == [t.argmax(-1).tolist() for t in off_logits]
