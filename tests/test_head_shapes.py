"""Every attention kernel over the common head shapes: head dim 64 and 128, 1-8 query heads per kv head
(group 1 is MHA), against a torch reference, at every kernel level this CPU runs and in float32 and bf16.

The kernels: decode (through the CPU backend), extend (the C kernel on ragged requests with and without a
cached prefix), cascade decode and extend (the prefix kernel, then the seeded decode or extend kernel, in
the CPU backend: against cascade off and the reference), the AMX extend kernel (bf16, CPUs with AMX-BF16),
and the one-call C decoder (bit-equal to the Python layers on tiny Llamas of these shapes; AVX512-BF16).
Kernel levels as tests/kernel_levels.py: RADIXSERVE_CPU_ISA=<level> skips the levels above it. The helpers
are the kernels' own test modules'; each case is one small call over a few ragged lengths (1, a
non-multiple of 16, one past the 64-token chunk), so the grid stays cheap.
"""

from __future__ import annotations

import functools
from collections import Counter
from pathlib import Path

import pytest
import torch
from kernel_levels import LEVELS, force_level, kernel_at, select_everything
from test_c_decoder import _decode_run, _runner
from test_cascade_attention import SMALL, _backends, _both, _path
from test_cascade_attention import _decode_batch as _cascade_decode_batch
from test_cascade_attention import _extend_batch as _cascade_extend_batch
from test_model_attention import _decode_batch, _reference
from test_model_support import one_torch_thread, rel_err, save_tiny_tokenizer
from test_prefill_attention import _amx_kernel, _check, _check_amx, _problem

from radixserve.kernels.attention import MAX_GROUP, DecodeKernel
from radixserve.layers.attention import create_attention_backend
from radixserve.layers.gemv import load_gemv_kernel
from radixserve.layers.radix_attention import RadixAttention

_single_thread = pytest.fixture(scope="module", autouse=True)(one_torch_thread)

# query heads per kv head -> kv heads: MHA with 8 heads, one kv head for the odd groups, else two
KV_HEADS = {1: 8, 2: 2, 3: 1, 4: 2, 5: 1, 6: 2, 7: 1, 8: 2}


def _shape_id(dim: int, group: int, kv_heads: int) -> str:
    return f"d{dim}-{'mha' if group == 1 else f'g{group}'}-kv{kv_heads}"


SHAPES = [pytest.param(dim, group, KV_HEADS[group], id=_shape_id(dim, group, KV_HEADS[group]))
          for dim in (64, 128) for group in KV_HEADS]
DTYPES = [pytest.param(torch.float32, id="f32"), pytest.param(torch.bfloat16, id="bf16")]
ATOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3}  # bf16: against a reference from the same bf16 inputs

LENS = [1, 37, 70]  # new tokens (extend) or context (decode): 1, not a multiple of 16, past a 64-token chunk
PREFIX = [9, 0, 30]  # the extend requests' cached tokens: the 37-token request has none
SHARED = 20  # cascade: the prefix every request of the batch shares


def _counting(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """Counts the calls of each DecodeKernel entry point (decode, shared_prefix, extend) from now on."""
    calls = Counter()

    def counted(name: str):
        method = getattr(DecodeKernel, name)

        def call(self, *args, **kwargs):
            calls[name] += 1
            return method(self, *args, **kwargs)

        return call

    for name in ("__call__", "shared_prefix", "extend"):
        monkeypatch.setattr(DecodeKernel, name, counted(name))
    return calls


def _assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert got.dtype == dtype and got.shape == want.shape, what
    err = (got.double() - want.double()).abs().max().item()
    assert err <= ATOL[dtype], f"{what}: max error {err:.3g}"


# ---- (a) decode: the CPU backend with its C decode kernel -------------------------------------------------

@pytest.mark.parametrize("isa", LEVELS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim, group, kv_heads", SHAPES)
def test_decode(isa, dtype, dim, group, kv_heads, monkeypatch):
    force_level(isa, monkeypatch)
    select_everything(monkeypatch)
    heads = group * kv_heads
    q, k_new, v_new, fb, ref = _decode_batch(LENS, kv_heads, heads, dtype, dim)
    backend = create_attention_backend("cpu", torch.device("cpu"))
    assert backend.decode_kernel.isa == isa
    assert backend.decode_kernel_for(q, kv_heads) is backend.decode_kernel  # the kernel takes the shape
    calls = _counting(monkeypatch)
    backend.init_forward_metadata(fb)
    got = backend.forward(q, k_new, v_new, RadixAttention(0, heads, kv_heads, dim, dim**-0.5), fb)
    assert calls == {"__call__": 1}
    _assert_close(got.view(q.shape), ref, dtype, "decode")
    # the longest request alone on two threads: (request, kv head) units instead of whole requests
    meta, k_all, v_all = fb.attn_metadata.decode, *fb.token_to_kv_pool.get_kv_buffer(0)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        alone = backend.decode_kernel(q[-1:], k_all, v_all, meta.kv_indices[-meta.max_len :],
                                      fb.seq_lens[-1:], meta.max_len, dim**-0.5)
    finally:
        torch.set_num_threads(before)
    _assert_close(alone, ref[-1:], dtype, "decode, one request on two threads")


@pytest.mark.parametrize("isa", LEVELS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_past_max_group_runs_torch(isa, dtype, monkeypatch):
    """A group the decode kernel does not take (> MAX_GROUP query heads per kv head) runs torch's decode."""
    force_level(isa, monkeypatch)
    select_everything(monkeypatch)
    kv_heads, heads, dim = 1, 2 * MAX_GROUP, 64
    q, k_new, v_new, fb, ref = _decode_batch(LENS, kv_heads, heads, dtype, dim)
    backend = create_attention_backend("cpu", torch.device("cpu"))
    assert backend.decode_kernel.isa == isa and backend.decode_kernel_for(q, kv_heads) is None
    calls = _counting(monkeypatch)
    backend.init_forward_metadata(fb)
    got = backend.forward(q, k_new, v_new, RadixAttention(0, heads, kv_heads, dim, dim**-0.5), fb)
    assert not calls
    _assert_close(got.view(q.shape), ref, dtype, "torch decode")


# ---- (b) extend: the C kernel, one call over ragged requests with and without cached prefixes -------------

@pytest.mark.parametrize("isa", LEVELS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim, group, kv_heads", SHAPES)
def test_extend(isa, dtype, dim, group, kv_heads):
    kernel = kernel_at(isa)
    q, k_buf, _, _, _ = _problem([1], [0], kv_heads, group * kv_heads, dim, dtype)
    assert kernel.extend_supports(q, k_buf)
    # NOTE: against SDPA at that module's tolerance: bf16 2e-2, as an output near 4 is rounded by up to 0.0156
    _check(kernel, LENS, PREFIX, kv_heads, group * kv_heads, dim, dtype)


# ---- (c) cascade decode and extend: the CPU backend with every C kernel at the level ---------------------

@functools.cache
def _cascade_case(mode: str, dtype: torch.dtype, dim: int, kv_heads: int, heads: int):
    """The batch (q, k, v, fb) and its float64 reference; the same at every level, so built once."""
    if mode == "decode":
        q, k, v, fb = _cascade_decode_batch(SHARED, LENS, kv_heads, heads, dim, dtype)
        prefix_lens, seq_lens = [n - 1 for n in fb.seq_lens_cpu], fb.seq_lens_cpu
    else:
        prefix_lens = [SHARED, SHARED + 13, SHARED]  # the 37-token request has 13 more than the shared part
        q, k, v, fb = _cascade_extend_batch(SHARED, prefix_lens, LENS, kv_heads, heads, dim, dtype)
        seq_lens = [p + n for p, n in zip(prefix_lens, LENS, strict=True)]
    table, rows = fb.req_to_token_pool, fb.req_pool_indices.tolist()
    refs, start = [], 0
    for row, p, n in zip(rows, prefix_lens, seq_lens, strict=True):
        refs.append(_reference(q[start : start + n - p], fb.token_to_kv_pool, table, row, n, kv_heads, p))
        start += n - p
    return q, k, v, fb, torch.cat(refs)


@pytest.mark.parametrize("mode", ["decode", "extend"])
@pytest.mark.parametrize("isa", LEVELS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim, group, kv_heads", SHAPES)
def test_cascade(mode, isa, dtype, dim, group, kv_heads, monkeypatch):
    name = f"cpu-{isa}"
    _path(name, monkeypatch)
    heads = group * kv_heads
    q, k, v, fb, ref = _cascade_case(mode, dtype, dim, kv_heads, heads)
    on, off = _backends(name, SMALL)
    assert on.decode_kernel.isa == isa
    calls = _counting(monkeypatch)
    got, want = _both(on, off, (q, k, v, fb), RadixAttention(0, heads, kv_heads, dim, dim**-0.5))
    assert on.cascade_forwards[mode] == 1 and off.cascade_forwards[mode] == 0
    # part (a) in the prefix kernel, part (b) seeded with it in the decode or extend kernel (cascade on), and
    # the plain kernel (cascade off)
    kernel = "__call__" if mode == "decode" else "extend"
    amx = mode == "extend" and off.plan.uses("extend_amx", dtype)  # cascade off: bf16 extend on the tiles
    assert calls == {"shared_prefix": 1, kernel: 1 if amx else 2}, calls
    _assert_close(got.view(q.shape), ref, dtype, f"cascade {mode}")
    _assert_close(want.view(q.shape), ref, dtype, f"plain {mode}")


# ---- (d) the AMX extend kernel: bf16, CPUs with AMX-BF16 --------------------------------------------------

@pytest.mark.parametrize("dim, group, kv_heads", SHAPES)
def test_amx_extend(dim, group, kv_heads):
    q, k_buf, _, _, _ = _problem([1], [0], kv_heads, group * kv_heads, dim, torch.bfloat16)
    assert _amx_kernel().extend_supports(q, k_buf)
    _check_amx(LENS, PREFIX, kv_heads, group * kv_heads, dim)


# ---- (e) the one-call C decoder: tiny Llamas of these head shapes, bit-equal to the Python layers ----------

DECODER_SHAPES = [pytest.param(dim, group, kv_heads, id=_shape_id(dim, group, kv_heads))
                  for dim in (64, 128) for group, kv_heads in ((1, 4), (4, 2), (8, 1))]


def _tiny_llama(path: Path, dim: int, group: int, kv_heads: int) -> Path:
    """A random two-layer Llama with these heads saved to `path`. NOTE: one hidden and intermediate size
    for every shape, so that only the rotary op is compiled anew per shape (fused_ops.py: ~7 s cold)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=group * kv_heads, num_key_value_heads=kv_heads, head_dim=dim,
                         max_position_embeddings=512, initializer_range=0.2, rms_norm_eps=1e-6,
                         eos_token_id=1, bos_token_id=2)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(str(path))
    save_tiny_tokenizer(path)
    return path


@pytest.mark.parametrize("dim, group, kv_heads", DECODER_SHAPES)
def test_c_decoder(tmp_path, monkeypatch, dim, group, kv_heads):
    if load_gemv_kernel() is None:
        pytest.skip("needs AVX512-BF16 (the GEMV kernel); the C decoder is not built here")
    folder = _tiny_llama(tmp_path, dim, group, kv_heads)
    runs = {}
    for on in (False, True):
        runner = _runner(folder, monkeypatch, on)
        assert runner.model.config.head_dim == dim and runner.model.config.num_kv_heads == kv_heads
        runs[on] = _decode_run(runner, len(LENS), LENS)  # prompts of LENS tokens, then three decode steps
        assert runs[on][2] == ([len(LENS)] * 3 if on else [])
    (off_logits, off_kv, _), (on_logits, on_kv, _) = runs[False], runs[True]
    for off, on in zip(off_logits, on_logits, strict=True):
        assert torch.equal(on, off)
    assert torch.equal(on_kv, off_kv)


F32_DECODER_SHAPES = [pytest.param(dim, group, kv_heads, id=_shape_id(dim, group, kv_heads))
                      for dim, group, kv_heads in ((64, 8, 1), (128, 4, 2), (128, 1, 4))]


@pytest.mark.parametrize("dim, group, kv_heads", F32_DECODER_SHAPES)
def test_c_decoder_f32(tmp_path, monkeypatch, dim, group, kv_heads):
    """The float32 build over bf16 weights at the AVX2 level (the lowest it runs; test_c_decoder_f32.py covers
    each level): equal to the Python layers to float32 rounding for these heads."""
    from test_c_decoder_f32 import _runner as f32_runner

    force_level("avx2", monkeypatch)
    folder = _tiny_llama(tmp_path, dim, group, kv_heads)
    runs = {}
    for on in (False, True):
        runner = f32_runner(folder, monkeypatch, on)
        assert runner.model.config.head_dim == dim and (runner.model.c_decoder is not None) == on
        runs[on] = _decode_run(runner, len(LENS), LENS)
        assert runs[on][2] == ([len(LENS)] * 3 if on else [])
    (off_logits, off_kv, _), (on_logits, on_kv, _) = runs[False], runs[True]
    for off, on in zip(off_logits, on_logits, strict=True):
        assert rel_err(on, off) < 1e-5
    assert rel_err(on_kv, off_kv) < 1e-5
