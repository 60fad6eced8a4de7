"""Cascade attention for window layers (window_cascade.py) equals the same backend's window path with cascade off.

Random pools whose request rows share a forced prefix of scattered slots (test_cascade_attention's batches), a
window layer, and batches where some queries see none of the shared prefix, where all see all of what part (a)
reads, and mixes of both; on the torch paths, the CPU backend as its selection has it (torch part (a) seeding the
C decode and extend kernels) and with every C kernel at each kernel level. Also: the C prefix kernel's per-query
`first` against torch, the hybrid pool's translated slots (with the KV outside every window tombstoned), the
policy measuring the shared keys a window reads, and an Engine on a tiny Gemma 3 with cascade on and off.
"""

from __future__ import annotations

import copy

import pytest
import torch
from kernel_levels import LEVELS, force_level, kernel_at, select_everything
from test_cascade_attention import _decode_batch, _extend_batch
from test_model_support import one_torch_thread

from radixserve.configs.row_table import CascadePolicy
from radixserve.kernels.attention import load_decode_kernel
from radixserve.layers.attention import cascade, create_attention_backend, window_cascade
from radixserve.layers.attention.window import WindowDecodeMetadata, WindowExtendMetadata
from radixserve.layers.radix_attention import RadixAttention
from radixserve.platform import KERNEL_ISAS

_single_thread = pytest.fixture(scope="module", autouse=True)(one_torch_thread)

W, WIDE = 16, 100  # WIDE: part (a) spans several 64-key chunks of the kernels
POLICY = CascadePolicy(min_prefix=4, min_decode_batch=2, min_decode_saved=0)
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
PATHS = ["torch", "torch-math", "cpu", *(f"cpu-{isa}" for isa in KERNEL_ISAS)]
SHAPES = [(2, 2, 64), (2, 6, 128)]  # (kv_heads, heads, dim): GQA ratios 1 and 3, head dims 64 and 128
# (window, shared P, own lengths): the request at P + own - 1 sees the shared keys from P + own - window on
DECODE_CASES = [
    (W, 40, [1, 30, 3, 20]),  # mixed: the second and fourth see none of the shared prefix, the others part of it
    (W, 40, [5, 5, 5]),  # all see all of part (a) (positions 29 .. 39): the prefix kernel runs unmasked
    (W, 10, [2, 30, 3]),  # part (a) from position 0; the second sees none
    (WIDE, 130, [1, 9, 2, 120]),  # part (a) 31 .. 129; the last sees none
]
# (window, shared P, cached prefix lengths, new tokens)
EXTEND_CASES = [
    (W, 40, [40, 40, 52], [7, 1, 20]),  # mixed, also within one request: its later tokens leave the prefix
    (W, 40, [40, 40, 40], [1, 1, 1]),  # all see all of part (a), unmasked
    (W, 8, [8, 30], [16, 5]),  # part (a) from position 0; the second request sees none of it
    (WIDE, 130, [130, 140, 230], [3, 2, 40]),  # part (a) 31 .. 129; the last request sees none
]


def _path(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if name.startswith("cpu") and load_decode_kernel() is None:
        pytest.skip("no C compiler here, so the native kernels cannot be built")
    if name.startswith("cpu-"):  # every C kernel: the prefix kernel with `first`, the seeded decode and extend
        force_level(name.removeprefix("cpu-"), monkeypatch)
        select_everything(monkeypatch)
    if name == "torch-math":  # no CPU flash op, and score blocks small enough to split every call
        monkeypatch.setattr(cascade, "_CPU_FLASH", None)
        monkeypatch.setattr(cascade, "MAX_SCORE_ELEMENTS", 2000)


def _on_off(name: str):
    name = "torch" if name == "torch-math" else name.split("-")[0]
    on, off = (create_attention_backend(name, torch.device("cpu"), windows=(W, WIDE)) for _ in range(2))
    on.cascade, off.cascade = POLICY, None
    return on, off


def _run(backend, batch, layer: RadixAttention) -> torch.Tensor:
    q, k, v, fb = batch
    backend.init_forward_metadata(fb)
    return backend.forward(q, k, v, layer, fb)


def _run_both(on, off, batch, layer: RadixAttention) -> tuple[torch.Tensor, torch.Tensor, object, object]:
    """Both outputs, and the metadata each backend built for the batch (it travels on the batch)."""
    got = _run(on, batch, layer)
    m_on = batch[3].attn_metadata
    want = _run(off, batch, layer)
    return got, want, m_on, batch[3].attn_metadata


@pytest.mark.parametrize("name", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads, heads, dim", SHAPES)
def test_decode_window_cascade_matches_window_path(name, dtype, kv_heads, heads, dim, monkeypatch):
    _path(name, monkeypatch)
    on, off = _on_off(name)
    for window, shared, own in DECODE_CASES:
        layer = RadixAttention(0, heads, kv_heads, dim, dim**-0.5, sliding_window=window)
        batch = _decode_batch(shared, own, kv_heads, heads, dim, dtype)
        got, want, m_on, m_off = _run_both(on, off, batch, layer)
        assert isinstance(m_on.window_decode[window], cascade.CascadeDecodeMetadata), (shared, own)
        assert isinstance(m_off.window_decode[window], WindowDecodeMetadata)
        assert not got.isnan().any() and got.dtype == dtype
        assert torch.allclose(got.float(), want.float(), atol=TOLERANCE[dtype]), (shared, own)
    assert on.window_cascade_forwards["decode"] == len(DECODE_CASES)


@pytest.mark.parametrize("name", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads, heads, dim", SHAPES)
def test_extend_window_cascade_matches_window_path(name, dtype, kv_heads, heads, dim, monkeypatch):
    _path(name, monkeypatch)
    on, off = _on_off(name)
    for window, shared, prefix_lens, extend_lens in EXTEND_CASES:
        layer = RadixAttention(0, heads, kv_heads, dim, dim**-0.5, sliding_window=window)
        batch = _extend_batch(shared, prefix_lens, extend_lens, kv_heads, heads, dim, dtype)
        got, want, m_on, m_off = _run_both(on, off, batch, layer)
        assert isinstance(m_on.window_extend[window], cascade.CascadeExtendMetadata), (shared, prefix_lens)
        assert isinstance(m_off.window_extend[window], WindowExtendMetadata)
        assert not got.isnan().any()
        assert torch.allclose(got.float(), want.float(), atol=TOLERANCE[dtype]), (shared, prefix_lens)
    assert on.window_cascade_forwards["extend"] == len(EXTEND_CASES)


def test_part_a_reads_only_what_the_windows_see():
    """Decode [41, 70, 43, 60] over a 40-token shared prefix, W = 16: the queries' windows start at 25, 54, 27
    and 44, so part (a) is positions 25 .. 39 and the second and fourth queries see none of it."""
    q, k, v, fb = _decode_batch(40, [1, 30, 3, 20], 1, 2, 16, torch.float32)
    plan = window_cascade.plan_decode(fb, W, 40, POLICY)
    row = fb.req_to_token_pool.req_to_token[fb.req_pool_indices[0]]
    assert torch.equal(plan.prefix_slots, row[25:40])
    assert plan.prefix_first.tolist() == [0, 15, 2, 15]
    assert plan.suffix_lens.tolist() == [1, 16, 3, 16] and plan.suffix_max_len == 16
    # NOTE: the policy counts the 15 shared keys the window reads, not the 40 of the prefix
    assert window_cascade.plan_decode(fb, W, 40, CascadePolicy(16, 2, 0)) is None
    assert cascade.plan_decode(fb, CascadePolicy(16, 2, 0), 40) is not None
    far = _decode_batch(40, [20, 30], 1, 2, 16, torch.float32)[3]  # windows start at 44 and 54: none shared
    assert window_cascade.plan_decode(far, W, 40, POLICY) is None


@pytest.mark.parametrize("isa", LEVELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads, heads, dim", [(2, 2, 64), (1, 4, 128), (2, 6, 48)])
def test_prefix_kernel_first_matches_torch(isa, dtype, kv_heads, heads, dim):
    """Per-token lower bounds in any order (not ascending within a 16-row unit), empty rows, several chunks."""
    kernel = kernel_at(isa)
    g = torch.Generator().manual_seed(7)
    n, prefix = 21, 150
    k_buf, v_buf = (torch.randn(200, kv_heads, dim, generator=g).to(dtype) for _ in range(2))
    slots = (torch.randperm(199, generator=g)[:prefix] + 1).to(torch.int32)
    q = torch.randn(n, heads, dim, generator=g).to(dtype)
    first = torch.randint(0, prefix + 1, (n,), generator=g).to(torch.int32)
    first[[0, 5, 6]] = prefix  # these see nothing
    first[[1, 2]] = 0
    out, lse = kernel.shared_prefix(q, k_buf, v_buf, slots, 0.125, first=first)
    meta = cascade.CascadeDecodeMetadata(slots, slots, torch.ones(n), 1, None, first)
    want_out, want_lse = cascade._part_a(q, k_buf, v_buf, meta, 0.125, None)
    empty = first == prefix
    assert (lse[empty] == float("-inf")).all() and (out[empty] == 0).all()
    assert torch.allclose(lse[~empty], want_lse[~empty], atol=1e-4 if dtype == torch.float32 else 5e-2)
    assert torch.allclose(out.float(), want_out.float(), atol=TOLERANCE[dtype])
    plain = kernel.shared_prefix(q, k_buf, v_buf, slots, 0.125)
    zeros = kernel.shared_prefix(q, k_buf, v_buf, slots, 0.125, first=torch.zeros(n, dtype=torch.int32))
    assert torch.equal(plain[0], zeros[0]) and torch.equal(plain[1], zeros[1])
    with pytest.raises(ValueError, match="rejected"):
        kernel.shared_prefix(q, k_buf, v_buf, slots, 0.125, first=torch.full((n,), prefix + 1, dtype=torch.int32))


def _hybrid(batch, tombstoned: torch.Tensor):
    """The batch's pool as a hybrid one: the window layer's K/V in buffers of their own, indexed by window slots
    through `full_to_window`; the full slots in `tombstoned` lose their window KV (slot 0, holding junk)."""
    q, k, v, fb = batch
    plain = fb.token_to_kv_pool
    size = plain.k_buffer[0].shape[0]
    full_to_window = torch.zeros(size, dtype=torch.int32)
    full_to_window[1:] = torch.randperm(size - 1, generator=torch.Generator().manual_seed(5)).to(torch.int32) + 1
    full_to_window[tombstoned.long()] = 0
    hybrid = type(plain)(size, 1, plain.dtype, plain.k_buffer[0].shape[1], plain.k_buffer[0].shape[2], 1, "cpu")
    for mine, theirs in ((hybrid.k_buffer[0], plain.k_buffer[0]), (hybrid.v_buffer[0], plain.v_buffer[0])):
        mine[full_to_window.long()] = theirs
        mine[0] = 1e3  # NOTE: a read of a tombstoned slot would show
    hybrid.full_to_window = full_to_window
    hybrid_fb = copy.copy(fb)
    hybrid_fb.token_to_kv_pool = hybrid
    return q, k, v, hybrid_fb


@pytest.mark.parametrize("name", ["torch", "cpu", "cpu-avx2"])
def test_hybrid_pool_reads_translated_slots_inside_the_windows(name, monkeypatch):
    _path(name, monkeypatch)
    kv_heads, heads, dim = 2, 6, 64
    layer = RadixAttention(0, heads, kv_heads, dim, dim**-0.5, sliding_window=W)
    on, off = _on_off(name)
    batch = _decode_batch(40, [1, 30, 3, 20], kv_heads, heads, dim, torch.float32)
    row = batch[3].req_to_token_pool.req_to_token[batch[3].req_pool_indices[0]]
    want = _run(off, batch, layer)
    hybrid = _hybrid(batch, row[:25])
    got = _run(on, hybrid, layer)  # positions 0 .. 24 are outside every window
    assert isinstance(hybrid[3].attn_metadata.window_decode[W], cascade.CascadeDecodeMetadata)
    assert torch.allclose(got, want, atol=1e-5)
    batch = _extend_batch(40, [40, 40, 52], [7, 1, 20], kv_heads, heads, dim, torch.float32)
    row = batch[3].req_to_token_pool.req_to_token[batch[3].req_pool_indices[0]]
    want = _run(off, batch, layer)
    hybrid = _hybrid(batch, row[:25])
    got = _run(on, hybrid, layer)  # the first queries' windows start at 25
    assert isinstance(hybrid[3].attn_metadata.window_extend[W], cascade.CascadeExtendMetadata)
    assert torch.allclose(got, want, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("one_pool", [False, True], ids=["hybrid", "one-pool"])
def test_engine_gemma3_window_cascade_matches_cascade_off(one_pool, tmp_path):
    """Tiny Gemma 3 (W = 8; window layers on the hybrid pool, or in the one pool) and ten requests over a 40-token
    cached prefix, five times the window: greedy tokens equal with cascade on and off, the window layers ran
    cascade in extend and decode, and the pools are conserved."""
    from test_model_gemma3 import _prompts, make_tiny_gemma3

    from radixserve import Engine

    make_tiny_gemma3(tmp_path)
    (prefix,) = _prompts([40], seed=31)
    prompts = [prefix + tail for tail in _prompts([1, 2, 3, 1, 2, 3, 1, 2, 3, 1], seed=32)]
    params = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}
    outputs, counts = [], []
    for disable in (False, True):
        with Engine(model_path=str(tmp_path), dtype="float32", device="cpu", max_total_tokens=1024,
                    disable_cascade_attention=disable, disable_hybrid_swa_memory=one_pool,
                    log_level="warning") as engine:
            backend = engine.model_runner.attn_backend
            if not disable:  # NOTE: scaled down to W = 8, which reads at most 8 shared keys
                backend.cascade = CascadePolicy(min_prefix=4, min_decode_batch=2, min_decode_saved=4)
            engine.generate(input_ids=prefix, sampling_params={**params, "max_new_tokens": 1})  # cache the prefix
            outputs.append([r["output_ids"] for r in engine.generate(input_ids=prompts, sampling_params=params)])
            counts.append(dict(backend.window_cascade_forwards))
            state = engine.get_internal_state()
        assert state["kv_conservation"] is not None and "error" not in state["kv_conservation"], state
        assert state["protected_tokens"] == 0 and state["num_running_reqs"] == 0
    assert counts[1] == {"decode": 0, "extend": 0}
    assert counts[0]["extend"] >= 1 and counts[0]["decode"] >= 1, counts
    assert outputs[0] == outputs[1]
