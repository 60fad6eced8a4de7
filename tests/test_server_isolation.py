"""A failure stays with its requests: a step that raises aborts the requests it involved (500, KV released),
the scheduler goes on in both loops, and only a failure of its own state (or one on every step) ends it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from radixserve.managers.schedule_batch import ScheduleBatch
from radixserve.managers.scheduler_failures import MAX_CONSECUTIVE_FAILURES, FailureContainment
from radixserve.mem_cache.conservation import ConservationError

POISON = 424242  # a request with this seed makes its batch fail (injected below)
GREEDY = {"temperature": 0.0, "ignore_eos": True}


def _poison_sampling(monkeypatch: pytest.MonkeyPatch, engine) -> None:
    """The sampler raises for any batch holding a POISON request, on whichever thread runs the forward."""
    runner = engine.model_runner
    sample = runner.sample

    def failing(logits, info):
        if POISON in info.seeds:
            raise RuntimeError("injected sampling failure")
        return sample(logits, info)

    monkeypatch.setattr(runner, "sample", failing)


def _status(result: dict) -> tuple[str, int | None]:
    reason = result["meta_info"]["finish_reason"]
    return reason["type"], reason.get("status_code")


@pytest.mark.slow
@pytest.mark.parametrize("loop", ["overlap", "normal"])
def test_a_failing_batch_aborts_its_requests_and_the_scheduler_goes_on(engines, monkeypatch, loop: str) -> None:
    engine = engines[0] if loop == "overlap" else engines[1]
    ids = engine.tokenizer.encode("The capital of France is")
    reference = engine.generate(input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 40})
    _poison_sampling(monkeypatch, engine)
    before = engine.scheduler.failed_steps
    increments = engine.submit(ids, {**GREEDY, "max_new_tokens": 40}, stream=True).stream()
    survivor = [next(increments)]  # the bystander runs (decodes) before the poison arrives
    poison = engine.submit(engine.tokenizer.encode("Once upon a time"), {"max_new_tokens": 8, "seed": POISON})
    failed = poison.result(timeout=120)
    assert _status(failed) == ("abort", 500)
    assert "injected sampling failure" in failed["meta_info"]["finish_reason"]["message"]
    assert engine.scheduler.failed_steps > before
    survivor += list(increments)
    output_ids = [t for inc in survivor for t in inc["output_ids"]]
    if loop == "normal":
        # its batches never held the poison (a prefill runs alone): it is untouched, token for token
        assert output_ids == reference["output_ids"]
        assert survivor[-1]["meta_info"]["finish_reason"]["type"] == "length"
    else:
        # under the overlap loop the running requests share the poisoned forward stream: aborted with it
        assert _status(survivor[-1]) == ("abort", 500)
        assert output_ids == reference["output_ids"][:len(output_ids)]  # what it got before is right
    again = engine.generate(input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 40})
    assert again["output_ids"] == reference["output_ids"]  # the next requests run as if nothing happened
    # the conftest's _engines_conserved fixture checks the conservation identity after this test


@pytest.mark.slow
@pytest.mark.parametrize("loop", ["overlap", "normal"])
def test_the_issues_out_of_vocabulary_stop_id_past_the_boundary_no_longer_kills_the_scheduler(
        engines, monkeypatch, loop: str) -> None:
    # The boundary refuses it now; with that check switched off it reaches the sampler and raises the
    # real IndexError in layers/penalties.py (index 60000, vocabulary 49152), which used to end the loop.
    from radixserve.sampling_params import SamplingParams

    engine = engines[0] if loop == "overlap" else engines[1]
    ids = engine.tokenizer.encode("hi")
    with pytest.raises(ValueError, match="stop_token_ids"):
        engine.submit(ids, {"max_new_tokens": 4, "stop_token_ids": [60000], "min_new_tokens": 1})
    monkeypatch.setattr(SamplingParams, "verify_for_model", lambda self, vocab_size: None)
    failed = engine.submit(ids, {"max_new_tokens": 4, "stop_token_ids": [60000], "min_new_tokens": 1})
    result = failed.result(timeout=120)
    assert _status(result) == ("abort", 500) and "IndexError" in result["meta_info"]["finish_reason"]["message"]
    assert engine.generate(input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 3})["output_ids"]


@pytest.mark.slow
def test_a_failure_while_building_a_batch_aborts_the_requests_being_scheduled(engines, monkeypatch) -> None:
    engine = engines[1]
    ids = engine.tokenizer.encode("Write one word:")
    reference = engine.generate(input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 4})
    prepare = ScheduleBatch.prepare_for_extend

    def failing(batch):
        if any(r.sampling_params.seed == POISON for r in batch.reqs):
            raise RuntimeError("injected build failure")  # after admission locked the prefixes, before rows
        return prepare(batch)

    monkeypatch.setattr(ScheduleBatch, "prepare_for_extend", failing)
    failed = engine.submit(ids, {**GREEDY, "max_new_tokens": 4, "seed": POISON}).result(timeout=120)
    assert _status(failed) == ("abort", 500) and "injected build failure" in failed["meta_info"]["finish_reason"]["message"]
    again = engine.generate(input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 4})
    assert again["output_ids"] == reference["output_ids"]


# ---------------------------------------------------------------------------------- escalation


class _Step:
    """Just the step state containment reads, with no requests: the rules of escalation alone."""

    def __init__(self, broken: bool) -> None:
        self.cur_batch = None
        self.running_batch = SimpleNamespace(reqs=[], filter_batch=lambda: None)
        self.last_batch = None
        self.broken = broken

    def check_conservation(self) -> dict:
        if self.broken:
            raise ConservationError("leaked slots", {})
        return {}


def _Stub(broken: bool = False) -> FailureContainment:  # noqa: N802 - reads as the stub it builds
    pipelines = SimpleNamespace(drop_in_flight=lambda: ([], False))
    queue = SimpleNamespace(waiting=[], live={})
    prefill = SimpleNamespace(chunked_req=None, forget=lambda involved: None)
    output = SimpleNamespace(finish_now=lambda req, reason: None)
    return FailureContainment(_Step(broken), pipelines, queue, prefill, output)


def _fail() -> None:
    raise RuntimeError("boom")


def test_consecutive_failures_end_the_loop_and_a_success_resets_the_count() -> None:
    stub = _Stub()
    for _ in range(MAX_CONSECUTIVE_FAILURES - 1):
        assert stub.run_step_contained(_fail) is None
    assert stub.run_step_contained(lambda: "ran") == "ran"  # a good step: the count starts over
    for _ in range(MAX_CONSECUTIVE_FAILURES - 1):
        stub.run_step_contained(_fail)
    with pytest.raises(RuntimeError, match="boom"):
        stub.run_step_contained(_fail)
    assert stub.failed_steps == 2 * (MAX_CONSECUTIVE_FAILURES - 1)


def test_a_broken_state_after_the_aborts_is_not_contained() -> None:
    with pytest.raises(ConservationError):
        _Stub(broken=True).run_step_contained(_fail)


def test_keyboard_interrupt_is_never_contained() -> None:
    def interrupt() -> None:
        raise KeyboardInterrupt

    stub = _Stub()
    with pytest.raises(KeyboardInterrupt):
        stub.run_step_contained(interrupt)
    assert stub.failed_steps == 0
