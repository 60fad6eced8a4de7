"""The scheduler driving the REAL embedded model (SmolLM2-135M, float32) on tiny KV pools.

Every test checks the conservation identity after every step. Greedy outputs under pressure
(retraction, eviction, chunking) are compared with the same prompts run on a roomy pool.
"""

from __future__ import annotations

import random

import pytest

from radixserve.client.text_stream import final_text
from radixserve.managers.scheduler import Scheduler
from radixserve.mem_cache.conservation import check_conservation
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.protocol.io_struct import AbortReq, TokenizedGenerateReqInput
from radixserve.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _strict(monkeypatch):
    monkeypatch.setenv("RADIXSERVE_STRICT_CHECKS", "1")


class Harness:
    def __init__(self, loaded, **kw) -> None:
        kw.setdefault("max_running_requests", 8)
        args = ServerArgs(dtype="float32", device="cpu", disable_overlap_schedule=True, **kw)
        self.outputs: dict[str, dict] = {}
        self.sched = Scheduler(args, ModelRunner(args, loaded), output_sink=self._sink)
        self.tokenizer = self.sched.tokenizer
        self.steps = 0

    def _sink(self, out) -> None:
        for o in out.outputs:
            rec = self.outputs.setdefault(o.rid, {"ids": [], "finish": None})
            rec["ids"].extend(o.new_token_ids)
            rec.update(finish=o.finished_reason, cached=o.cached_tokens)

    def submit(self, rid: str, ids: list[int], **params) -> None:
        params.setdefault("temperature", 0.0)
        self.sched.input_queue.put(TokenizedGenerateReqInput(rid, list(ids), SamplingParams(**params)))

    def conserve(self) -> None:
        s = self.sched
        check_conservation(s.token_to_kv_pool_allocator, s.tree_cache, s.req_to_token_pool,
                           [r.kv for r in s.active_requests()])

    def step(self) -> None:
        self.sched.run_step(block_when_idle=False)
        self.steps += 1
        self.conserve()

    def drain(self) -> None:
        self.steps += self.sched.run_until_idle(20_000, on_step=self.conserve)
        self.conserve()
        assert self.sched.tree_cache.protected_size() == 0
        assert "error" not in self.sched.check_memory()  # the idle self-check agrees

    def ids(self, rid: str) -> list[int]:
        return self.outputs[rid]["ids"]


def _prompts(h: Harness, n: int, seed: int, lo: int = 8, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    words = [t for t in range(1000, 9000)]
    return [[rng.choice(words) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def _reference(loaded, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """Each prompt alone on a roomy pool, cache off: the plain greedy continuation."""
    h = Harness(loaded, max_total_tokens=4096, disable_radix_cache=True, chunked_prefill_size=-1)
    out = []
    for i, p in enumerate(prompts):
        h.submit(f"ref{i}", p, max_new_tokens=max_new, ignore_eos=True)
        h.drain()
        out.append(h.ids(f"ref{i}"))
    return out


def test_forced_retraction_keeps_outputs_and_resumes(loaded, monkeypatch):
    prompts = _prompts(Harness(loaded, max_total_tokens=256), 5, seed=1, lo=20, hi=30)
    want = _reference(loaded, prompts, 12)
    monkeypatch.setenv("RADIXSERVE_TEST_RETRACT_INTERVAL", "3")  # retract one request every 3 decode steps
    h = Harness(loaded, max_total_tokens=256)
    for i, p in enumerate(prompts):
        h.submit(f"r{i}", p, max_new_tokens=12, ignore_eos=True)
    h.drain()
    assert h.sched.stats.num_retractions >= 3
    assert [h.ids(f"r{i}") for i in range(5)] == want
    # a retracted request re-prefills its prompt from the tree, and its cached_tokens is not recounted
    assert all(h.outputs[f"r{i}"]["cached"] == 0 for i in range(5))


def test_eviction_under_a_tiny_pool(loaded):
    h = Harness(loaded, max_total_tokens=96, max_running_requests=2)
    prompts = _prompts(h, 6, seed=2, lo=30, hi=40)
    want = _reference(loaded, prompts[:2], 4)
    for i, p in enumerate(prompts):
        h.submit(f"r{i}", p, max_new_tokens=4, ignore_eos=True)
        h.drain()
    assert h.sched.stats.evicted_tokens >= 4 * 30
    h.submit("again", prompts[0], max_new_tokens=4, ignore_eos=True)  # evicted long ago: no hit
    h.drain()
    assert h.outputs["again"]["cached"] == 0
    assert [h.ids("r0"), h.ids("r1"), h.ids("again")] == [want[0], want[1], want[0]]


def test_chunked_prefill_chunk_16(loaded):
    h = Harness(loaded, max_total_tokens=1024, chunked_prefill_size=16)
    prompts = _prompts(h, 3, seed=3, lo=40, hi=70)
    want = _reference(loaded, prompts, 6)
    for i, p in enumerate(prompts):
        h.submit(f"r{i}", p, max_new_tokens=6, ignore_eos=True)
    prefill_batches = 0
    while not h.sched.is_idle() or not h.sched.input_queue.empty():
        h.step()
        batch = h.sched.last_batch
        if batch is not None and batch.forward_mode.is_extend():
            prefill_batches += 1
            assert batch.prefill_new_tokens <= 16
    h.drain()
    assert [h.ids(f"r{i}") for i in range(3)] == want
    assert prefill_batches >= sum(-(-len(p) // 16) for p in prompts)
    # the same long prompt again: its chunks are all in the tree now
    h.submit("again", prompts[0], max_new_tokens=6, ignore_eos=True)
    h.drain()
    assert h.outputs["again"]["cached"] == len(prompts[0]) - 1 and h.ids("again") == want[0]


def test_duplicated_prompts_in_one_batch(loaded):
    h = Harness(loaded, max_total_tokens=1024)
    prompt = _prompts(h, 1, seed=4, lo=50, hi=51)[0]
    for i in range(4):
        h.submit(f"d{i}", prompt, max_new_tokens=5, ignore_eos=True)
    h.drain()
    outs = [h.ids(f"d{i}") for i in range(4)]
    assert outs[1:] == outs[:1] * 3 and outs[0] == _reference(loaded, [prompt], 5)[0]
    # in-batch dedup: the first computes the prompt, the other three wait a round and reuse it
    assert [h.outputs[f"d{i}"]["cached"] for i in range(4)] == [0, 49, 49, 49]
    assert h.sched.stats.prefill_tokens_computed == 50 + 3


def test_abort_at_each_stage(loaded):
    h = Harness(loaded, max_total_tokens=512, chunked_prefill_size=16)
    prefix = _prompts(h, 1, seed=5, lo=30, hi=31)[0]
    h.submit("warm", prefix, max_new_tokens=1)
    h.drain()
    # waiting
    h.submit("waiting", prefix + [42], max_new_tokens=8)
    h.sched.input_queue.put(AbortReq("waiting"))
    h.step()
    # admitted with its prefix locked and KV allocated; abort arrives before the forward
    h.submit("admitted", prefix + [43], max_new_tokens=8)
    h.sched.process_input_requests(h.sched.recv_requests())
    batch = h.sched.get_next_batch_to_run()
    assert [r.rid for r in batch.reqs] == ["admitted"] and h.sched.tree_cache.protected_size() == 30
    h.sched.abort_request("admitted")
    h.sched.process_batch_result(h.sched.run_batch(batch))
    h.sched.last_batch = batch
    h.conserve()
    # mid-chunk
    h.submit("chunked", _prompts(h, 1, seed=6, lo=60, hi=61)[0], max_new_tokens=8)
    h.step()
    assert h.sched.chunked_req is not None
    h.sched.input_queue.put(AbortReq("chunked"))
    h.step()
    # decoding
    h.submit("decoding", prefix + [44], max_new_tokens=40, ignore_eos=True)
    for _ in range(3):
        h.step()
    h.sched.input_queue.put(AbortReq("decoding"))
    h.step()
    # finished, not yet delivered to anyone: abort is a no-op
    h.submit("finished", prefix + [45], max_new_tokens=2, ignore_eos=True)
    h.drain()
    h.sched.input_queue.put(AbortReq("finished"))
    h.drain()
    kinds = {rid: h.outputs[rid]["finish"]["type"] for rid in ("waiting", "admitted", "chunked", "decoding", "finished")}
    assert kinds == {"waiting": "abort", "admitted": "abort", "chunked": "abort", "decoding": "abort",
                     "finished": "length"}
    assert h.ids("waiting") == h.ids("admitted") == h.ids("chunked") == [] and 0 < len(h.ids("decoding")) < 40
    assert h.sched.stats.num_aborts == 4


@pytest.mark.long
def test_200_random_requests_with_stops(loaded):
    h = Harness(loaded, max_total_tokens=384, chunked_prefill_size=32, max_running_requests=16,
                schedule_conservativeness=0.3)
    rng = random.Random(7)
    base = _prompts(h, 4, seed=8, lo=20, hi=60)
    stops = [" the", ".", ",", "\n", " and"]
    params = {}
    for i in range(200):
        prompt = rng.choice(base)[:rng.randrange(0, 40)] + _prompts(h, 1, seed=100 + i, lo=1, hi=20)[0]
        sp = dict(max_new_tokens=rng.randrange(1, 7), ignore_eos=rng.random() < 0.5,
                  stop=[rng.choice(stops)] if rng.random() < 0.4 else [],
                  stop_token_ids=[rng.randrange(1000, 2000)] if rng.random() < 0.2 else [])
        params[f"q{i}"] = SamplingParams(**sp)
        h.submit(f"q{i}", prompt, **sp)
        if i % 10 == 9:
            for _ in range(rng.randrange(1, 4)):
                h.step()
    h.drain()
    assert len(h.outputs) == 200 and h.sched.stats.num_finished == 200
    for rid, rec in h.outputs.items():
        sp, ids, finish = params[rid], rec["ids"], rec["finish"]
        assert 1 <= len(ids) <= sp.max_new_tokens
        if finish["type"] == "length":
            assert len(ids) == sp.max_new_tokens
        elif isinstance(finish["matched"], int):
            assert ids[-1] == finish["matched"] and (ids[-1] in sp.stop_token_ids or ids[-1] == 2)
        else:
            assert finish["matched"] in sp.stop and finish["matched"] in h.tokenizer.decode(ids)
            assert finish["matched"] not in final_text(h.tokenizer, ids, finish)
    assert h.sched.stats.cached_tokens > 0
