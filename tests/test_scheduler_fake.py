"""Fast scheduler tests on a fake model whose next token is a hash of the whole sequence READ FROM KV.

The fake writes each input token id into its "KV" slot and computes the next token from the ids it
reads back through the request's `req_to_token` row. So a request's outputs equal a plain reference
loop exactly when every slot it reads is the right one: any row/slot mix-up (a freed slot reused,
a wrong prefix, a lost chunk) changes the tokens. The real-model tests are in test_scheduler.py.
"""

from __future__ import annotations

import random
import time
from types import SimpleNamespace

import pytest
import torch

from radixserve.layers.sampler import compute_input_logprobs
from radixserve.managers.scheduler import Scheduler
from radixserve.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from radixserve.mem_cache.conservation import check_conservation
from radixserve.mem_cache.memory_pool import SLOT_DTYPE, ReqToTokenPool
from radixserve.protocol.io_struct import (
    AbortReq,
    FlushCacheOut,
    FlushCacheReq,
    LogprobSpec,
    TokenizedGenerateReqInput,
)
from radixserve.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs

VOCAB = 101
EOS = 0


def next_token(seq: list[int]) -> int:
    h = 0
    for i, t in enumerate(seq):
        h = (h * 31 + t * (i + 7)) % 1_000_003
    return h % VOCAB


def reference(prompt: list[int], params: SamplingParams, rule=next_token) -> list[int]:
    seq, out = list(prompt), []
    while len(out) < params.max_new_tokens:
        tok = rule(seq)
        out.append(tok)
        seq.append(tok)
        if tok in params.stop_token_ids or (not params.ignore_eos and tok == EOS):
            break
    return out


class FakeRunner:
    def __init__(self, pool_tokens: int, page_size: int = 1, max_running: int = 8, context_len: int = 512,
                 rule=next_token) -> None:
        self.rule = rule  # the next token of a sequence (read back from KV)
        self.device = torch.device("cpu")
        self.page_size = page_size
        self.context_len = context_len
        self.max_total_num_tokens = pool_tokens
        self.max_running_requests = max_running
        self.model_config = SimpleNamespace(vocab_size=VOCAB, eos_token_ids=(EOS,))
        self.tokenizer = None
        self.req_to_token_pool = ReqToTokenPool(max_running, context_len + 4)
        self.token_to_kv_pool_allocator = (TokenToKVPoolAllocator(pool_tokens) if page_size == 1
                                           else PagedTokenToKVPoolAllocator(pool_tokens, page_size))
        self.kv = torch.full((pool_tokens + page_size,), -1, dtype=torch.int64)
        self.forward_calls = 0

    def forward(self, fb, read_done=None) -> torch.Tensor:
        self.forward_calls += 1
        assert fb.out_cache_loc.dtype == SLOT_DTYPE  # NOTE: slot ids reach the forward as the allocator made them
        table = self.req_to_token_pool.req_to_token
        rows = [table[row, :n].long() for row, n in zip(fb.req_pool_indices.tolist(), fb.seq_lens_cpu, strict=True)]
        if read_done is not None:
            read_done.record()  # the rows are read: the scheduler may write them again
        self.kv[fb.out_cache_loc] = fb.input_ids
        logits = torch.zeros(fb.batch_size, VOCAB)
        for i, slots in enumerate(rows):
            logits[i, self.rule(self.kv[slots].tolist())] = 1.0
        if fb.extra_logits_indices is not None:
            fb.input_logprobs = compute_input_logprobs(self._prompt_logits(fb), fb.extra_target_ids, fb.extra_top_k)
        return logits

    def _prompt_logits(self, fb) -> torch.Tensor:
        """As the model runner: the logits at each requested flat token index, from the KV read back."""
        table = self.req_to_token_pool.req_to_token
        owner = []  # flat index -> (row, position)
        for row, pre, ext in zip(fb.req_pool_indices.tolist(), fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu,
                                 strict=True):
            owner.extend((row, pre + k) for k in range(ext))
        logits = torch.zeros(len(fb.extra_logits_indices), VOCAB)
        for j, flat in enumerate(fb.extra_logits_indices.tolist()):
            row, pos = owner[flat]
            logits[j, self.rule(self.kv[table[row, : pos + 1].long()].tolist())] = 1.0
        return logits

    def sample(self, logits: torch.Tensor, info) -> torch.Tensor:
        return logits.argmax(-1)

    def logprobs(self, logits: torch.Tensor, next_ids: torch.Tensor, info, top_k: int):
        return compute_input_logprobs(logits, next_ids, top_k)


class FakeScheduler(Scheduler):
    def sampling_info(self, reqs, output_lens, is_extend):
        return None


def make_scheduler(pool_tokens=256, page_size=1, max_running=8, chunk=-1, disable_cache=False,
                   policy="lpm", max_prefill_tokens=16384, conservativeness=1.0, rule=next_token, **extra):
    args = ServerArgs(max_total_tokens=pool_tokens, page_size=page_size, chunked_prefill_size=chunk,
                      disable_radix_cache=disable_cache, schedule_policy=policy,
                      max_prefill_tokens=max_prefill_tokens, schedule_conservativeness=conservativeness, **extra)
    outputs: dict[str, dict] = {}

    def sink(out):
        if isinstance(out, FlushCacheOut):
            outputs["__flush__"] = out
            return
        for o in out.outputs:
            rec = outputs.setdefault(o.rid, {"ids": [], "finish": None})
            rec["ids"].extend(o.new_token_ids)
            rec["finish"] = o.finished_reason
            rec["cached"] = o.cached_tokens
            if o.figures:
                rec["figures"] = o.figures
            if o.input_token_logprobs is not None:
                rec["input_logprobs"] = o.input_token_logprobs

    sched = FakeScheduler(args, FakeRunner(pool_tokens, page_size, max_running, rule=rule), output_sink=sink)
    return sched, outputs


def conserve(sched: Scheduler) -> None:
    check_conservation(sched.token_to_kv_pool_allocator, sched.tree_cache, sched.req_to_token_pool,
                       [r.kv for r in sched.active_requests()])
    assert not sched.queue.phase_problems()  # NOTE: every live request's stored phase matches what it holds


def submit(sched, rid, prompt, logprob_start_len=-1, **params):
    sp = SamplingParams(**params)
    logprob = LogprobSpec(return_logprob=logprob_start_len >= 0, logprob_start_len=logprob_start_len)
    sched.input_queue.put(TokenizedGenerateReqInput(rid, prompt, sp, logprob=logprob))
    return sp


def drain(sched, max_steps=20_000):
    sched.run_until_idle(max_steps, on_step=lambda: conserve(sched))
    conserve(sched)
    assert sched.tree_cache.protected_size() == 0
    assert sched.req_to_token_pool.available_size() == sched.req_to_token_pool.size


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("disable_cache", [False, True])
def test_fuzz_outputs_match_reference_under_pressure(page_size, disable_cache):
    rng = random.Random(1000 + page_size + 10 * disable_cache)
    # NOTE: a tiny decode reserve (conservativeness 0.05) over-admits, so decode runs out and retracts.
    sched, outputs = make_scheduler(pool_tokens=192, page_size=page_size, max_running=6, chunk=16,
                                    disable_cache=disable_cache, conservativeness=0.05)
    bases = [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(8, 60))] for _ in range(4)]
    expected, aborted = {}, set()
    for wave in range(6):
        for i in range(25):
            rid = f"w{wave}-{i}"
            prompt = rng.choice(bases)[:rng.randrange(0, 40)] + [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 30))]
            sp = submit(sched, rid, prompt, max_new_tokens=rng.randrange(0, 24), ignore_eos=rng.random() < 0.5,
                        stop_token_ids=[rng.randrange(1, VOCAB)] if rng.random() < 0.3 else [])
            expected[rid] = reference(prompt, sp)
        for _ in range(rng.randrange(1, 30)):
            sched.run_step(block_when_idle=False)
            conserve(sched)
            if rng.random() < 0.3:
                victim = f"w{wave}-{rng.randrange(25)}"
                aborted.add(victim)
                sched.input_queue.put(AbortReq(victim))
    drain(sched)
    assert set(outputs) == set(expected)
    for rid, want in expected.items():
        got = outputs[rid]
        if got["finish"]["type"] == "abort":
            assert rid in aborted and got["ids"] == want[:len(got["ids"])], rid
        else:
            assert got["ids"] == want, rid
    assert sched.stats.num_retractions > 0 and sched.stats.evicted_tokens > (0 if not disable_cache else -1)
    if not disable_cache:
        assert sched.stats.cached_tokens > 0


def test_in_batch_dedup_computes_a_shared_prefix_once():
    sched, outputs = make_scheduler(pool_tokens=2048, max_running=16)
    prefix = list(range(1, 81))
    for i in range(8):
        submit(sched, f"r{i}", prefix + [90 + i], max_new_tokens=2, ignore_eos=True)
    drain(sched)
    # first batch: r0 alone computes the 80-token prefix; the rest wait a round and hit it
    assert sched.stats.prefill_tokens_computed == 81 + 7 * 1
    assert [outputs[f"r{i}"]["cached"] for i in range(8)] == [0] + [80] * 7


def test_queue_steps_count_the_forward_steps_from_arrival_to_the_first_token():
    """meta_info's queue_steps: a 100-token prompt in chunks of 32 takes four prefill steps; a 3-token prompt
    queued behind it joins the last chunk; a request arriving at an idle scheduler gets its token from the next
    step, whatever ran before it."""
    sched, outputs = make_scheduler(pool_tokens=512, chunk=32)
    submit(sched, "long", list(range(1, 101)), max_new_tokens=3, ignore_eos=True)
    submit(sched, "short", [7, 8, 9], max_new_tokens=3, ignore_eos=True)
    drain(sched)
    assert outputs["long"]["figures"] == {"queue_steps": 4} and outputs["short"]["figures"] == {"queue_steps": 4}
    submit(sched, "late", [5, 6], max_new_tokens=2, ignore_eos=True)
    drain(sched)
    assert sched.pipeline_counters.launched > 6 and outputs["late"]["figures"] == {"queue_steps": 1}


def test_a_completion_past_the_pool_is_cut_on_admission_not_aborted_mid_decode():
    sched, outputs = make_scheduler(pool_tokens=64, max_running=4)
    submit(sched, "long", list(range(1, 61)), max_new_tokens=20, ignore_eos=True)
    submit(sched, "big", [5] * 20, max_new_tokens=100, ignore_eos=True)
    drain(sched)
    # NOTE: the same rule as the HTTP front ends' (protocol/requests.check_length): prompt + completion within the pool
    assert outputs["long"]["finish"]["type"] == "length" and len(outputs["long"]["ids"]) == 4
    assert outputs["big"]["finish"]["type"] == "length" and len(outputs["big"]["ids"]) == 44


def test_reject_never_blocks_the_queue():
    sched, outputs = make_scheduler(pool_tokens=64, max_running=4)
    submit(sched, "huge", list(range(1, 70)), max_new_tokens=4)
    submit(sched, "ok", [1, 2, 3], max_new_tokens=4, ignore_eos=True)
    drain(sched)
    assert outputs["huge"]["finish"]["type"] == "abort" and "KV cache pool holds 64" in outputs["huge"]["finish"]["message"]
    assert outputs["ok"]["finish"]["type"] == "length" and len(outputs["ok"]["ids"]) == 4


def test_flush_refused_while_running_then_done():
    sched, outputs = make_scheduler(pool_tokens=256)
    submit(sched, "a", list(range(1, 30)), max_new_tokens=8, ignore_eos=True)
    sched.run_step(block_when_idle=False)
    sched.input_queue.put(FlushCacheReq())
    sched.run_step(block_when_idle=False)
    assert outputs["__flush__"].success is False
    drain(sched)
    sched.input_queue.put(FlushCacheReq())
    sched.run_step(block_when_idle=False)
    assert outputs["__flush__"].success and outputs["__flush__"].tokens_freed > 0
    assert sched.tree_cache.total_size() == 0
    conserve(sched)


def _prefix_in_tree(sched, prefix, rid="warm"):
    submit(sched, rid, prefix, max_new_tokens=1, ignore_eos=True)
    drain(sched)


def test_abort_at_every_stage_releases_exactly_what_was_held():
    sched, outputs = make_scheduler(pool_tokens=256, chunk=16)
    prefix = list(range(1, 41))
    _prefix_in_tree(sched, prefix)
    # waiting: aborted before any step
    submit(sched, "waiting", prefix + [50], max_new_tokens=4, ignore_eos=True)
    sched.input_queue.put(AbortReq("waiting"))
    # admitted, locks held, KV allocated: abort lands between scheduling and the forward
    submit(sched, "admitted", prefix + [51], max_new_tokens=4, ignore_eos=True)
    sched.process_input_requests(sched.recv_requests())
    assert "waiting" in outputs and outputs["waiting"]["finish"]["type"] == "abort"
    batch = sched.get_next_batch_to_run()
    assert [r.rid for r in batch.reqs] == ["admitted"] and sched.tree_cache.protected_size() == 40
    sched.abort_request("admitted")
    sched.process_batch_result(sched.run_batch(batch))
    sched.last_batch = batch
    assert outputs["admitted"] == {"ids": [], "finish": outputs["admitted"]["finish"], "cached": 40}
    assert sched.tree_cache.protected_size() == 0
    conserve(sched)
    # mid-chunk: a 60-token prompt in chunks of 16, aborted after its first chunk
    submit(sched, "chunked", [7] * 60, max_new_tokens=4, ignore_eos=True)
    sched.run_step(block_when_idle=False)
    assert sched.chunked_req is not None and sched.chunked_req.rid == "chunked"
    sched.input_queue.put(AbortReq("chunked"))
    sched.run_step(block_when_idle=False)
    assert sched.chunked_req is None and outputs["chunked"]["finish"]["type"] == "abort"
    conserve(sched)
    # decoding
    submit(sched, "decoding", prefix + [52], max_new_tokens=50, ignore_eos=True)
    for _ in range(4):
        sched.run_step(block_when_idle=False)
    sched.input_queue.put(AbortReq("decoding"))
    sched.run_step(block_when_idle=False)
    assert outputs["decoding"]["finish"]["type"] == "abort" and 0 < len(outputs["decoding"]["ids"]) < 50
    # finished, then aborted (not yet read by anyone): a no-op
    submit(sched, "done", prefix + [53], max_new_tokens=2, ignore_eos=True)
    drain(sched)
    sched.input_queue.put(AbortReq("done"))
    sched.input_queue.put(AbortReq("never-existed"))
    drain(sched)
    assert outputs["done"]["finish"]["type"] == "length"
    assert sched.stats.num_aborts == 4
    assert sched.tree_cache.evictable_size() + sched.token_to_kv_pool_allocator.available_size() == 256


@pytest.mark.parametrize("policy", ["fcfs", "dfs-weight", "lpm"])
def test_policies_give_reference_outputs(policy):
    rng = random.Random(7)
    sched, outputs = make_scheduler(pool_tokens=512, policy=policy, chunk=32)
    bases = [[rng.randrange(1, VOCAB) for _ in range(40)] for _ in range(3)]
    expected = {}
    for i in range(30):
        prompt = bases[i % 3][:rng.randrange(10, 40)] + [rng.randrange(1, VOCAB)]
        expected[f"r{i}"] = reference(prompt, submit(sched, f"r{i}", prompt, max_new_tokens=5, ignore_eos=True))
    drain(sched)
    assert {rid: outputs[rid]["ids"] for rid in expected} == expected
    assert sched.stats.cached_tokens > (0 if policy != "fcfs" else -1)


def test_forced_eviction_counts_and_keeps_outputs_right():
    sched, outputs = make_scheduler(pool_tokens=64, max_running=2)
    expected = {}
    for i in range(12):
        prompt = [i + 1] * 30
        expected[f"r{i}"] = reference(prompt, submit(sched, f"r{i}", prompt, max_new_tokens=3, ignore_eos=True))
        drain(sched)
    assert {rid: outputs[rid]["ids"] for rid in expected} == expected
    # each finished request leaves ~32 tokens in the tree; a 64-token pool must evict to admit the next
    assert sched.stats.evicted_tokens >= 30 * 10


def reference_prompt_logprobs(prompt: list[int], start: int) -> list[float | None]:
    """The fake model's own log-probability of each prompt token from `start` (None at position 0)."""
    out: list[float | None] = []
    for pos in range(start, len(prompt)):
        if pos == 0:
            out.append(None)
            continue
        logits = torch.zeros(VOCAB)
        logits[next_token(prompt[:pos])] = 1.0
        out.append(torch.log_softmax(logits, -1)[prompt[pos]].item())
    return out


@pytest.mark.parametrize("page_size", [1, 4])
def test_fuzz_prompt_logprobs_are_computed_not_cached_under_pressure(page_size):
    rng = random.Random(77 + page_size)
    sched, outputs = make_scheduler(pool_tokens=192, page_size=page_size, max_running=6, chunk=16,
                                    conservativeness=0.05)
    bases = [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(8, 60))] for _ in range(3)]
    expected = {}
    for wave in range(4):
        for i in range(20):
            rid = f"w{wave}-{i}"
            prompt = rng.choice(bases)[: rng.randrange(0, 50)] + [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 20))]
            start = rng.choice([-1, 0, rng.randrange(0, len(prompt))])
            sp = submit(sched, rid, prompt, logprob_start_len=start, max_new_tokens=rng.randrange(0, 24),
                        ignore_eos=True)
            expected[rid] = (reference(prompt, sp), None if start < 0 else reference_prompt_logprobs(prompt, start))
        for _ in range(rng.randrange(1, 20)):
            sched.run_step(block_when_idle=False)
            conserve(sched)
    drain(sched)
    scored = 0
    for rid, (ids, prompt_logprobs) in expected.items():
        got = outputs[rid]
        assert got["ids"] == ids, rid
        if prompt_logprobs is None:
            assert "input_logprobs" not in got, rid
        else:
            assert got["input_logprobs"] == pytest.approx(prompt_logprobs, abs=1e-6), rid
            scored += 1
    assert scored > 20 and sched.stats.cached_tokens > 0 and sched.stats.num_retractions > 0


def test_queue_timeout_ends_waiting_requests_with_503_and_spares_admitted_ones():
    sched, outputs = make_scheduler(pool_tokens=256, max_running=1, queue_timeout=0.05)
    submit(sched, "running", [1, 2, 3], max_new_tokens=40, ignore_eos=True)
    sched.run_step(block_when_idle=False)  # admitted: only one request fits at a time
    submit(sched, "waiting", [4, 5, 6], max_new_tokens=4, ignore_eos=True)
    sched.run_step(block_when_idle=False)
    time.sleep(0.1)
    drain(sched)
    finish = outputs["waiting"]["finish"]
    assert finish["type"] == "abort" and finish["status_code"] == 503 and "queue timeout" in finish["message"]
    assert outputs["waiting"]["ids"] == [] and sched.stats.num_queue_timeouts == 1
    assert outputs["running"]["finish"]["type"] == "length" and len(outputs["running"]["ids"]) == 40


def test_flush_counts_its_epoch():
    sched, outputs = make_scheduler()
    submit(sched, "a", [1, 2, 3], max_new_tokens=2, ignore_eos=True)
    drain(sched)
    assert sched.get_internal_state()["cache_epoch"] == 0
    sched.input_queue.put(FlushCacheReq())
    drain(sched)
    assert outputs["__flush__"].success and outputs["__flush__"].cache_epoch == 1
    assert sched.get_internal_state()["cache_epoch"] == 1


@pytest.mark.parametrize("policy", ["lpm", "fcfs"])
def test_a_waiting_request_is_matched_once_per_step(policy):
    rng = random.Random(3)
    sched, outputs = make_scheduler(pool_tokens=256, policy=policy, max_running=4, chunk=16)
    base = [rng.randrange(1, VOCAB) for _ in range(30)]
    for i in range(12):
        submit(sched, f"r{i}", base[: rng.randrange(5, 30)] + [i + 1], max_new_tokens=4, ignore_eos=True)
    matches: list[tuple[int, str]] = []
    real_match, step = sched.kv_manager.match_prefix, 0

    def counted(req, **kwargs):
        matches.append((step, req.rid))
        return real_match(req, **kwargs)

    sched.kv_manager.match_prefix = counted
    while not (sched.is_idle() and sched.input_queue.empty()):
        sched.run_step(block_when_idle=False)
        conserve(sched)
        step += 1
    assert len(outputs) == 12 and matches
    assert len(matches) == len(set(matches)), "a request was matched twice in one step"
