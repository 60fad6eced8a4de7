"""Speculative decoding where it meets other features: the failures found under a mixed concurrent load, pinned.

1. The overlap loop, drafting paused for every running request, and a request re-prefilled (retracted, or leaving
   for a jump-forward extend): the step after the re-prefill used to be built as a verify step while that
   request's sample was still in flight, and indexing its next input raised (IndexError in
   `prepare_for_verify`), aborting the whole batch. A verify step is now built only when every input token is on
   the host, and a request with one step of pause left counts as drafting when the loop decides whether to wait.
2. A draft whose tokens end the request's grammar (its stop token): the verify row after the stop token asked a
   terminated matcher for its mask and the step failed. The grammar's allowed part of a draft now ends before
   the token that terminates it.
3. A verify step whose accepted run crossed a jump-forward point: the request jumped only after the run, mid-key,
   and wrote other tokens than it would without drafts. The run now ends at the jump point.
"""

from __future__ import annotations

import random

import pytest

from radixserve.speculative.ngram import BudgetedDrafter, DraftBudget, SpecState
from tests.test_scheduler_fake import VOCAB, conserve, make_scheduler, reference, submit


def _run_contained(sched, overlap: bool, max_steps: int = 20_000) -> None:
    """Steps as the server runs them (each through the failure containment), until idle."""
    step = sched.run_step_overlap if overlap else sched.run_step
    if overlap:
        sched.init_overlap()
    for _ in range(max_steps):
        pending = sched.overlap is not None and sched.overlap.pending
        if sched.is_idle() and not pending and sched.input_queue.empty():
            break
        sched.run_step_contained(lambda: step(block_when_idle=False))
        conserve(sched)
    if overlap:
        sched.close_overlap()
    conserve(sched)


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("max_verify_rows", [32, 9])
def test_paused_drafting_with_retraction_never_fails_a_step(monkeypatch, overlap, max_verify_rows):
    """Prompts that repeat a phrase the model never continues: every draft fails, every request pauses; one request
    is retracted every 5 decode steps, so re-prefills meet paused batches. Several seeds, since which result is in
    flight depends on timing under overlap (the old code failed 5 seeds of 40)."""
    monkeypatch.setenv("RADIXSERVE_TEST_RETRACT_INTERVAL", "5")
    failures, verified = 0, 0
    for seed in range(10):
        rng = random.Random(seed)
        sched, outputs = make_scheduler(pool_tokens=1024, max_running=8, speculative_algorithm="ngram",
                                        speculative_ngram_min_match=1, speculative_max_verify_rows=max_verify_rows)
        expected = {}
        for i in range(12):
            prompt = [rng.randrange(1, VOCAB) for _ in range(5)] * 4
            expected[f"r{i}"] = reference(prompt, submit(sched, f"r{i}", prompt, max_new_tokens=80, temperature=0.0,
                                                         ignore_eos=True))
        _run_contained(sched, overlap)
        failures += sched.failed_steps
        verified += sched.stats.spec_verify_steps
        for rid, want in expected.items():
            assert outputs[rid]["ids"] == want, (seed, rid)
        assert sched.stats.num_retractions > 0
    assert failures == 0
    assert verified > 0, "no verify step ran: the test exercises nothing"


def test_paused_counts_the_steps_tick_before_drafting():
    """`paused` is asked before the step's tick: a request with one step of pause left drafts this step."""
    drafter = BudgetedDrafter.__new__(BudgetedDrafter)
    req = type("R", (), {})()
    req.spec = SpecState(None, DraftBudget(max_tokens=4, paused_steps=2))
    assert drafter.paused([req])
    req.spec.budget.tick()
    assert not drafter.paused([req])  # NOTE: this step's tick ends the pause before `propose`
    req.spec.budget.tick()
    assert req.spec.budget.next_length() > 0


@pytest.fixture(scope="module")
def grammars():
    import torch

    from radixserve.constrained.grammar_backend import GrammarBackend
    from radixserve.model_loader.gguf_loader import gguf_to_hf_folder
    from radixserve.model_loader.model_folder import load_tokenizer
    from radixserve.models.loader import embedded_model_path

    tokenizer = load_tokenizer(gguf_to_hf_folder(embedded_model_path(), torch.float32))
    return GrammarBackend(tokenizer, len(tokenizer), [tokenizer.eos_token_id]), tokenizer


def test_a_draft_stops_before_the_token_that_ends_its_grammar(grammars):
    from radixserve.constrained.grammar_backend import GrammarSpec

    backend, tokenizer = grammars
    grammar = backend.matcher(backend.submit(GrammarSpec("regex", "(ab){1,2}")).result(60))
    ab = tokenizer.encode("abab", add_special_tokens=False)
    draft = [*ab, tokenizer.eos_token_id, *ab]
    # NOTE: the text is allowed up to the stop token; the stop token itself is left to the model
    assert grammar.allowed_prefix(draft) == len(ab)
    bitmask = backend.allocate_bitmask(2)
    for n in range(len(ab) + 1):
        grammar.fill_row_after(bitmask, 0, ab[:n])  # every row of the kept draft has a mask
    assert not grammar.is_terminated() and grammar.allowed_prefix(ab) == len(ab)
    grammar.fill_row_after(bitmask, 1, ab)
    allowed_at_end = [t for t in range(backend.vocab_size) if (int(bitmask[1, t // 32]) >> (t % 32)) & 1]
    assert allowed_at_end == [tokenizer.eos_token_id]  # after "abab" the grammar can only end


def test_an_accepted_draft_run_ends_at_a_jump_point():
    """A prompt holding the JSON to copy: n-gram drafts run across the schema's keys and are accepted, but the keys
    are a jump-forward's. The accepted run ends where the grammar forces text, so the request jumps at the same
    points and writes the same tokens as without drafts (the old code jumped later, mid-key, for 10 fewer forced
    tokens: which tokens a request writes depended on where its verify steps ended; the feature soak found it)."""
    import json

    from test_structured_outputs import LONG_KEYS

    from radixserve import Engine

    example = json.dumps({"customer_full_name_as_written_on_the_invoice": "Ada",
                          "customer_billing_address_country_code": "FR",
                          "total_amount_including_all_taxes_in_euros": 12})
    prompt = f"Copy this invoice exactly: {example}\nCopy: "
    params = {"json_schema": json.dumps(LONG_KEYS), "temperature": 0, "max_new_tokens": 80}
    runs = {}
    for spec, overlap in (("none", False), ("ngram", False), ("ngram", True)):
        engine = Engine(dtype="float32", speculative_algorithm=spec, disable_overlap_schedule=not overlap,
                        log_level="error")
        try:
            out = engine.generate(prompt, sampling_params=params)
            stats = engine.scheduler.stats
            runs[spec, overlap] = (out["output_ids"], stats.jump_forward_tokens, stats.num_jump_forwards)
            if spec == "ngram":
                assert stats.spec_accepted_tokens >= 10, "the drafts were not accepted: the test exercises nothing"
            conservation = engine.get_internal_state()["kv_conservation"]
            assert conservation is not None and "error" not in conservation, conservation
        finally:
            engine.shutdown()
    plain = runs["none", False]
    assert plain[1] >= 30, plain
    assert runs["ngram", False] == plain and runs["ngram", True] == plain, runs
