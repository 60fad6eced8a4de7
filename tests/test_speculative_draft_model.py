"""Speculative decoding with a draft model (`--speculative-algorithm standalone`, speculative/draft_model.py).

Greedy output equals plain decoding whatever the draft model is: a draft that is the target itself gets nearly
every token accepted, an unrelated one nearly none (its rejected draft KV is cut back every step). Both loops,
pages of 1 and 4, chunked prefill, retraction and aborts; the target's conservation identity after every step
(run_scheduler) and the draft model's pools empty once the scheduler is idle. The draft must share the target's
vocabulary. On the real embedded model too (slow).
"""

from __future__ import annotations

import random
import time
from types import SimpleNamespace

import pytest

from radixserve.sampling_params import SamplingParams
from tests.test_model_support import TINY_VOCAB, make_tiny_model
from tests.test_overlap_parity import (
    PRESSURE,
    _no_starvation_promotion,  # noqa: F401 (an autouse fixture: the queue order must not depend on time)
    assert_same_outputs,
    run_scheduler,
)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """A tiny random llama (the target) and another of the same shape and vocabulary, other weights."""
    target, other = tmp_path_factory.mktemp("target"), tmp_path_factory.mktemp("other")
    make_tiny_model(target, "llama", seed=0)
    make_tiny_model(other, "llama", seed=1)
    return target, other


@pytest.fixture
def always_draft(monkeypatch):
    """Drafting on every step whatever it costs: these tests exercise the mechanics (verify, cut-back, release), and
    a tiny target drafting for itself would otherwise soon be set aside as not paying (`_pays`, tested below)."""
    from radixserve.speculative.draft_model import DraftModelDrafter

    monkeypatch.setattr(DraftModelDrafter, "_pays", lambda self, reqs, want: True)


def tiny_work(n: int = 12, seed: int = 3, hogs: int = 0) -> list:
    """Random prompts (some long enough to be chunked), greedy, EOS ignored; `hogs` 40 + 40-token requests first."""
    rng = random.Random(seed)
    greedy = dict(temperature=0.0, ignore_eos=True)
    work = [(f"h{i}", [rng.randrange(1, TINY_VOCAB) for _ in range(40)], SamplingParams(max_new_tokens=40, **greedy))
            for i in range(hogs)]
    for i in range(n):
        prompt = [rng.randrange(1, TINY_VOCAB) for _ in range(rng.randrange(4, 40))]
        work.append((f"r{i}", prompt, SamplingParams(max_new_tokens=rng.randrange(8, 40), **greedy)))
    return work


def assert_draft_pools_empty(sched) -> None:
    sched.on_idle()
    drafter = sched.decode.drafter
    runner = drafter.runner
    assert not drafter.seqs
    assert runner.token_to_kv_pool_allocator.available_size() == runner.max_total_num_tokens
    assert runner.req_to_token_pool.available_size() == runner.req_to_token_pool.size


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("draft", ["same", "other"])
def test_greedy_parity_with_a_good_and_a_bad_draft_model(tiny_models, always_draft, overlap, page_size, draft):
    target, other = tiny_models
    work = tiny_work()
    common = dict(model_path=str(target), max_total_tokens=1024, page_size=page_size, chunked_prefill_size=16)
    plain, _ = run_scheduler(None, work, overlap=False, **common)
    spec, sched = run_scheduler(None, work, overlap=overlap, speculative_algorithm="standalone",
                                speculative_draft_model_path=str(target if draft == "same" else other), **common)
    assert_same_outputs(plain, spec, work)
    stats = sched.stats
    assert stats.spec_verify_steps > 0
    rate = stats.spec_accepted_tokens / stats.spec_draft_tokens
    if draft == "same":
        assert rate > 0.9, rate  # the target drafting for itself: every argmax agrees but at float ties
    else:
        assert rate < 0.5, rate  # another model's guesses: most are rejected, their draft KV cut back
    assert sched.decode.drafter.forwards > 0
    assert_draft_pools_empty(sched)


@pytest.mark.parametrize("overlap", [False, True])
def test_retraction_and_aborts_under_pressure(tiny_models, always_draft, overlap):
    """A 256-slot pool overfilled by 40 + 40-token requests: decode retracts; the retracted requests' draft KV
    goes at the next step and is rebuilt when they return; outputs equal plain decoding's."""
    target, _ = tiny_models
    work = tiny_work(hogs=6)
    common = dict(PRESSURE, model_path=str(target))
    plain, _ = run_scheduler(None, work, overlap=False, **common)
    spec, sched = run_scheduler(None, work, overlap=overlap, speculative_algorithm="standalone",
                                speculative_draft_model_path=str(target), **common)
    assert_same_outputs(plain, spec, work)
    assert sched.stats.num_retractions > 0 and sched.stats.spec_accepted_tokens > 0
    assert_draft_pools_empty(sched)


def test_drafting_pays_only_where_the_draft_forwards_cost_less_than_they_yield():
    """The batch-level decision (`_pays`): plain steps of 10 ms, verify steps of 12 ms; 6 draft tokens accepted at a
    rate of 0.9 yield 6.4 tokens a request per verify. Draft forwards of 1 ms pay (10 ms a token plain, 18 ms for
    6.4); of 20 ms they do not (132 ms for 6.4), and then each request's rate drifts toward the prior."""
    from radixserve.configs.speculative import SpecConfig
    from radixserve.speculative.draft_model import DraftModelDrafter
    from radixserve.speculative.ngram import UNKNOWN_RATE, DraftBudget, SpecState

    drafter = DraftModelDrafter(SpecConfig("standalone"), 4096, runner=None)
    for _ in range(20):
        drafter.cost.observe(2, 0.010)
        drafter.cost.observe(14, 0.012)
    reqs = [SimpleNamespace(spec=SpecState(None, DraftBudget(6, rate=0.9))) for _ in range(2)]
    want = [(r, 6) for r in reqs]
    assert drafter._pays(reqs, want)  # not measured yet: tried
    drafter.forward_s = 0.001
    assert drafter._pays(reqs, want) and drafter.skipped == 0
    drafter.forward_s = 0.020
    assert not drafter._pays(reqs, want) and drafter.skipped == 1
    assert all(0.9 > r.spec.budget.rate > UNKNOWN_RATE for r in reqs)


def test_a_slow_draft_model_is_set_aside(tiny_models, monkeypatch):
    """Draft forwards made 30 ms slower than a target step: once their time and a plain step's are measured (a line
    needs MIN_STEPS steps and a plain one among them) the batch decodes plainly (the steps set aside outnumber the
    verify steps three to one), and the output is still plain greedy's."""
    from radixserve.speculative.draft_model import DraftModelDrafter

    fast = DraftModelDrafter._argmax

    def slow(self, fb):
        time.sleep(0.03)
        return fast(self, fb)

    monkeypatch.setattr(DraftModelDrafter, "_argmax", slow)
    target, _ = tiny_models
    rng = random.Random(7)
    work = [(f"r{i}", [rng.randrange(1, TINY_VOCAB) for _ in range(8)],
             SamplingParams(max_new_tokens=90, temperature=0.0, ignore_eos=True)) for i in range(3)]
    common = dict(model_path=str(target), max_total_tokens=1024)
    plain, _ = run_scheduler(None, work, overlap=False, **common)
    spec, sched = run_scheduler(None, work, overlap=False, speculative_algorithm="standalone",
                                speculative_draft_model_path=str(target), **common)
    assert_same_outputs(plain, spec, work)
    drafter = sched.decode.drafter
    assert drafter.forward_s > 0.03
    verify_steps = sched.stats.spec_verify_steps / len(work)  # NOTE: the stats count a verify step per request
    assert drafter.skipped > 3 * verify_steps > 0, (drafter.skipped, verify_steps)
    assert_draft_pools_empty(sched)


def test_sampled_requests_draft_and_stay_in_range(tiny_models, always_draft):
    """Seeded sampling with a draft model: speculative sampling (shared with n-gram drafts; its distribution tests
    are in test_speculative.py) runs over the draft tokens, which are accepted for sampled requests too.

    NOTE: which rows run depends on measured step times (cost.py), so two runs need not draw the same tokens."""
    target, _ = tiny_models
    rng = random.Random(5)
    work = [(f"s{i}", [rng.randrange(1, TINY_VOCAB) for _ in range(12)],
             SamplingParams(max_new_tokens=24, temperature=0.7, seed=i, ignore_eos=True)) for i in range(6)]
    out, sched = run_scheduler(None, work, overlap=False, model_path=str(target), max_total_tokens=1024,
                               speculative_algorithm="standalone", speculative_draft_model_path=str(target))
    for rid, _, params in work:
        ids = out[rid]["ids"]
        assert len(ids) == params.max_new_tokens and all(0 <= t < TINY_VOCAB for t in ids)
    assert sum(out[rid]["spec"]["spec_accepted_tokens"] for rid, _, _ in work if out[rid]["spec"]) > 0
    assert_draft_pools_empty(sched)


def test_a_draft_model_of_another_vocabulary_is_refused(tiny_models):
    from radixserve.configs.speculative import SpecConfig
    from radixserve.model_executor.model_runner import ModelRunner
    from radixserve.server_args import ServerArgs
    from radixserve.speculative.draft_model import load_draft_runner

    args = ServerArgs(model_path=str(tiny_models[0]), dtype="float32", max_total_tokens=512,
                      speculative_algorithm="standalone")  # NOTE: no draft path: the embedded SmolLM2, 49,152 tokens
    with pytest.raises(ValueError, match="vocabulary of 49152 tokens, the served model 256"):
        load_draft_runner(args, ModelRunner(args), SpecConfig.of(args))


def test_flag_values():
    from radixserve.server_args import ServerArgs

    args = ServerArgs(speculative_algorithm="standalone", speculative_draft_model_path="/some/folder")
    assert args.speculative_draft_model_path == "/some/folder"
    with pytest.raises(ValueError, match="speculative_algorithm"):
        ServerArgs(speculative_algorithm="eagle")


@pytest.mark.slow
def test_embedded_model_drafting_for_itself_through_the_engine(always_draft):
    """The embedded SmolLM2 as its own draft, through the Engine: plain greedy's tokens, nearly every draft token
    accepted, figures in meta_info, the target's KV conserved."""
    from radixserve import Engine
    from tests.test_model_support import assert_engine_conserved

    prompt = "Count: one, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve,"
    params = {"temperature": 0, "max_new_tokens": 32}
    outs = {}
    for algo in ("none", "standalone"):
        engine = Engine(dtype="float32", device="cpu", max_total_tokens=2048, speculative_algorithm=algo,
                        log_level="warning")
        try:
            outs[algo] = engine.generate(prompt, params)
            assert_engine_conserved(engine)
        finally:
            engine.shutdown()
    assert outs["standalone"]["output_ids"] == outs["none"]["output_ids"]
    meta = outs["standalone"]["meta_info"]
    assert meta["spec_verify_ct"] > 0 and meta["spec_accept_rate"] > 0.9, meta
    assert meta["spec_accept_length"] > 3.0, meta
