"""Logprobs of generated tokens (`return_logprob`, `top_logprobs_num`) on the embedded model, float32.

Checked against transformers reading the same GGUF: the logprob of each generated token equals
log_softmax of the reference model's logits at that position. Also: both event loops agree, a radix
cache hit returns the same values as a miss, streaming increments add up to the whole, and
requests without logprobs in the same batch get none.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_model_smollm2 import hf_model_from_gguf

from radixserve import Engine
from radixserve.protocol.io_struct import LogprobSpec

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "Once upon a time, a small robot", "def fibonacci(n):"]
GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}


def reference_logprobs(hf, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """log_softmax of the reference model at each generated position: [len(output_ids), vocab]."""
    ids = torch.tensor([prompt_ids + output_ids])
    with torch.no_grad():
        logits = hf(ids).logits[0, len(prompt_ids) - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1)


@pytest.mark.long
def test_logprobs_match_transformers_and_both_loops(engines):
    overlap, normal = engines
    hf = hf_model_from_gguf(torch.float32)
    results = overlap.generate(PROMPTS, GREEDY, return_logprob=True, top_logprobs_num=3)
    again = normal.generate(PROMPTS, GREEDY, return_logprob=True, top_logprobs_num=3)
    for prompt, out, other in zip(PROMPTS, results, again, strict=True):
        meta = out["meta_info"]
        tokens, tops = meta["output_token_logprobs"], meta["output_top_logprobs"]
        assert [t for _, t, _ in tokens] == out["output_ids"] and len(tops) == len(tokens) == 8
        ref = reference_logprobs(hf, overlap.tokenizer.encode(prompt), out["output_ids"])
        for pos, ((lp, token, text), top) in enumerate(zip(tokens, tops, strict=True)):
            assert lp == pytest.approx(ref[pos, token].item(), abs=2e-3)
            assert text == overlap.tokenizer.decode([token])
            assert len(top) == 3 and top[0][1] == token  # greedy: the sampled token is the most likely
            assert [v for v, _, _ in top] == sorted((v for v, _, _ in top), reverse=True)
            ref_top = torch.topk(ref[pos], 3)
            assert [t for _, t, _ in top] == ref_top.indices.tolist()
        assert other["output_ids"] == out["output_ids"]
        for (a, _, _), (b, _, _) in zip(tokens, other["meta_info"]["output_token_logprobs"], strict=True):
            assert a == pytest.approx(b, abs=1e-4)


def test_cache_hit_returns_the_same_logprobs_as_a_miss(engines):
    engine = engines[0]
    engine.flush_cache()
    prompt = "A long and winding road leads to a small village where the people grow apples and"
    first = engine.generate(prompt, GREEDY, return_logprob=True)
    second = engine.generate(prompt, GREEDY, return_logprob=True)
    assert first["meta_info"]["cached_tokens"] == 0 < second["meta_info"]["cached_tokens"]
    a = [lp for lp, _, _ in first["meta_info"]["output_token_logprobs"]]
    b = [lp for lp, _, _ in second["meta_info"]["output_token_logprobs"]]
    assert a == pytest.approx(b, abs=1e-4)
    assert first["meta_info"]["output_top_logprobs"] == [[]] * 8  # top_logprobs_num 0: none listed


@pytest.mark.long
def test_sampled_tokens_get_the_logprob_of_the_temperature_scaled_distribution(engines):
    engine = engines[1]
    params = {"temperature": 0.7, "max_new_tokens": 6, "seed": 11, "ignore_eos": True}
    out = engine.generate(PROMPTS[1], params, return_logprob=True, top_logprobs_num=5)
    hf = hf_model_from_gguf(torch.float32)
    ids = torch.tensor([engine.tokenizer.encode(PROMPTS[1]) + out["output_ids"]])
    with torch.no_grad():
        logits = hf(ids).logits[0, -len(out["output_ids"]) - 1 : -1].float()
    scaled = torch.log_softmax(logits / 0.7, dim=-1)
    for pos, (lp, token, _) in enumerate(out["meta_info"]["output_token_logprobs"]):
        assert lp == pytest.approx(scaled[pos, token].item(), abs=2e-3)
        assert sum(math.exp(v) for v, _, _ in out["meta_info"]["output_top_logprobs"][pos]) <= 1 + 1e-5


def test_mixed_batch_streaming_and_validation(engines):
    engine = engines[0]
    handles = [engine.submit(engine.tokenizer.encode(p), GREEDY, logprob=LogprobSpec(i != 1, top_logprobs_num=2))
               for i, p in enumerate(PROMPTS)]
    results = [h.result(timeout=120) for h in handles]
    assert "output_token_logprobs" not in results[1]["meta_info"]
    assert all(len(r["meta_info"]["output_token_logprobs"]) == 8 for r in (results[0], results[2]))
    pieces = list(engine.generate(PROMPTS[0], GREEDY, stream=True, return_logprob=True, top_logprobs_num=2))
    streamed = [entry for piece in pieces for entry in piece["meta_info"]["output_token_logprobs"]]
    assert [t for _, t, _ in streamed] == results[0]["output_ids"]
    whole = results[0]["meta_info"]["output_token_logprobs"]
    assert [lp for lp, _, _ in streamed] == pytest.approx([lp for lp, _, _ in whole], abs=1e-4)
    with pytest.raises(ValueError, match="top_logprobs_num"):
        engine.generate(PROMPTS[0], GREEDY, return_logprob=True, top_logprobs_num=21)


@pytest.mark.long
def test_prompt_logprobs_match_transformers_and_are_never_read_from_the_cache(engines):
    overlap, normal = engines
    hf = hf_model_from_gguf(torch.float32)
    prompt = "A long and winding road leads to a small village where the people grow apples and pears"
    ids = overlap.tokenizer.encode(prompt)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    for engine in (overlap, normal):
        engine.flush_cache()
        warm = engine.generate(prompt, GREEDY)  # the whole prompt is in the tree now
        assert warm["meta_info"]["cached_tokens"] == 0
        for start in (0, 5):
            out = engine.generate(prompt, {**GREEDY, "max_new_tokens": 2}, return_logprob=True,
                                  top_logprobs_num=2, logprob_start_len=start)
            meta = out["meta_info"]
            entries = meta["input_token_logprobs"]
            assert [t for _, t, _ in entries] == ids[start:] and len(meta["input_top_logprobs"]) == len(entries)
            if start == 0:
                assert entries[0][0] is None and meta["input_top_logprobs"][0] == []
            for pos, (lp, token, _) in enumerate(entries, start=start):
                if pos == 0:
                    continue
                assert lp == pytest.approx(ref[pos - 1, token].item(), abs=2e-3), pos
                top = meta["input_top_logprobs"][pos - start]
                assert [t for _, t, _ in top] == torch.topk(ref[pos - 1], 2).indices.tolist()
            # NOTE: positions from start - 1 on are recomputed; only the part before comes from the tree.
            assert meta["cached_tokens"] == max(start - 1, 0)
        assert "input_token_logprobs" not in engine.generate(prompt, GREEDY, return_logprob=True)["meta_info"]


def test_prompt_logprobs_over_chunked_prefill_and_max_new_tokens_zero(engines):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    ids = list(range(1000, 1050))
    try:
        results = []
        for overlap in (True, False):
            engine = Engine(dtype="float32", device="cpu", max_total_tokens=512, chunked_prefill_size=16,
                            disable_overlap_schedule=not overlap, log_level="warning")
            try:
                out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                                      logprob_start_len=3)
                state = engine.get_internal_state()
                assert "error" not in state["kv_conservation"] and state["protected_tokens"] == 0
            finally:
                engine.shutdown()
            assert out["output_ids"] == [] and out["meta_info"]["finish_reason"]["type"] == "length"
            results.append([lp for lp, _, _ in out["meta_info"]["input_token_logprobs"]])
        whole = engines[1].generate(input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                                    logprob_start_len=3)
        unchunked = [lp for lp, _, _ in whole["meta_info"]["input_token_logprobs"]]
        assert len(unchunked) == len(ids) - 3 and all(lp is not None for lp in unchunked)
        assert results[0] == pytest.approx(unchunked, abs=1e-4)
        assert results[1] == pytest.approx(unchunked, abs=1e-4)
    finally:
        torch.set_num_threads(threads)
