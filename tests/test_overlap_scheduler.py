"""The overlap loop on a fake model whose next token is a hash of the sequence it READS FROM KV.

The fake backend reads each request's `req_to_token` row in `init_forward_metadata` (as the real
backends do) and the fake forward writes its input ids into its KV slots, then hashes the ids it
reads back. A wrong row, a wrong slot or a wrong relayed input id changes the tokens, so outputs
equal a plain reference loop only when the overlap bookkeeping is exact. Forwards take a few
milliseconds (a sleep, which releases the GIL like a kernel), so scheduling really overlaps them.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from radixserve.layers.sampler import compute_input_logprobs
from radixserve.managers.overlap_utils import FutureMapError, OverlapDebug, StreamError
from radixserve.managers.scheduler import Scheduler
from radixserve.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from radixserve.mem_cache.conservation import check_conservation
from radixserve.mem_cache.memory_pool import ReqToTokenPool
from radixserve.mem_cache.radix_key import RadixKey
from radixserve.protocol.io_struct import AbortReq, LogprobSpec, TokenizedGenerateReqInput
from radixserve.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs

VOCAB = 97
EOS = 0


def next_token(seq: list[int]) -> int:
    h = 0
    for i, t in enumerate(seq):
        h = (h * 131 + (t + 3) * (i + 11)) % 999_983
    return h % VOCAB


def reference(prompt: list[int], params: SamplingParams) -> list[int]:
    seq, out = list(prompt), []
    while len(out) < params.max_new_tokens:
        out.append(next_token(seq))
        seq.append(out[-1])
        if not params.ignore_eos and out[-1] == EOS:
            break
    return out


class FakeBackend:
    def __init__(self) -> None:
        self.rows: list[torch.Tensor] = []

    def init_forward_metadata(self, fb) -> None:
        table = fb.req_to_token_pool.req_to_token
        self.rows = [table[r, :n].long().clone() for r, n in zip(fb.req_pool_indices.tolist(), fb.seq_lens_cpu,
                                                                 strict=True)]


class FakeRunner:
    def __init__(self, pool_tokens: int, page_size: int, max_running: int, compute_s: float) -> None:
        self.device = torch.device("cpu")
        self.page_size = page_size
        self.context_len = 256
        self.max_total_num_tokens = pool_tokens
        self.max_running_requests = max_running
        self.model_config = SimpleNamespace(vocab_size=VOCAB, eos_token_ids=(EOS,))
        self.tokenizer = None
        self.req_to_token_pool = ReqToTokenPool(max_running, self.context_len + 4)
        self.token_to_kv_pool_allocator = (TokenToKVPoolAllocator(pool_tokens) if page_size == 1
                                           else PagedTokenToKVPoolAllocator(pool_tokens, page_size))
        self.attn_backend = FakeBackend()
        self.kv = torch.full((pool_tokens + page_size,), -1, dtype=torch.int64)
        self.compute_s = compute_s

    def forward(self, fb, read_done=None) -> torch.Tensor:
        fb.req_to_token_pool = self.req_to_token_pool
        fb.attn_backend = self.attn_backend
        self.attn_backend.init_forward_metadata(fb)
        if read_done is not None:
            read_done.record()  # as the model runner: the shared reads are done
        time.sleep(self.compute_s)
        self.kv[fb.out_cache_loc] = fb.input_ids
        logits = torch.zeros(fb.batch_size, VOCAB)
        for i, slots in enumerate(fb.attn_backend.rows):
            logits[i, next_token(self.kv[slots].tolist())] = 1.0
        if fb.extra_logits_indices is not None:
            fb.input_logprobs = compute_input_logprobs(self._prompt_logits(fb), fb.extra_target_ids, fb.extra_top_k)
        return logits

    def _prompt_logits(self, fb) -> torch.Tensor:
        """As the model runner: logits at the requested flat token indices, from the rows the forward read."""
        owner = [(i, pre + k) for i, (pre, ext) in enumerate(zip(fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu,
                                                                  strict=True)) for k in range(ext)]
        logits = torch.zeros(len(fb.extra_logits_indices), VOCAB)
        for j, flat in enumerate(fb.extra_logits_indices.tolist()):
            i, pos = owner[flat]
            logits[j, next_token(self.kv[fb.attn_backend.rows[i][: pos + 1]].tolist())] = 1.0
        return logits

    def sample(self, logits: torch.Tensor, info) -> torch.Tensor:
        return logits.argmax(-1)

    def logprobs(self, logits: torch.Tensor, next_ids: torch.Tensor, info, top_k: int):
        return compute_input_logprobs(logits, next_ids, top_k)


def make_scheduler(pool_tokens=512, page_size=1, max_running=8, chunk=-1, compute_s=0.002, conservativeness=1.0,
                   **debug):
    # NOTE: a tiny decode reserve (conservativeness 0.05) over-admits, so decode runs short and retracts.
    args = ServerArgs(max_total_tokens=pool_tokens, page_size=page_size, chunked_prefill_size=chunk,
                      schedule_conservativeness=conservativeness)
    outputs: dict[str, dict] = {}

    def sink(out) -> None:
        for o in out.outputs:
            rec = outputs.setdefault(o.rid, {"ids": [], "finish": None})
            rec["ids"].extend(o.new_token_ids)
            rec["finish"] = o.finished_reason
            if o.input_token_logprobs is not None:
                rec["input_logprobs"] = o.input_token_logprobs

    sched = Scheduler(args, FakeRunner(pool_tokens, page_size, max_running, compute_s), output_sink=sink)
    sched.init_overlap(OverlapDebug(**{"check_future_map": True, "check_reads": True, **debug}))
    return sched, outputs


def conserve(sched: Scheduler) -> None:
    check_conservation(sched.token_to_kv_pool_allocator, sched.tree_cache, sched.req_to_token_pool,
                       [r.kv for r in sched.active_requests()])


def mixed_workload(n: int, seed: int = 0, max_new: int = 24) -> list[tuple[str, list[int], SamplingParams]]:
    g = torch.Generator().manual_seed(seed)
    shared = [torch.randint(1, VOCAB, (int(k),), generator=g).tolist() for k in (24, 40, 9)]
    work = []
    for i in range(n):
        head = shared[i % 3] if i % 4 else []
        tail = torch.randint(1, VOCAB, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
        params = SamplingParams(max_new_tokens=int(torch.randint(1, max_new, (1,), generator=g)), temperature=0,
                                ignore_eos=i % 5 != 0)
        work.append((f"r{i}", head + tail, params))
    return work


def run(sched: Scheduler, work, overlap: bool, abort_at: dict[int, str] | None = None) -> int:
    for rid, prompt, params in work:
        sched.input_queue.put(TokenizedGenerateReqInput(rid, prompt, params))
    abort_at = dict(abort_at or {})
    steps = 0

    def on_step() -> None:
        nonlocal steps
        steps += 1
        conserve(sched)  # NOTE: after every processed result, with requests in flight
        if steps in abort_at:
            sched.input_queue.put(AbortReq(abort_at.pop(steps)))

    if overlap:
        sched.run_until_idle_overlap(20_000, on_step=on_step)
        sched.close_overlap()
    else:
        sched.run_until_idle(20_000, on_step=on_step)
    conserve(sched)
    assert sched.req_to_token_pool.available_size() == sched.req_to_token_pool.size
    assert sched.tree_cache.protected_size() == 0
    return steps


def leaf_paths(tree) -> set[tuple]:
    paths, stack = set(), [(tree.root_node, ())]
    while stack:
        node, path = stack.pop()
        path = path + tuple(node.key.token_ids)
        if not node.children:
            paths.add(path)
        stack.extend((child, path) for child in node.children.values())
    return paths


@pytest.mark.parametrize("page_size, chunk, pool, max_running", [(1, 16, 200, 8), (4, 12, 192, 5), (1, -1, 4096, 8)])
def test_overlap_outputs_match_the_reference_and_the_normal_loop(page_size, chunk, pool, max_running):
    work = mixed_workload(40, max_new=64)
    aborts = {3: "r7", 9: "r13", 15: "r30"}
    results = {}
    for overlap in (False, True):
        sched, outputs = make_scheduler(pool, page_size, max_running, chunk, conservativeness=0.05)
        run(sched, work, overlap, aborts)
        results[overlap] = (outputs, sched)
        assert sched.pipeline_counters.corrupted_reads == 0
    (normal, normal_sched), (overlapped, overlap_sched) = results[False], results[True]
    for rid, prompt, params in work:
        want = reference(prompt, params)
        got = overlapped[rid]
        if got["finish"]["type"] == "abort":
            assert rid in aborts.values() and want[: len(got["ids"])] == got["ids"]
        else:
            assert got["ids"] == want, rid
            assert got == normal[rid], rid
    assert overlap_sched.stats.num_finished + overlap_sched.stats.num_aborts == len(work)
    assert overlap_sched.stats.num_aborts == len(aborts)
    counters = overlap_sched.pipeline_counters
    assert counters.processed == counters.launched and counters.dropped_tokens > 0
    if pool < 4096:
        assert overlap_sched.stats.num_retractions > 0 and normal_sched.stats.num_retractions > 0


def test_both_loops_leave_the_same_tree_behind():
    work = mixed_workload(30, seed=1)  # no eviction pressure, no aborts: inserts do not depend on timing
    trees = []
    for overlap in (False, True):
        sched, _ = make_scheduler(pool_tokens=4096, max_running=8, chunk=16)
        run(sched, work, overlap)
        trees.append((leaf_paths(sched.tree_cache), sched.tree_cache.total_size()))
    assert trees[0] == trees[1]


def test_request_finished_in_batch_k_and_scheduled_in_k_plus_1_is_released_once():
    sched, outputs = make_scheduler(pool_tokens=4096, max_running=4)
    releases: list[str] = []
    original = sched.output.release_finished_req
    sched.output.release_finished_req = lambda req: (releases.append(req.rid), original(req))[1]
    work = [(f"r{i}", [5, 6, 7, i], SamplingParams(max_new_tokens=3 + i, temperature=0, ignore_eos=True))
            for i in range(4)]
    run(sched, work, overlap=True)
    assert sorted(releases) == sorted(rid for rid, _, _ in work)
    for rid, prompt, params in work:
        assert len(outputs[rid]["ids"]) == params.max_new_tokens
        # The tree holds prompt + outputs minus the last token: the last token's KV is never committed.
        match = sched.tree_cache.match_prefix(RadixKey(prompt + outputs[rid]["ids"]))
        assert len(match.device_indices) == len(prompt) + params.max_new_tokens - 1


# ---------------------------------------------------------------- the barrier is necessary


def row_reuse_workload(n: int = 12):
    # More requests than rows, short outputs: rows change hands while the overrun decode reads them.
    return [(f"r{i}", [i + 1, 2, 3, 4, 5], SamplingParams(max_new_tokens=2 + i % 3, temperature=0, ignore_eos=True))
            for i in range(n)]


@pytest.mark.parametrize("barrier", [True, False])
def test_war_barrier_keeps_slow_forwards_from_reading_overwritten_rows(barrier):
    sched, outputs = make_scheduler(pool_tokens=512, max_running=2, compute_s=0.0, check_future_map=False,
                                    war_barrier=barrier, forward_read_delay_s=0.03)
    run(sched, row_reuse_workload(), overlap=True)
    assert sched.pipeline_counters.dropped_tokens > 0, "no overrun step: the hazard was not exercised"
    if barrier:
        assert sched.pipeline_counters.corrupted_reads == 0
    else:
        assert sched.pipeline_counters.corrupted_reads > 0


@pytest.mark.parametrize("barrier", [True, False])
def test_war_barrier_keeps_slow_forwards_from_reading_reset_future_tokens(barrier):
    sched, outputs = make_scheduler(pool_tokens=512, max_running=2, compute_s=0.0, check_reads=False,
                                    war_barrier=barrier, forward_read_delay_s=0.03)
    work = row_reuse_workload()
    if barrier:
        run(sched, work, overlap=True)
        assert all(outputs[rid]["ids"] == reference(p, sp) for rid, p, sp in work)
    else:
        with pytest.raises(StreamError) as info:
            run(sched, work, overlap=True)
        assert isinstance(info.value.__cause__, FutureMapError)
        assert "read before it was written" in str(info.value.__cause__)
        sched.close_overlap(drain=False)


def test_event_loop_overlap_runs_until_stopped_then_cleans_up():
    sched, outputs = make_scheduler()
    work = mixed_workload(6, seed=3)
    for rid, prompt, params in work:
        sched.input_queue.put(TokenizedGenerateReqInput(rid, prompt, params))
    loop = threading.Thread(target=sched.event_loop_overlap, daemon=True)
    loop.start()
    deadline = time.monotonic() + 30
    while len([r for r in outputs.values() if r["finish"]]) < len(work) and time.monotonic() < deadline:
        time.sleep(0.01)
    sched.stop_event.set()
    loop.join(10)
    assert not loop.is_alive()
    assert sched.overlap is None and isinstance(sched.model_runner.attn_backend, FakeBackend)
    for rid, prompt, params in work:
        assert outputs[rid]["ids"] == reference(prompt, params)
    conserve(sched)


def test_a_failed_forward_that_was_the_last_in_flight_does_not_poison_later_requests():
    # The poisoned batch is the only one in flight when its failure surfaces (its request was aborted,
    # so no decode follows it): the contained failure must still rebuild the failed forward stream.
    sched, outputs = make_scheduler()
    runner, failures = sched.model_runner, ["device fault"]
    real_forward = runner.forward

    def flaky_forward(fb, read_done=None):
        if failures:
            raise RuntimeError(failures.pop())
        return real_forward(fb, read_done)

    runner.forward = flaky_forward
    _, prompt, params = mixed_workload(1, seed=3)[0]

    def step() -> None:
        sched.run_step_contained(lambda: sched.run_step_overlap(block_when_idle=False))

    sched.input_queue.put(TokenizedGenerateReqInput("poisoned", prompt, params))
    step()  # launches its prefill, which fails on the forward stream
    sched.input_queue.put(AbortReq("poisoned"))
    step()  # no batch to launch: the failed one is taken, and its failure contained
    assert sched.failed_steps == 1 and outputs["poisoned"]["finish"]["type"] == "abort"
    sched.input_queue.put(TokenizedGenerateReqInput("late", prompt, params))
    sched.run_until_idle_overlap(2_000, on_step=lambda: conserve(sched))
    assert outputs["late"]["finish"]["type"] != "abort", outputs["late"]["finish"]
    assert outputs["late"]["ids"] == reference(prompt, params)
    assert sched.failed_steps == 1
    sched.close_overlap()
    conserve(sched)


def test_a_failing_forward_reaches_the_scheduler_instead_of_hanging_it():
    # NOTE: the failure reaches the scheduler, which contains it (scheduler_failures.py): the requests of
    # the poisoned pipeline end with 500, the overlap state is rebuilt and later requests run.
    sched, outputs = make_scheduler()
    runner, calls = sched.model_runner, []
    real_forward = runner.forward

    def flaky_forward(fb, read_done=None):
        calls.append(fb.forward_mode)
        if len(calls) == 3:
            raise RuntimeError("device fault")
        return real_forward(fb, read_done)

    runner.forward = flaky_forward
    work = mixed_workload(4, seed=5)
    for rid, prompt, params in work:
        sched.input_queue.put(TokenizedGenerateReqInput(rid, prompt, params))
    errors: list[BaseException] = []

    def loop() -> None:
        try:
            sched.event_loop_overlap()
        except BaseException as error:
            errors.append(error)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not all(outputs.get(rid, {}).get("finish") for rid, _, _ in work):
        assert time.monotonic() < deadline, "the scheduler hung on a failed forward"
        time.sleep(0.01)
    aborted = [rid for rid, _, _ in work if outputs[rid]["finish"]["type"] == "abort"]
    assert aborted and all(outputs[rid]["finish"]["status_code"] == 500 for rid in aborted)
    assert "device fault" in outputs[aborted[0]]["finish"]["message"] and sched.failed_steps == 1
    late_rid, late_prompt, late_params = work[0]
    sched.input_queue.put(TokenizedGenerateReqInput("late", late_prompt, late_params))
    while not outputs.get("late", {}).get("finish"):
        assert time.monotonic() < deadline + 20, "no request ran after the failure"
        time.sleep(0.01)
    assert outputs["late"]["finish"]["type"] != "abort"
    sched.stop_event.set()
    thread.join(20)
    assert not thread.is_alive() and not errors
    assert sched.overlap is None  # streams closed


def reference_prompt_logprobs(prompt: list[int], start: int) -> list[float | None]:
    out: list[float | None] = [None] if start == 0 else []
    for pos in range(max(start, 1), len(prompt)):
        logits = torch.zeros(VOCAB)
        logits[next_token(prompt[:pos])] = 1.0
        out.append(torch.log_softmax(logits, -1)[prompt[pos]].item())
    return out


def test_prompt_logprobs_survive_retraction_while_their_prefill_is_in_flight(monkeypatch):
    # NOTE: a retraction every decode step takes the request with the fewest outputs: usually one just
    # prefilled, whose prefill result (with its prompt logprobs) is still in flight and gets dropped.
    monkeypatch.setenv("RADIXSERVE_TEST_RETRACT_INTERVAL", "1")
    sched, outputs = make_scheduler(pool_tokens=512, max_running=8, chunk=16)
    work = mixed_workload(16, seed=5)
    starts = {rid: (0, 3, len(prompt) - 1)[i % 3] for i, (rid, prompt, _) in enumerate(work)}
    for rid, prompt, params in work:
        logprob = LogprobSpec(return_logprob=True, logprob_start_len=min(starts[rid], len(prompt) - 1))
        sched.input_queue.put(TokenizedGenerateReqInput(rid, prompt, params, logprob=logprob))
    sched.run_until_idle_overlap(20_000, on_step=lambda: conserve(sched))
    sched.close_overlap()
    assert sched.stats.num_retractions > 5
    for rid, prompt, params in work:
        start = min(starts[rid], len(prompt) - 1)
        assert outputs[rid]["ids"] == reference(prompt, params), rid
        assert outputs[rid]["input_logprobs"] == pytest.approx(reference_prompt_logprobs(prompt, start)), rid
