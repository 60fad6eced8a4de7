"""--enable-deterministic-inference: a request's logprobs are the same bits alone, in a batch of up to 64 at any
position, after a cache hit of any length, chunked any way, in either event loop, with n-gram speculation on or
off; greedy and seeded; float32, bf16 weights and int4 on the embedded model, and a tiny random Llama.

Each configuration runs a reference Engine (the overlap loop, whole prompts) and a variant Engine (the normal loop,
prompt chunks of 5-32 tokens, page size 4, n-gram speculation); every comparison is bit for bit (float32 logprobs
as Python floats, and token ids)."""

from __future__ import annotations

import random

import pytest
from test_model_support import assert_engine_conserved

GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
SEEDED = {"temperature": 0.9, "top_p": 0.95, "seed": 11, "max_new_tokens": 8, "ignore_eos": True}
VARIANT = {"disable_overlap_schedule": True, "page_size": 4, "speculative_algorithm": "ngram"}
CHUNKS = {"float32": 16, "bf16 weights": 7, "int4": 32, "tiny llama": 5}  # the variant's prompt chunk per config


def mixed_prompts(num: int, vocab: int, seed: int = 7) -> list[list[int]]:
    """Prompts that share three system prefixes cut at random lengths, then 1-30 tokens of their own (the radix
    cache serves parts of them in a batch), with a repeated phrase that n-gram drafts can match."""
    rng = random.Random(seed)
    low = 100 if vocab > 1000 else 3
    systems = [[rng.randrange(low, vocab) for _ in range(n)] for n in (20, 45, 70)]
    phrase = [rng.randrange(low, vocab) for _ in range(6)]
    out = []
    for i in range(num):
        head = systems[i % 3][: rng.randrange(5, len(systems[i % 3]) + 1)]
        out.append(head + phrase + [rng.randrange(low, vocab) for _ in range(rng.randrange(1, 30))] + phrase)
    return out


def logprobs(engine, prompts: list[list[int]], params: dict) -> list[list[tuple[float, int]]]:
    outs = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
    return [[(lp, tok) for lp, tok, _ in out["meta_info"]["output_token_logprobs"]] for out in outs]


def alone(engine, prompt: list[int], params: dict) -> list[tuple[float, int]]:
    engine.flush_cache()
    return logprobs(engine, [prompt], params)[0]


def make_engine(model_path, dtype: str, quantization: str = "none", **extra):
    from radixserve import Engine

    return Engine(model_path=model_path, dtype=dtype, quantization=quantization, max_total_tokens=6000,
                  max_running_requests=64, log_level="warning", enable_deterministic_inference=True, **extra)


def save_tiny_llama(folder, head_dim: int = 32) -> None:
    """A random two-layer Llama whose widths the C decoder takes (multiples of 32) unless `head_dim` is not."""
    import torch
    from test_model_support import save_tiny_tokenizer, tiny_hf_config
    from transformers import AutoModelForCausalLM

    config = tiny_hf_config("llama")
    config.num_attention_heads, config.num_key_value_heads = 64 // head_dim, 1
    config.head_dim = head_dim
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(str(folder))
    save_tiny_tokenizer(folder)


CONFIGS = {"float32": (None, "float32", "none"), "bf16 weights": (None, "auto", "none"),
           "int4": (None, "float32", "int4")}


@pytest.fixture(scope="module", params=[*CONFIGS, "tiny llama"])
def pair(request, tmp_path_factory):
    """(reference Engine, variant Engine, prompts, configuration name) of one configuration."""
    if request.param == "tiny llama":
        from test_model_support import TINY_VOCAB

        folder = tmp_path_factory.mktemp("tiny_llama")
        save_tiny_llama(folder)
        model_path, dtype, quantization, vocab = str(folder), "float32", "none", TINY_VOCAB
    else:
        (model_path, dtype, quantization), vocab = CONFIGS[request.param], 40000
    reference = make_engine(model_path, dtype, quantization)
    variant = make_engine(model_path, dtype, quantization, chunked_prefill_size=CHUNKS[request.param], **VARIANT)
    yield reference, variant, mixed_prompts(16, vocab), request.param
    for engine in (reference, variant):
        engine.shutdown()


def test_plan_says_what_the_mode_switched(pair):
    reference = pair[0]
    plan = reference.model_runner.execution_plan.as_dict()
    assert plan["deterministic"]["choice"] == "on"
    assert plan["attention shared prefix"]["choice"] == "off"
    rows = [entry["reason"] for part, entry in plan.items() if part.startswith("linear ")]
    assert rows and all("every row count" in reason for reason in rows), rows


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_batch_at_any_position_gives_the_bits_of_the_request_alone(pair, params):
    reference, variant, prompts, name = pair
    solo = {i: alone(reference, prompts[i], params) for i in (0, 5, 13)}
    reference.flush_cache()
    batched = logprobs(reference, prompts, params)
    for i, want in solo.items():
        assert batched[i] == want, (name, i)
    # NOTE: the same prompts reversed: every request at another position among other neighbours, in the variant
    # engine (normal loop, small chunks, page size 4, n-gram drafts)
    variant.flush_cache()
    reversed_out = logprobs(variant, prompts[::-1], params)[::-1]
    assert reversed_out == batched, name
    # a batch of 2, at both positions
    for pair_prompts, at in (([prompts[0], prompts[5]], 0), ([prompts[5], prompts[0]], 1)):
        variant.flush_cache()
        assert logprobs(variant, pair_prompts, params)[at] == solo[0], (name, at)
    for engine in (reference, variant):
        assert_engine_conserved(engine)


def test_64_copies_and_neighbours_in_one_batch(pair):
    """Batches of 64: the target at every other position among 32 others, then shifted by one, so that it sits at
    every one of the 64 positions once (its copies may hit each other's cache)."""
    reference, variant, prompts, name = pair
    if name not in ("float32", "tiny llama"):
        pytest.skip("the 64-row batches run for float32 and the tiny model; the other formats run 16 rows above")
    target = prompts[4]
    want = alone(reference, target, GREEDY)
    for shift, engine in ((0, reference), (1, variant)):
        batch = [target if i % 2 == shift else prompts[i % len(prompts)] for i in range(64)]
        engine.flush_cache()
        got = logprobs(engine, batch, GREEDY)
        assert all(got[i] == want for i in range(shift, 64, 2)), (name, shift)
        assert_engine_conserved(engine)


def test_accepted_drafts_change_no_bit(pair):
    """A prompt that repeats a phrase, so that the variant's n-gram drafts are accepted: the same bits as the
    reference, which does not speculate (greedy and seeded)."""
    reference, variant, prompts, name = pair
    phrase = prompts[0][-6:]
    prompt = prompts[0][:10] + phrase * 6
    before = variant.get_internal_state()["spec_accepted_tokens"]
    for params in (GREEDY, SEEDED):
        params = {**params, "max_new_tokens": 24}
        want = alone(reference, prompt, params)
        assert alone(variant, prompt, params) == want, name
    if name != "tiny llama":  # NOTE: the random tiny model does not continue the phrase
        assert variant.get_internal_state()["spec_accepted_tokens"] > before, name


def test_a_cache_hit_of_every_length(pair):
    """The target's first tokens after a prefix of every length was cached by another request (every third for
    the bf16 and int4 formats), then after its whole prompt and part of its output were."""
    reference, variant, prompts, name = pair
    target = min(prompts, key=len)
    want = alone(reference, target, GREEDY)
    step = 1 if name in ("float32", "tiny llama") else 3
    one, two = {**GREEDY, "max_new_tokens": 1}, {**GREEDY, "max_new_tokens": 2}
    for engine in (reference, variant):
        for cut in range(1, len(target), step):
            engine.flush_cache()
            logprobs(engine, [target[:cut]], one)
            assert logprobs(engine, [target], two)[0] == want[:2], (name, cut)
        assert logprobs(engine, [target], GREEDY)[0] == want  # the whole prompt and output cached
        tokens = [tok for _, tok in want]
        continued = logprobs(engine, [target + tokens[:4]], {**GREEDY, "max_new_tokens": 4})[0]
        assert continued == want[4:], name  # a hit that reaches into the output
        assert_engine_conserved(engine)


def test_without_the_flag_batches_change_the_bits():
    """The mode matters: without it the same float32 request differs by a rounding in some batch (the fast paths
    switch kernels by row count and split a shared prefix off)."""
    from radixserve import Engine

    prompts = mixed_prompts(16, 40000)
    engine = Engine(dtype="float32", max_total_tokens=6000, log_level="warning")
    try:
        solo = [alone(engine, prompts[i], GREEDY) for i in (0, 5, 13)]
        engine.flush_cache()
        batched = logprobs(engine, prompts, GREEDY)
        assert [batched[i] for i in (0, 5, 13)] != solo
        assert_engine_conserved(engine)
    finally:
        engine.shutdown()


def test_the_flag_refuses_to_start_where_it_cannot_hold(tmp_path):
    import torch

    from radixserve import Engine
    from radixserve.model_executor.deterministic import DeterminismUnavailable, deterministic_linear_method

    cpu = torch.device("cpu")
    with pytest.raises(DeterminismUnavailable, match="bfloat16 compute"):
        deterministic_linear_method("auto", cpu, torch.bfloat16, None)
    with pytest.raises(DeterminismUnavailable, match="onednn"):
        deterministic_linear_method("onednn", cpu, torch.float32, None)
    with pytest.raises(DeterminismUnavailable, match="not on cuda"):
        deterministic_linear_method("auto", torch.device("cuda"), torch.float32, None)
    assert deterministic_linear_method("auto", cpu, torch.float32, "bfloat16") == "bf16_weights"
    assert deterministic_linear_method("auto", cpu, torch.float32, None) == "f32_gemv"
    save_tiny_llama(tmp_path, head_dim=16)
    with pytest.raises(DeterminismUnavailable, match="not a multiple of 32"):
        Engine(model_path=str(tmp_path), dtype="float32", log_level="warning", enable_deterministic_inference=True)
