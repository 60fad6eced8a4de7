"""Logprobs of generated tokens over HTTP: OpenAI chat and completions (streaming and not) and native /generate.

The values come from the scheduler (checked against transformers in test_logprobs.py); here the three
shapes must agree with each other and with the text: one entry per generated token, the greedy token
is the top alternative, a stream's pieces add up to the non-streamed whole, and the bytes join into
the text.
"""

from __future__ import annotations

import json
import math

import pytest
from openai import OpenAI
from server_harness import ServerHandle

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
PROMPT = "The capital of France is"
EOS_TEXT = "<|im_end|>"


def _check_chat_entry(entry, k: int) -> None:
    assert entry.logprob <= 0 and len(entry.top_logprobs) == k
    assert bytes(entry.bytes).decode(errors="replace") == entry.token
    top = [t.logprob for t in entry.top_logprobs]
    assert top == sorted(top, reverse=True) and sum(math.exp(v) for v in top) <= 1 + 1e-5
    # NOTE: greedy: the sampled token is the most likely one.
    assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == entry.logprob


def test_chat_logprobs_stream_and_non_stream_agree_with_generate(api_server: ServerHandle, api_client: OpenAI) -> None:
    args = {"model": "SmolLM2-135M-Instruct", "messages": QUESTION, "max_tokens": 12, "temperature": 0,
            "logprobs": True, "top_logprobs": 3}
    full = api_client.chat.completions.create(**args)
    choice = full.choices[0]
    content = choice.logprobs.content
    assert len(content) == full.usage.completion_tokens
    for entry in content:
        _check_chat_entry(entry, 3)
    joined = b"".join(bytes(e.bytes) for e in content).decode(errors="replace")
    # The tokens cover every generated token: a matched EOS included, though the text drops it.
    assert joined == choice.message.content + (EOS_TEXT if choice.finish_reason == "stop" else "")
    assert choice.finish_reason == "stop" and content[-1].token == EOS_TEXT  # the answer fits in 12 tokens

    chunks = list(api_client.chat.completions.create(**args, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-4)
    assert [[t.token for t in e.top_logprobs] for e in streamed] == [[t.token for t in e.top_logprobs]
                                                                   for e in content]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content

    # The same prompt ids through the native API: the same tokens and values.
    ids = api_server.post("/tokenize", json={"messages": QUESTION}).json()["tokens"]
    native = api_server.post("/generate", json={"input_ids": ids, "return_logprob": True, "top_logprobs_num": 3,
                                            "sampling_params": {"max_new_tokens": 12, "temperature": 0}}).json()
    tokens = native["meta_info"]["output_token_logprobs"]
    assert [text for _, _, text in tokens] == [e.token for e in content]
    assert [lp for lp, _, _ in tokens] == pytest.approx([e.logprob for e in content], abs=1e-4)


def test_chat_without_top_logprobs_and_with_a_stop_string(api_client: OpenAI) -> None:
    plain = api_client.chat.completions.create(messages=QUESTION, model="SmolLM2-135M-Instruct", max_tokens=16,
                                           temperature=0)
    assert plain.choices[0].logprobs is None
    text = plain.choices[0].message.content
    assert "Paris" in text
    cut = api_client.chat.completions.create(messages=QUESTION, model="SmolLM2-135M-Instruct", max_tokens=16,
                                         temperature=0, stop=["Paris"], logprobs=True)
    choice = cut.choices[0]
    assert choice.message.content == text[:text.index("Paris")] and choice.finish_reason == "stop"
    # NOTE: the text is cut before the stop string, the logprobs still cover every generated token.
    content = choice.logprobs.content
    assert len(content) == cut.usage.completion_tokens and all(e.top_logprobs == [] for e in content)
    assert "Paris" in "".join(e.token for e in content)


def test_completions_logprobs_stream_and_n(api_client: OpenAI) -> None:
    args = {"model": "SmolLM2-135M-Instruct", "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
            "logprobs": 2, "extra_body": {"ignore_eos": True}}
    full = api_client.completions.create(**args)
    choice = full.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(6)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value <= 0 and 1 <= len(top) <= 2
        assert max(top, key=top.get) == token and top[token] == value

    chunks = list(api_client.completions.create(**args, stream=True))
    pieces = [c.choices[0].logprobs for c in chunks if c.choices]
    assert [t for p in pieces for t in p.tokens] == lp.tokens
    assert [o for p in pieces for o in p.text_offset] == lp.text_offset
    assert [v for p in pieces for v in p.token_logprobs] == pytest.approx(lp.token_logprobs, abs=1e-4)

    sampled = api_client.completions.create(**args | {"temperature": 0.8, "seed": 3, "n": 2})
    for c in sampled.choices:
        assert "".join(c.logprobs.tokens) == c.text and len(c.logprobs.token_logprobs) == 6
    assert api_client.completions.create(**args | {"logprobs": None}).choices[0].logprobs is None


def test_native_generate_return_logprob(api_server: ServerHandle) -> None:
    body = {"text": PROMPT, "return_logprob": True, "top_logprobs_num": 2, "return_text_in_logprobs": True,
            "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}}
    out = api_server.post("/generate", json=body).json()
    meta = out["meta_info"]
    tokens, tops = meta["output_token_logprobs"], meta["output_top_logprobs"]
    assert [t for _, t, _ in tokens] == out["output_ids"] and "".join(s for _, _, s in tokens) == out["text"]
    assert len(tops) == len(tokens) == 5
    for (lp, token, _), top in zip(tokens, tops, strict=True):
        assert lp <= 0 and len(top) == 2 and top[0][:2] == [lp, token]  # greedy: the most likely

    with api_server.client() as c, c.stream("POST", "/generate", json=body | {"stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    # NOTE: as the text and ids, each event's logprobs are all of them so far.
    assert [len(e["meta_info"]["output_token_logprobs"]) for e in events] == [len(e["output_ids"]) for e in events]
    last = events[-1]["meta_info"]
    assert [t for _, t, _ in last["output_token_logprobs"]] == out["output_ids"]
    assert [lp for lp, _, _ in last["output_token_logprobs"]] == pytest.approx([lp for lp, _, _ in tokens], abs=1e-4)

    no_top = api_server.post("/generate", json=body | {"top_logprobs_num": 0}).json()["meta_info"]
    assert no_top["output_top_logprobs"] == [[]] * 5 and len(no_top["output_token_logprobs"]) == 5
    plain = api_server.post("/generate", json=body | {"return_logprob": False}).json()["meta_info"]
    assert "output_token_logprobs" not in plain and "output_top_logprobs" not in plain
    batch = api_server.post("/generate", json=body | {"text": [PROMPT, "Once upon a time"]}).json()
    assert all([t for _, t, _ in b["meta_info"]["output_token_logprobs"]] == b["output_ids"] for b in batch)


def test_chat_bytes_of_partial_characters_join_into_the_text(api_client: OpenAI) -> None:
    r = api_client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=6, temperature=0, logprobs=True,
                                       messages=[{"role": "user", "content": "Say hi with an emoji"}])
    choice = r.choices[0]
    content = choice.logprobs.content
    # NOTE: the greedy answer is emoji, split over tokens that each hold part of a character.
    assert any(e.token == "\ufffd" for e in content), [e.token for e in content]
    joined = b"".join(bytes(e.bytes) for e in content).decode(errors="replace")
    assert joined == choice.message.content + (EOS_TEXT if choice.finish_reason == "stop" else "")
