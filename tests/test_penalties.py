"""Frequency / presence / repetition penalties, min_new_tokens and logit_bias.

Greedy decoding with penalties must equal a reference loop over transformers (float32) that applies
the same formulas to each step's logits; chunked prefill and retraction (the history is rebuilt from
the host's output ids) must not change outputs; both event loops agree.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_model_smollm2 import hf_model_from_gguf
from test_overlap_parity import mixed_requests, run_scheduler

from radixserve.layers.penalties import PenaltyBatchInfo, PenaltyState
from radixserve.sampling_params import SamplingParams, SamplingParamsError

pytestmark = pytest.mark.slow

PROMPT = "The cat sat on the mat. The cat sat on the mat. The cat sat on the"
PENALTIES = {"frequency_penalty": 0.5, "presence_penalty": 0.3, "repetition_penalty": 1.3}


def penalized(logits: torch.Tensor, prompt: list[int], out: list[int], freq: float, pres: float,
              rep: float) -> torch.Tensor:
    """The formulas, written out plainly: frequency and presence, then repetition."""
    logits = logits.clone()
    counts = torch.bincount(torch.tensor(out, dtype=torch.int64), minlength=logits.shape[0]).float()
    logits -= freq * counts + pres * (counts > 0).float()
    for token in set(prompt + out):
        value = logits[token]
        logits[token] = value / rep if value > 0 else value * rep
    return logits


def reference_greedy(hf, prompt: list[int], steps: int) -> list[int]:
    out: list[int] = []
    for _ in range(steps):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out])).logits[0, -1].float()
        out.append(int(torch.argmax(penalized(logits, prompt, out, 0.5, 0.3, 1.3))))
    return out


@pytest.mark.long
def test_penalized_greedy_equals_a_plain_reference_in_both_loops(engines):
    hf = hf_model_from_gguf(torch.float32)
    prompt = engines[0].tokenizer.encode(PROMPT)
    expected = reference_greedy(hf, prompt, 12)
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True, **PENALTIES}
    plain = engines[0].generate(input_ids=prompt, sampling_params={**params, "repetition_penalty": 1.0,
                                                                   "frequency_penalty": 0, "presence_penalty": 0})
    assert plain["output_ids"] != expected  # the penalties change this output
    for engine in engines:
        assert engine.generate(input_ids=prompt, sampling_params=params)["output_ids"] == expected


def test_min_new_tokens_bans_eos_and_logit_bias_moves_the_choice(engines):
    engine = engines[0]
    ask = [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]
    short = engine.chat(ask, {"temperature": 0, "max_new_tokens": 40})
    assert short["meta_info"]["finish_reason"]["type"] == "stop" and len(short["output_ids"]) < 6
    longer = engine.chat(ask, {"temperature": 0, "max_new_tokens": 40, "min_new_tokens": 12})
    assert len(longer["output_ids"]) >= 12
    assert not set(longer["output_ids"][:12]) & set(engine.scheduler.eos_token_ids)
    first = engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": 1}, return_logprob=True, top_logprobs_num=2)
    best, second = (t for _, t, _ in first["meta_info"]["output_top_logprobs"][0])
    moved = engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": 1, "logit_bias": {best: -100}})
    assert moved["output_ids"] == [second]
    pushed = engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": 1, "logit_bias": {123: 100}})
    assert pushed["output_ids"] == [123]


@pytest.mark.long
def test_history_survives_chunking_and_retraction(monkeypatch):
    from radixserve.models.loader import load_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        loaded = load_model(None, torch.float32, "cpu")
        strong = {"frequency_penalty": 2.0, "presence_penalty": 2.0, "repetition_penalty": 1.0}
        # NOTE: prompts that repeat a short phrase, so the model wants to repeat its own output and the
        # penalties (and a history that lost them) decide what comes next.
        work = [(rid, (prompt[:4] * 6)[: len(prompt) + 8], dataclasses.replace(
                    params, max_new_tokens=16, **(PENALTIES if i % 3 == 2 else strong)))
                for i, (rid, prompt, params) in enumerate(mixed_requests(12, seed=3))]
        calm, _ = run_scheduler(loaded, work, overlap=False, max_total_tokens=4096)
        # NOTE: one request retracted every 3 decode steps: it re-prefills with outputs already made,
        # and its penalty history must be rebuilt from them.
        monkeypatch.setenv("RADIXSERVE_TEST_RETRACT_INTERVAL", "3")
        for overlap in (True, False):
            pressed, sched = run_scheduler(loaded, work, overlap=overlap, chunked_prefill_size=16)
            assert sched.stats.num_retractions >= 3
            for rid, _, _ in work:
                if "abort" not in (pressed[rid]["finish"]["type"], calm[rid]["finish"]["type"]):
                    assert pressed[rid]["ids"] == calm[rid]["ids"], (overlap, rid)
    finally:
        torch.set_num_threads(threads)


def test_penalty_state_math_bias_bans_and_record_mask():
    state = PenaltyState(num_rows=3)
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0], [1.0, 1.0, 1.0, 1.0]])
    info = PenaltyBatchInfo(
        rows=torch.tensor([1, 2]), frequency=torch.tensor([[1.0], [0.0]]), presence=torch.tensor([[0.5], [0.0]]),
        repetition=torch.tensor([[2.0], [1.0]]), use_history=True, resets=[(1, [1], [0, 0]), (2, [], [])],
        record=torch.tensor([True, False]), banned=([1], [3]), bias=([0], [2], [4.0]))
    out = state.process(logits, info)
    # row 0: token 0 counted twice (2 - 2 - 0.5 = -0.5, seen: * 2 = -1), token 1 seen in the prompt (-1 * 2)
    assert out[0].tolist() == [-1.0, -2.0, 4.5, 3.0]
    assert out[1].tolist() == [1.0, 1.0, 1.0, float("-inf")]
    assert logits[0, 0] == 2.0  # the input is left alone (logprobs read it)
    state.record(torch.tensor([3, 2]), info)
    assert state.counts[1].tolist() == [2, 0, 0, 1] and state.counts[2].tolist() == [0, 0, 0, 0]
    assert state.seen[1].tolist() == [True, True, False, True]


@pytest.mark.parametrize("field,value", [("frequency_penalty", 2.5), ("presence_penalty", -3),
                                         ("repetition_penalty", 0), ("min_new_tokens", -1),
                                         ("logit_bias", {5: 101}), ("logit_bias", {"5": 1.0})])
def test_out_of_range_values_name_the_parameter(field, value):
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(**{field: value})
    assert err.value.param == field
