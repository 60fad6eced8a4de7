"""Overlap on/off parity on the REAL embedded model (SmolLM2-135M, float32), and the same on CUDA.

64 mixed requests (shared prefixes, chunked prefill, retraction on a small pool, aborts) run once
with `event_loop_normal` steps and once with `event_loop_overlap` steps; greedy outputs must agree
token for token, and the conservation identity must hold after every processed result.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from radixserve.managers.overlap_utils import OverlapDebug
from radixserve.managers.scheduler import Scheduler
from radixserve.mem_cache.conservation import check_conservation
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.protocol.io_struct import AbortReq, TokenizedGenerateReqInput
from radixserve.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs

pytestmark = pytest.mark.slow

ABORTS = {0: "r63", 6: "r9", 14: "r41"}  # step -> request id; r63 is still waiting at step 0
# A small pool and a tiny decode reserve (conservativeness 0.05) over-admit, so decode retracts.
PRESSURE = dict(max_total_tokens=256, chunked_prefill_size=16, max_running_requests=16, schedule_conservativeness=0.05)


@pytest.fixture(scope="module", autouse=True)
def _one_intra_op_thread():
    # NOTE: 2 intra-op threads on 2 shared cores make OpenMP spin-wait (a decode step 10x slower);
    # one thread also leaves the scheduler thread its own core, as the overlap loop expects.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _no_starvation_promotion(monkeypatch):
    # NOTE: a request waiting 30 s goes first; on a slow machine that would make the order depend on time
    monkeypatch.setenv("RADIXSERVE_STARVATION_TIMEOUT_S", "1000000")


@pytest.fixture(scope="module")
def loaded():
    from radixserve.models.loader import load_model

    return load_model(None, torch.float32, "cpu")


def mixed_requests(n: int, seed: int = 7) -> list[tuple[str, list[int], SamplingParams]]:
    rng = random.Random(seed)
    words = range(1000, 9000)
    bases = [[rng.choice(words) for _ in range(rng.randrange(12, 20))] for _ in range(3)]
    work = []
    for i in range(n):
        head = bases[i % 3] if i % 4 else []
        tail_len = rng.randrange(30, 50) if i % 9 == 0 else rng.randrange(2, 10)  # long ones are chunked
        max_new = rng.randrange(20, 30) if i % 8 == 1 else rng.randrange(2, 12)  # long ones force retraction
        params = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=i % 6 != 0)
        work.append((f"r{i}", head + [rng.choice(words) for _ in range(tail_len)], params))
    return work


def hog_requests(n: int = 6, seed: int = 11) -> list[tuple[str, list[int], SamplingParams]]:
    """Requests that overfill PRESSURE's pool whatever the model answers: 40-token prompts, 40 tokens each
    with EOS ignored. Queued first, they make the first decode steps retract on every CPU; the pressure of
    `mixed_requests` alone depends on where the model stops, so it can differ from one ISA to another."""
    rng = random.Random(seed)
    params = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    return [(f"h{i}", [rng.choice(range(1000, 9000)) for _ in range(40)], params) for i in range(n)]


def run_scheduler(loaded, work, overlap: bool, device: str = "cpu", **kw):
    args = ServerArgs(dtype="float32", device=device, disable_overlap_schedule=not overlap, **kw)
    outputs: dict[str, dict] = {}

    def sink(out) -> None:
        for o in out.outputs:
            rec = outputs.setdefault(o.rid, {"ids": [], "finish": None})
            rec["ids"].extend(o.new_token_ids)
            rec["finish"] = o.finished_reason
            # NOTE: queue_steps counts the step launched ahead under overlap, so only the speculative figures
            spec = {k: v for k, v in (o.figures or {}).items() if k.startswith("spec_")}
            rec["spec"] = spec or rec.get("spec")

    sched = Scheduler(args, ModelRunner(args, loaded), output_sink=sink)
    if overlap:
        sched.init_overlap(OverlapDebug(check_future_map=True, check_reads=True))
    for rid, prompt, params in work:
        sched.input_queue.put(TokenizedGenerateReqInput(rid, prompt, params))
    aborts = dict(ABORTS)
    if 0 in aborts:
        sched.input_queue.put(AbortReq(aborts.pop(0)))
    steps = 0

    def on_step() -> None:
        nonlocal steps
        steps += 1
        check_conservation(sched.token_to_kv_pool_allocator, sched.tree_cache, sched.req_to_token_pool,
                           [r.kv for r in sched.active_requests()])
        if steps in aborts:
            sched.input_queue.put(AbortReq(aborts.pop(steps)))

    if overlap:
        sched.run_until_idle_overlap(5_000, on_step=on_step)
        sched.close_overlap()
    else:
        sched.run_until_idle(5_000, on_step=on_step)
    check_conservation(sched.token_to_kv_pool_allocator, sched.tree_cache, sched.req_to_token_pool, [])
    return outputs, sched


def assert_same_outputs(normal: dict, overlapped: dict, work) -> None:
    assert set(normal) == set(overlapped) == {rid for rid, _, _ in work}
    for rid, _, params in work:
        a, b = normal[rid], overlapped[rid]
        if rid in ABORTS.values():
            assert a["finish"]["type"] == b["finish"]["type"] == "abort", rid
            shorter, longer = sorted((a["ids"], b["ids"]), key=len)
            assert longer[: len(shorter)] == shorter, rid
        else:
            assert b["ids"] == a["ids"], (rid, a["ids"], b["ids"])
            assert b["finish"] == a["finish"], rid
            assert 1 <= len(b["ids"]) <= params.max_new_tokens


@pytest.mark.long
def test_overlap_parity_64_mixed_requests(loaded):
    work = hog_requests() + mixed_requests(64)
    normal, normal_sched = run_scheduler(loaded, work, overlap=False, **PRESSURE)
    overlapped, overlap_sched = run_scheduler(loaded, work, overlap=True, **PRESSURE)
    assert_same_outputs(normal, overlapped, work)
    for sched in (normal_sched, overlap_sched):
        assert sched.stats.num_retractions > 0 and sched.stats.cached_tokens > 0
        assert sched.stats.num_aborts == len(ABORTS)
    counters = overlap_sched.pipeline_counters
    assert counters.corrupted_reads == 0 and counters.dropped_tokens > 0
    assert counters.processed == counters.launched


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_overlap_parity_on_cuda_streams():
    from radixserve.managers.overlap_utils import CudaStream
    from radixserve.models.loader import load_model

    # NOTE: RADIXSERVE_TEST_CUDA_MODEL names another model folder where the embedded one is not installed (a GPU
    # machine that cannot fetch it: scripts/cuda_check.sh writes a random model with its tokenizer)
    cuda_loaded = load_model(os.environ.get("RADIXSERVE_TEST_CUDA_MODEL"), torch.float32, "cuda")
    work = mixed_requests(64)
    normal, _ = run_scheduler(cuda_loaded, work, overlap=False, device="cuda", **PRESSURE)
    args = ServerArgs(dtype="float32", device="cuda", **PRESSURE)
    sched = Scheduler(args, ModelRunner(args, cuda_loaded))
    state = sched.init_overlap(OverlapDebug())
    assert isinstance(state.streams.forward, CudaStream) and state.streams.forward is not state.streams.schedule
    sched.close_overlap()
    overlapped, overlap_sched = run_scheduler(cuda_loaded, work, overlap=True, device="cuda", **PRESSURE)
    assert_same_outputs(normal, overlapped, work)
    assert overlap_sched.pipeline_counters.corrupted_reads == 0


def test_grammar_rows_on_a_forward_stream_that_runs_on_the_caller(loaded):
    """CUDA streams launch a forward on the scheduler's own thread; a grammar batch's sampling must not wait for a
    mask that only a result processed after the launch would fill (it hung on the H200). Here the overlap loop
    runs on CPU streams arranged as CUDA's are: greedy grammar outputs equal the normal loop's, in regex."""
    import threading

    from radixserve.managers.forward_pipeline import ForwardPipeline
    from radixserve.managers.overlap_streams import InlineStream
    from radixserve.managers.overlap_utils import DeviceStreams

    rng = random.Random(3)
    work = [(f"g{i}", [rng.choice(range(1000, 9000)) for _ in range(rng.randrange(5, 20))],
             SamplingParams(max_new_tokens=12, temperature=0.0, regex="[a-z]{2,6}( [a-z]{2,6}){1,3}"))
            for i in range(6)]
    normal, _ = run_scheduler(loaded, work, overlap=False)
    args = ServerArgs(dtype="float32", device="cpu", disable_overlap_schedule=False)
    outputs: dict[str, list[int]] = {}
    sched = Scheduler(args, ModelRunner(args, loaded),
                      output_sink=lambda out: [outputs.setdefault(o.rid, []).extend(o.new_token_ids)
                                               for o in out.outputs])
    forward = InlineStream("forward")
    assert forward.runs_on_caller
    debug = OverlapDebug()
    sched.pipelines.overlap = ForwardPipeline(sched.model_runner, DeviceStreams(forward, InlineStream("schedule"),
                                                                                forward, debug),
                                              1, debug, sched.pipelines.counters)
    for rid, prompt, params in work:
        sched.input_queue.put(TokenizedGenerateReqInput(rid, prompt, params))
    done = threading.Event()

    def drive() -> None:
        # NOTE: steps spin while the grammars compile on their own thread: on a loaded machine that took more than
        # 2,000 steps; the 120 s wait below is the hang check
        sched.run_until_idle_overlap(100_000)
        done.set()

    threading.Thread(target=drive, daemon=True).start()
    assert done.wait(120), "the overlap loop hung on a grammar batch"
    sched.close_overlap()
    check_conservation(sched.token_to_kv_pool_allocator, sched.tree_cache, sched.req_to_token_pool, [])
    assert {rid: ids for rid, ids in outputs.items()} == {rid: rec["ids"] for rid, rec in normal.items()}
