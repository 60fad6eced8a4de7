"""Regressions of the scheduler on the REAL embedded model (SmolLM2-135M, float32), both loops.

A near-pool-size prompt after earlier requests left evictable KV in the tree: a server once died
with `out of KV memory allocating 1019 prefill slot(s) (available=554, evictable=470, protected=0)`
on a 1,024-token pool. Free + evictable covers the prompt, so the allocation must evict and succeed.
"""

from __future__ import annotations

import random

import pytest

from radixserve.managers.scheduler import Scheduler
from radixserve.mem_cache.conservation import check_conservation
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.protocol.io_struct import TokenizedGenerateReqInput
from radixserve.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs

pytestmark = pytest.mark.slow

POOL = 1024


@pytest.fixture(autouse=True)
def _strict(monkeypatch):
    monkeypatch.setenv("RADIXSERVE_STRICT_CHECKS", "1")


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 9000) for _ in range(n)]


def _conserve(sched: Scheduler) -> None:
    check_conservation(sched.token_to_kv_pool_allocator, sched.tree_cache, sched.req_to_token_pool,
                       [r.kv for r in sched.active_requests()])


def _run_big_after_evictable(loaded, overlap: bool, big_len: int,
                             early_steps: int | None) -> tuple[dict[str, list[int]], Scheduler]:
    """Five requests sharing a head, then a `big_len` prompt: after they finished (`early_steps=None`)
    or after `early_steps` steps, while they still run and hold their KV."""
    args = ServerArgs(dtype="float32", device="cpu", disable_overlap_schedule=not overlap, max_total_tokens=POOL)
    outputs: dict[str, list[int]] = {}

    def sink(out) -> None:
        for o in out.outputs:
            outputs.setdefault(o.rid, []).extend(o.new_token_ids)

    sched = Scheduler(args, ModelRunner(args, loaded), output_sink=sink)
    run = sched.run_until_idle_overlap if overlap else sched.run_until_idle
    rng = random.Random(11)
    system = _tokens(rng, 30)  # NOTE: a shared head, so the tree has an inner node and split leaves
    for i in range(5):
        prompt = system + _tokens(rng, 60 + 7 * i)
        sched.input_queue.put(TokenizedGenerateReqInput(f"early{i}", prompt,
                                                        SamplingParams(max_new_tokens=6, temperature=0.0,
                                                                       ignore_eos=True)))
    if early_steps is None:
        run(5_000, on_step=lambda: _conserve(sched))
        evictable = sched.tree_cache.evictable_size()
        free = sched.token_to_kv_pool_allocator.available_size()
        assert free + evictable == sched.max_total_num_tokens and free < big_len <= free + evictable
    else:
        step = sched.run_step_overlap if overlap else sched.run_step
        for _ in range(early_steps):
            step(block_when_idle=False)
            _conserve(sched)
        assert sched.active_requests(), "the early requests should still be running"
    big = _tokens(rng, big_len)
    sched.input_queue.put(TokenizedGenerateReqInput("big", big, SamplingParams(max_new_tokens=3, temperature=0.0,
                                                                                 ignore_eos=True)))
    run(5_000, on_step=lambda: _conserve(sched))
    if overlap:
        sched.close_overlap()
    check_conservation(sched.token_to_kv_pool_allocator, sched.tree_cache, sched.req_to_token_pool, [])
    assert sched.tree_cache.protected_size() == 0 and sched.stats.evicted_tokens > 0
    return outputs, sched


@pytest.mark.long
@pytest.mark.parametrize("early_steps", [None, 3], ids=["after-idle", "while-running"])
def test_near_pool_prompt_evicts_earlier_kv_in_both_loops(loaded, early_steps):
    big_len = POOL - 5
    normal, _ = _run_big_after_evictable(loaded, overlap=False, big_len=big_len, early_steps=early_steps)
    overlapped, sched = _run_big_after_evictable(loaded, overlap=True, big_len=big_len, early_steps=early_steps)
    assert set(normal) == set(overlapped) == {f"early{i}" for i in range(5)} | {"big"}
    assert len(normal["big"]) == 3
    assert overlapped == normal
    assert sched.pipeline_counters.processed == sched.pipeline_counters.launched
