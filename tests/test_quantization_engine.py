"""The embedded SmolLM2 served with packed weights: sensible greedy text in each format, and the scheduler's
features (radix cache, overlap, cascade, chunked prefill, logprobs, penalties) with KV conserved."""

from __future__ import annotations

import pytest
import torch

from radixserve import Engine

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
GREEDY = {"temperature": 0.0, "max_new_tokens": 16}


@pytest.fixture(scope="module")
def hf_folder():
    """The embedded model as a bfloat16 Hugging Face folder (the GGUF converter's cache)."""
    from radixserve.model_loader.gguf_loader import gguf_to_hf_folder
    from radixserve.models.loader import embedded_model_path

    return str(gguf_to_hf_folder(embedded_model_path(), torch.bfloat16))


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _conserved(engine: Engine) -> None:
    state = engine.get_internal_state()
    assert state["kv_conservation"] is not None and "error" not in state["kv_conservation"], state
    assert state["protected_tokens"] == 0 and state["num_running_reqs"] == 0


@pytest.mark.parametrize("source,quantization,expected", [
    ("gguf", "int4", "int4 g32"),       # the shipped Q4_1 blocks as they are
    ("hf", "int8", "int8 per-channel"),  # a bfloat16 checkpoint quantized at load
    ("hf", "int4", "int4 g32"),
])
@pytest.mark.long
def test_greedy_chat_is_sensible_in_each_format(hf_folder, source, quantization, expected):
    engine = Engine(model_path=None if source == "gguf" else hf_folder, dtype="bfloat16", quantization=quantization,
                    max_total_tokens=2048, log_level="warning")
    try:
        model = engine.model_runner.model
        assert model.model.layers[0].mlp.gate_up_proj.method.packed.format_name == expected
        assert model.lm_head.method.packed is model.model.embed_tokens.packed  # tied: one int8 table
        text = engine.chat(QUESTION, GREEDY)["text"]
        assert "Paris" in text, text
        _conserved(engine)
    finally:
        engine.shutdown()


def test_packed_model_under_every_scheduler_feature():
    """int4 with a small chunked-prefill size, overlap on, cascade on, a shared prefix, logprobs and penalties."""
    prefix = ("You are a careful assistant who answers questions about geography in one short sentence, "
              "without any preamble, explanation or apology. Question: ")
    prompts = [prefix + q for q in ("What is the capital of France?", "Where is Mount Everest?",
                                    "What is the capital of Italy?", "Which ocean is the largest?")]
    outs = {}
    for overlap in (True, False):
        engine = Engine(dtype="bfloat16", quantization="int4", max_total_tokens=2048, chunked_prefill_size=32,
                        disable_overlap_schedule=not overlap, log_level="warning")
        try:
            first = engine.generate(prompts, GREEDY)
            again = engine.generate(prompts, GREEDY)  # now the prefix and prompts hit the radix cache
            assert [o["text"] for o in again] == [o["text"] for o in first]
            assert all(o["meta_info"]["cached_tokens"] > 0 for o in again)
            scored = engine.generate(prompts[0], {**GREEDY, "repetition_penalty": 1.3, "frequency_penalty": 0.5},
                                     return_logprob=True, top_logprobs_num=2, logprob_start_len=0)
            logprobs = scored["meta_info"]["output_token_logprobs"]
            assert len(logprobs) >= 1 and all(lp[0] <= 0 for lp in logprobs)
            _conserved(engine)
            outs[overlap] = [o["text"] for o in first]
        finally:
            engine.shutdown()
    assert outs[True] == outs[False]
