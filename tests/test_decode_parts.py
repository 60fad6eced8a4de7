"""Decode attention over long contexts: split into parts (decode_attention.c, `context_parts`) and merged by
log-sum-exp. The parts depend on a request's own length only, so its result is the same alone or in any batch,
at any thread count; and the merged softmax equals the reference across part bounds."""

from __future__ import annotations

import pytest
import torch
from kernel_levels import LEVELS, kernel_at
from test_model_attention import _decode_batch

PART_TOKENS, MAX_PARTS = 1024, 32  # decode_attention.c


def _run(kernel, q, fb, threads: int) -> torch.Tensor:
    k_all, v_all = fb.token_to_kv_pool.get_kv_buffer(0)
    max_len = int(fb.seq_lens.max())
    table = fb.req_to_token_pool.req_to_token[fb.req_pool_indices, :max_len].contiguous()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return kernel(q, k_all, v_all, table.reshape(-1), fb.seq_lens, max_len, q.shape[-1] ** -0.5)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("isa", LEVELS)
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 8e-3)])
@pytest.mark.parametrize("kv_heads, heads, dim", [(3, 9, 64), (1, 8, 128), (2, 14, 64)])
def test_long_contexts_in_parts_match_the_reference(isa, dtype, atol, kv_heads, heads, dim):
    kernel = kernel_at(isa)
    # one part, exactly one part, just over, several, and past MAX_PARTS parts of PART_TOKENS (longer parts)
    seq_lens = [5, PART_TOKENS, PART_TOKENS + 1, 2500, MAX_PARTS * PART_TOKENS + 300]
    q, _, _, fb, ref = _decode_batch(seq_lens, kv_heads, heads, dtype, dim)
    for threads in (1, 2):
        got = _run(kernel, q, fb, threads)
        assert got.dtype == dtype
        assert torch.allclose(got.double(), ref, atol=atol), threads


@pytest.mark.parametrize("isa", LEVELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_requests_result_does_not_depend_on_its_batch_or_threads(isa, dtype):
    """The same long request alone (its parts spread over threads by kv head and part) and beside others
    (whole-request units, more parts in the batch than it has): bit for bit the same."""
    kernel = kernel_at(isa)
    seq_lens = [1000, 40, 3000, PART_TOKENS, PART_TOKENS + 1]
    q, _, _, fb, _ = _decode_batch(seq_lens, 3, 9, dtype, 64)
    together = {threads: _run(kernel, q, fb, threads) for threads in (1, 2, 3)}
    assert torch.equal(together[1], together[2]) and torch.equal(together[1], together[3])
    for i, n in enumerate(seq_lens):
        alone_fb = fb.__class__.for_decode([5], fb.req_pool_indices[i : i + 1].tolist(), [n],
                                           fb.out_cache_loc[i : i + 1], "cpu")
        alone_fb.req_to_token_pool, alone_fb.token_to_kv_pool = fb.req_to_token_pool, fb.token_to_kv_pool
        for threads in (1, 2):
            alone = _run(kernel, q[i : i + 1], alone_fb, threads)
            assert torch.equal(alone[0], together[1][i]), (i, n, threads)


@pytest.mark.parametrize("isa", LEVELS)
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_a_seed_enters_a_long_context_once(isa, dtype, atol):
    """Cascade's seed (the shared prefix's output and log-sum-exp) merged with a suffix long enough for parts:
    the result is attention over prefix and suffix together, the prefix counted once."""
    kernel = kernel_at(isa)
    prefix, suffixes = 300, [PART_TOKENS * 2 + 7, 20]
    seq_lens = [prefix + n for n in suffixes]
    q, _, _, fb, ref = _decode_batch(seq_lens, 2, 8, dtype, 64)
    k_all, v_all = fb.token_to_kv_pool.get_kv_buffer(0)
    table = fb.req_to_token_pool.req_to_token[fb.req_pool_indices]
    seed_out, seed_lse = [], []
    for i in range(len(seq_lens)):  # each request's own first `prefix` slots stand for the shared prefix
        slots = table[i, :prefix].long()
        k, v = k_all[slots].double(), v_all[slots].double()
        scores = torch.einsum("hd,thd->ht", q[i].double(), k.repeat_interleave(4, dim=1)) * 64**-0.5
        seed_lse.append(torch.logsumexp(scores, dim=1))
        seed_out.append(torch.einsum("ht,thd->hd", torch.softmax(scores, dim=1), v.repeat_interleave(4, dim=1)))
    max_len = max(suffixes)
    own = torch.zeros(len(seq_lens), max_len, dtype=torch.int32)
    for i, n in enumerate(suffixes):
        own[i, :n] = table[i, prefix : prefix + n]
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            got = kernel(q, k_all, v_all, own.reshape(-1), torch.tensor(suffixes), max_len, 64**-0.5,
                         seed=(torch.stack(seed_out).to(dtype), torch.stack(seed_lse).float()))
            assert torch.allclose(got.double(), ref, atol=atol), threads
    finally:
        torch.set_num_threads(before)
