"""Prompt logprobs over HTTP: native `logprob_start_len` and completions `echo` (lm-evaluation-harness's shape).

The values come from the scheduler (checked against transformers in test_logprobs.py); here the
native and OpenAI shapes must agree with each other, the echoed text must be the prompt followed by
the completion, a stream must add up to the non-streamed whole, and the scored range must never be
a cache hit: `cached_tokens` stops before the first scored position even on a warm prefix.
"""

from __future__ import annotations

import json
import uuid

import pytest
from server_harness import ServerHandle

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
COMPLETIONS = "/v1/completions"
PROMPT = "The quick brown fox jumps over the lazy dog, and then it runs into the forest to"


def _ok(r) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def _native(api_server: ServerHandle, start: int, salt: str, **extra) -> dict:
    body = {"text": PROMPT, "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": start,
            "cache_salt": salt, "sampling_params": {"max_new_tokens": 3, "temperature": 0}} | extra
    return _ok(api_server.post("/generate", json=body))


def _values(entries: list) -> list:
    return [lp for lp, _, _ in entries]


def test_native_logprob_start_len_and_completions_echo_agree_and_are_never_cache_hits(api_server: ServerHandle) -> None:
    ids = _ok(api_server.post("/tokenize", json={"prompt": PROMPT}))["tokens"]
    salt = uuid.uuid4().hex  # a fresh namespace: nothing of this prompt is cached yet
    warm = _native(api_server, -1, salt)["meta_info"]
    assert warm["cached_tokens"] == 0 and "input_token_logprobs" not in warm
    assert _native(api_server, -1, salt, return_logprob=False)["meta_info"]["cached_tokens"] == len(ids) - 1

    whole = _native(api_server, 0, salt)["meta_info"]
    entries, tops = whole["input_token_logprobs"], whole["input_top_logprobs"]
    assert [t for _, t, _ in entries] == ids and len(tops) == len(ids)
    assert entries[0][0] is None and tops[0] == []
    for (lp, token, text), top in zip(entries[1:], tops[1:], strict=True):
        assert lp <= 0 and len(top) == 2 and top[0][0] >= top[1][0] >= -9999.0
        assert text == api_server.post("/detokenize", json={"tokens": [token]}).json()["prompt"]
    # NOTE: position p is scored by the logits at p - 1, which a cached prefix does not have: the
    # match stops before start - 1 though the whole prompt is in the tree.
    assert whole["cached_tokens"] == 0

    tail = _native(api_server, 3, salt)["meta_info"]
    assert [t for _, t, _ in tail["input_token_logprobs"]] == ids[3:] and len(tail["input_top_logprobs"]) == len(ids) - 3
    assert _values(tail["input_token_logprobs"]) == pytest.approx(_values(entries[3:]), abs=1e-4)
    assert tail["cached_tokens"] == 2

    echo = _ok(api_server.post(COMPLETIONS, json={"model": MODEL, "prompt": PROMPT, "echo": True, "logprobs": 2,
                                              "max_tokens": 3, "temperature": 0, "cache_salt": salt}))
    lp = echo["choices"][0]["logprobs"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:len(ids)] == pytest.approx(_values(entries[1:]), abs=1e-4)
    assert lp["tokens"][:len(ids)] == [text for _, _, text in entries]
    assert echo["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

    with api_server.client() as c, c.stream("POST", "/generate", json={
            "text": PROMPT, "return_logprob": True, "logprob_start_len": 0, "stream": True, "cache_salt": salt,
            "sampling_params": {"max_new_tokens": 3, "temperature": 0}}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    # NOTE: as the output logprobs, each event carries all prompt logprobs so far: all of them from the first on.
    assert len(events) >= 2
    for event in events:
        streamed = event["meta_info"]["input_token_logprobs"]
        assert [t for _, t, _ in streamed] == ids
        assert _values(streamed[1:]) == pytest.approx(_values(entries[1:]), abs=1e-4)
        assert event["meta_info"]["input_top_logprobs"] == [[]] * len(ids)  # top_logprobs_num 0


def test_completions_echo_text_and_logprobs_stream_and_non_stream(api_server: ServerHandle) -> None:
    ids = _ok(api_server.post("/tokenize", json={"prompt": PROMPT}))["tokens"]
    args = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    plain = _ok(api_server.post(COMPLETIONS, json=args))["choices"][0]
    full = _ok(api_server.post(COMPLETIONS, json=args | {"echo": True}))
    choice = full["choices"][0]
    assert choice["text"] == PROMPT + plain["text"] and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids) + 6
    assert "".join(lp["tokens"]) == choice["text"]  # SmolLM2 adds no BOS: the token texts join into the text
    assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(len(lp["tokens"]))]
    assert lp["tokens"][len(ids):] == plain["logprobs"]["tokens"]
    assert lp["token_logprobs"][len(ids):] == pytest.approx(plain["logprobs"]["token_logprobs"], abs=1e-4)
    assert all(len(top) == 1 for top in lp["top_logprobs"][1:])
    assert full["usage"]["prompt_tokens"] == len(ids) and full["usage"]["completion_tokens"] == 6

    with api_server.client() as c, c.stream("POST", COMPLETIONS, json=args | {"echo": True, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    pieces = [c["choices"][0] for c in chunks if c["choices"]]
    # NOTE: the first chunk brings the prompt and its logprobs, with the first generated token.
    assert pieces[0]["text"].startswith(PROMPT) and len(pieces[0]["logprobs"]["tokens"]) >= len(ids)
    assert "".join(p["text"] for p in pieces) == choice["text"]
    assert [t for p in pieces for t in p["logprobs"]["tokens"]] == lp["tokens"]
    assert [o for p in pieces for o in p["logprobs"]["text_offset"]] == lp["text_offset"]
    streamed = [v for p in pieces for v in p["logprobs"]["token_logprobs"]]
    assert streamed[0] is None and streamed[1:] == pytest.approx(lp["token_logprobs"][1:], abs=1e-4)

    no_logprobs = _ok(api_server.post(COMPLETIONS, json=args | {"echo": True, "logprobs": None, "n": 2, "seed": 1,
                                                            "prompt": [PROMPT, "Once upon a time"]}))
    texts = [c["text"] for c in sorted(no_logprobs["choices"], key=lambda c: c["index"])]
    assert [t[:len(PROMPT)] for t in texts[:2]] == [PROMPT] * 2 and all(t.startswith("Once upon a time") for t in texts[2:])
    assert all(c["logprobs"] is None for c in no_logprobs["choices"])


@pytest.mark.parametrize("stream", [False, True])
def test_every_choice_gets_the_prompt_logprobs_scored_once(api_server: ServerHandle, stream: bool) -> None:
    """With n > 1 only choice 0 of each prompt scores it and its siblings carry a copy (echo + logprobs 20 on a
    2,000-token prompt with n=16 took 12x the time of n=1): every choice's prompt part equals n=1's."""
    prompts = [PROMPT, "Once upon a time, in a quiet village by the sea,"]
    ids = [_ok(api_server.post("/tokenize", json={"prompt": p}))["tokens"] for p in prompts]
    args = {"model": MODEL, "max_tokens": 3, "echo": True, "logprobs": 3, "temperature": 0.8, "seed": 7,
            "cache_salt": uuid.uuid4().hex}
    single = [_ok(api_server.post(COMPLETIONS, json=args | {"prompt": p}))["choices"][0]["logprobs"] for p in prompts]
    body = args | {"prompt": prompts, "n": 3, "stream": stream}
    if stream:
        with api_server.client() as c, c.stream("POST", COMPLETIONS, json=body) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        per_choice: dict[int, dict] = {}
        for piece in (ch for chunk in chunks for ch in chunk["choices"]):
            merged = per_choice.setdefault(piece["index"], {"tokens": [], "token_logprobs": [], "top_logprobs": []})
            for key in merged:
                merged[key] += piece["logprobs"][key]
        choices = [per_choice[i] for i in range(6)]
    else:
        out = _ok(api_server.post(COMPLETIONS, json=body))["choices"]
        choices = [c["logprobs"] for c in sorted(out, key=lambda c: c["index"])]
    for index, lp in enumerate(choices):
        want, length = single[index // 3], len(ids[index // 3])
        assert lp["tokens"][:length] == want["tokens"][:length], index
        assert lp["token_logprobs"][0] is None and want["token_logprobs"][0] is None
        assert lp["token_logprobs"][1:length] == pytest.approx(want["token_logprobs"][1:length], abs=1e-4), index
        assert [sorted(t) for t in lp["top_logprobs"][1:length]] == [sorted(t) for t in want["top_logprobs"][1:length]]
        assert len(lp["tokens"]) == length + 3, index


def _loglikelihood(choice: dict, context_len: int) -> tuple[float, bool]:
    """What lm-evaluation-harness's local-completions reads: the continuation's logprob sum and greediness,
    from the positions after the context, the generated token (max_tokens 1) dropped."""
    values = choice["logprobs"]["token_logprobs"][context_len:-1]
    tops = choice["logprobs"]["top_logprobs"][context_len:-1]
    return sum(values), all(v == max(top.values()) for v, top in zip(values, tops, strict=True))


def test_lm_eval_loglikelihood_requests_with_token_id_prompts(api_server: ServerHandle) -> None:
    context = _ok(api_server.post("/tokenize", json={"prompt": "The capital of France is"}))["tokens"]
    continuations = [_ok(api_server.post("/tokenize", json={"prompt": t}))["tokens"] for t in (" Paris", " a banana")]
    prompts = [context + c for c in continuations]
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0,
            "seed": 1234}
    scored = _ok(api_server.post(COMPLETIONS, json=body))
    assert scored["usage"]["completion_tokens"] == 0
    choices = sorted(scored["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1]
    for choice, ids in zip(choices, prompts, strict=True):
        lp = choice["logprobs"]
        decoded = _ok(api_server.post("/detokenize", json={"tokens": ids}))["prompt"]
        assert choice["finish_reason"] == "length" and choice["text"] == decoded
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids)
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert all(len(top) == 1 for top in lp["top_logprobs"][1:])
        native = _ok(api_server.post("/generate", json={"input_ids": ids, "return_logprob": True, "logprob_start_len": 0,
                                                    "sampling_params": {"max_new_tokens": 0}}))
        assert native["output_ids"] == [] and native["meta_info"]["finish_reason"]["type"] == "length"
        assert lp["token_logprobs"][1:] == pytest.approx(_values(native["meta_info"]["input_token_logprobs"][1:]),
                                                         abs=1e-4)

    generated = _ok(api_server.post(COMPLETIONS, json=body | {"max_tokens": 1}))  # lm-eval's default
    results = [_loglikelihood(c, len(context)) for c in sorted(generated["choices"], key=lambda c: c["index"])]
    for (total, _), choice in zip(results, choices, strict=True):
        assert total == pytest.approx(sum(choice["logprobs"]["token_logprobs"][len(context):]), abs=1e-4)
    assert results[0][1] and results[0][0] > results[1][0]  # " Paris" is the greedy, likelier continuation


def test_prompt_logprob_requests_that_are_refused(api_server: ServerHandle) -> None:
    ids = _ok(api_server.post("/tokenize", json={"prompt": PROMPT}))["tokens"]
    for start in (len(ids), -2):
        r = api_server.post("/generate", json={"input_ids": ids, "return_logprob": True, "logprob_start_len": start})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "logprob_start_len" and error["code"] == "invalid_value"
        assert f"0 to {len(ids) - 1}" in error["message"]
    # Without return_logprob, logprob_start_len is not used (as top_logprobs_num).
    ignored = api_server.post("/generate", json={"input_ids": ids, "logprob_start_len": len(ids),
                                             "sampling_params": {"max_new_tokens": 1}})
    assert "input_token_logprobs" not in _ok(ignored)["meta_info"]
    for body, param in [({"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
                        ({"prompt": PROMPT, "max_tokens": -1, "echo": True}, "max_tokens"),
                        ({"prompt": PROMPT, "echo": True, "suffix": "!"}, "suffix"),
                        ({"prompt": PROMPT, "echo": True, "best_of": 2}, "best_of")]:
        r = api_server.post(COMPLETIONS, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert "needs 'echo': true" in api_server.post(COMPLETIONS, json={"prompt": PROMPT, "max_tokens": 0}).json()["error"][
        "message"]
    r = api_server.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": -1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.max_new_tokens", r.text
