"""Issue 11's reproducers: requests that used to kill the scheduler, 500, or stall the event loop. Each is
now a 4xx or a correct answer, and after every test the scheduler still serves and KV is conserved.
Then a property test (hypothesis) posts generated bodies, typed and untyped, to every endpoint."""

from __future__ import annotations

import json
import math

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_harness import API_SERVER_ARGS, ServerHandle, check_idle_conservation, shared_server

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server() -> ServerHandle:
    return shared_server(*API_SERVER_ARGS)


@pytest.fixture(autouse=True)
def _scheduler_alive_and_kv_conserved(server: ServerHandle):
    yield
    ok = server.post(COMPLETIONS, json={"prompt": "Hello", "max_tokens": 1})
    assert ok.status_code == 200, ok.text
    info = server.info()
    assert info["scheduler_alive"] and info["model"]["pid"] == _PID.setdefault("pid", info["model"]["pid"])
    check_idle_conservation(server)


_PID: dict[str, int] = {}  # the scheduler process of the first test: it must never be replaced here


def _error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> str:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error["message"]


def _raw(server: ServerHandle, path: str, body: str | bytes) -> httpx.Response:
    content = body.encode() if isinstance(body, str) else body
    return server.post(path, content=content, headers={"content-type": "application/json"})


def _strict_json(text: str) -> object:
    def refuse(name: str) -> None:
        raise AssertionError(f"{name} in a response")
    return json.loads(text, parse_constant=refuse)


# ----------------------------------------------------------------------- requests that killed the scheduler


def test_stop_ids_outside_the_vocabulary_are_400_not_a_dead_scheduler(server: ServerHandle) -> None:
    _error(server.post(CHAT, json={"messages": MESSAGES, "max_tokens": 4, "stop_token_ids": [60000],
                                   "min_tokens": 1}), 400, "stop_token_ids", "invalid_value")
    _error(server.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 2, "stop_token_ids": [10**19],
                                          "min_tokens": 1}), 400, "stop_token_ids")
    message = _error(server.post("/generate", json={"text": "hi", "sampling_params": {
        "max_new_tokens": 4, "stop_token_ids": [49152], "min_new_tokens": 2}}), 400, "sampling_params.stop_token_ids")
    assert "[0, 49152)" in message


def test_a_huge_top_k_is_400(server: ServerHandle) -> None:
    _error(server.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 2, "temperature": 1, "top_k": 10**19}),
           400, "top_k")
    # a top_k above the vocabulary (but a sane integer) is the whole vocabulary, as -1 is
    r = server.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 2, "temperature": 1, "top_k": 100_000})
    assert r.status_code == 200, r.text


# ----------------------------------------------------------------------- NaN reaching clients


def test_a_temperature_below_the_floor_is_greedy_with_finite_logprobs(server: ServerHandle) -> None:
    body = {"prompt": "The capital of France is", "max_tokens": 6, "ignore_eos": True}
    greedy = server.post(COMPLETIONS, json=body | {"temperature": 0, "logprobs": 2}).json()["choices"][0]
    tiny = server.post(COMPLETIONS, json=body | {"temperature": 1e-300, "logprobs": 2})
    assert tiny.status_code == 200, tiny.text  # was a 500: "Out of range float values are not JSON compliant"
    choice = _strict_json(tiny.text)["choices"][0]
    assert choice["text"] == greedy["text"] and choice["text"].strip()
    assert all(math.isfinite(v) for v in choice["logprobs"]["token_logprobs"])
    assert choice["logprobs"]["tokens"] == greedy["logprobs"]["tokens"]
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(greedy["logprobs"]["token_logprobs"], abs=1e-3)
    with server.client() as c, c.stream("POST", COMPLETIONS, json=body | {"temperature": 1e-300, "logprobs": 1,
                                                                          "stream": True}) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    streamed = "".join(_strict_json(e)["choices"][0]["text"] for e in events[:-1])  # no NaN in any event
    assert streamed == greedy["text"]
    plain = server.post(COMPLETIONS, json=body | {"temperature": 1e-300}).json()["choices"][0]["text"]
    assert plain == greedy["text"]


# ----------------------------------------------------------------------- 500s that are 4xx


def test_lone_surrogates_are_400_naming_the_field(server: ServerHandle) -> None:
    _error(_raw(server, COMPLETIONS, '{"prompt": "hi", "max_tokens": 1, "model": "\\ud800"}'), 400, "model",
           "invalid_utf8")
    _error(_raw(server, "/generate", '{"text": "hi", "sampling_params": {"\\ud800": 1}}'), 400, "sampling_params",
           "invalid_utf8")
    _error(_raw(server, COMPLETIONS, '{"prompt": "hi", "max_tokens": 1, "extra_key": "\\ud800"}'), 400,
           "extra_key", "invalid_utf8")
    _error(_raw(server, COMPLETIONS, '{"prompt": "hi", "max_tokens": 1, "stop": "\\udc00"}'), 400, "stop",
           "invalid_utf8")
    _error(_raw(server, CHAT, '{"messages": [{"role": "user", "content": "a\\ud83d"}], "max_tokens": 1}'), 400,
           "messages.0.content", "invalid_utf8")


def test_logit_bias_keys_must_be_ascii_token_ids(server: ServerHandle) -> None:
    for key in ("\u00b2", "\u0663"):  # isdigit() is true for both; int("²") fails, int("٣") is 3
        _error(server.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 1, "logit_bias": {key: 1}}), 400,
               "logit_bias", "invalid_value")


@pytest.mark.parametrize("sampling, param", [
    ({"stop": 5}, "sampling_params.stop"), ({"stop_token_ids": 5}, "sampling_params.stop_token_ids"),
    ({"ignore_eos": "yes"}, "sampling_params.ignore_eos"), ({"stop": {"a": 1}}, "sampling_params.stop"),
    ({"stop_token_ids": [True]}, "sampling_params.stop_token_ids.0"),
])
def test_native_sampling_params_are_typed(server: ServerHandle, sampling: dict, param: str) -> None:
    _error(server.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 1, **sampling}}),
           400, param)


def test_a_deeply_nested_body_is_400_before_parsing(server: ServerHandle) -> None:
    message = _error(_raw(server, COMPLETIONS, b"[" * 100_000 + b"]" * 100_000), 400, code="invalid_json")
    assert "levels deep" in message
    _error(server.post("/generate", json={"text": "hi", "sampling_params": {"stop": [[[[[[["x"]]]]]]]}}), 400)


def test_a_request_over_the_fanout_limit_is_refused_before_any_work(server: ServerHandle) -> None:
    # 100 prompts x n=16 used to be accepted and starve every other client
    message = _error(server.post(COMPLETIONS, json={"prompt": ["hi"] * 100, "n": 16, "max_tokens": 1}), 400, "n",
                     "too_many_sequences")
    assert "1600" in message and "--max-request-fanout" in message
    _error(server.post("/generate", json={"input_ids": [[1, 2]] * 300, "sampling_params": {"max_new_tokens": 1}}),
           400, "input_ids", "too_many_sequences")


_OVER = [  # (path, body, param, flag): each one item over its default bound
    (COMPLETIONS, {"prompt": "hi", "stop_token_ids": [2] * 1025}, "stop_token_ids", "--max-stop-token-ids"),
    (COMPLETIONS, {"prompt": "hi", "logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias",
     "--max-logit-bias-entries"),
    (COMPLETIONS, {"prompt": "hi", "stop": ["x" * 1025]}, "stop", "--max-stop-string-chars"),
    (COMPLETIONS, {"prompt": "hi", "stop": ["x"] * 17}, "stop", "at most 16 (fixed)"),
    (COMPLETIONS, {"prompt": "hi", "rid": "r" * 257}, "rid", "--max-id-chars"),
    (CHAT, {"messages": MESSAGES * 1025}, "messages", "--max-chat-messages"),
    (CHAT, {"messages": MESSAGES, "cache_salt": "s" * 257}, "cache_salt", "--max-id-chars"),
    ("/generate", {"text": "hi", "extra_key": "k" * 257}, "extra_key", "--max-id-chars"),
    ("/generate", {"text": "hi", "sampling_params": {"stop_token_ids": [2] * 1025}},
     "sampling_params.stop_token_ids", "--max-stop-token-ids"),
    # 16 prompts x n=16 x 1,000 stop ids: each list under its bound, the product over --max-request-items
    ("/generate", {"text": ["hi"] * 16, "sampling_params": {"n": 16, "stop_token_ids": [2] * 1000}},
     "sampling_params.stop_token_ids", "--max-request-items"),
    # the param names the largest part of the product
    (COMPLETIONS, {"prompt": ["hi"] * 16, "n": 16, "logit_bias": {str(i): 1 for i in range(200)},
                   "stop_token_ids": [2] * 100}, "logit_bias", "--max-request-items"),
]


@pytest.mark.parametrize("path, body, param, flag", _OVER, ids=[f"{o[0]}-{o[3]}" for o in _OVER])
def test_every_list_and_string_is_bounded_with_a_400_naming_the_field_and_flag(
        server: ServerHandle, path: str, body: dict, param: str, flag: str) -> None:
    body = {"max_tokens": 1, **body} if path != "/generate" else body
    message = _error(server.post(path, json=body), 400, param, "over_limit")
    assert flag in message, message


def test_values_openai_refuses_are_400(server: ServerHandle) -> None:
    for best_of, n in ((0, 1), (-1, 1), (1, 2)):
        _error(server.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 1, "best_of": best_of, "n": n}), 400,
               "best_of", "invalid_value")
    # 1e-300 was accepted and became 0.0 in float32: greedy then repeated one word forever
    for path, body in ((COMPLETIONS, {"prompt": "hi", "max_tokens": 1, "repetition_penalty": 1e-300}),
                       ("/generate", {"text": "hi", "sampling_params": {"repetition_penalty": 1e-300}})):
        message = _error(server.post(path, json=body), 400)
        assert "repetition_penalty" in message and "1e-06" in message, message
    ok = server.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 2, "repetition_penalty": 1e-6, "best_of": 1})
    assert ok.status_code == 200, ok.text


# NOTE: requests that stalled the event loop, and the keyless flood: test_server_stalls.py


# ----------------------------------------------------------------------- generated bodies


_JSON = st.recursive(st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False)
                     | st.text(max_size=12), lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
_WILD_INT = st.integers(-(2**64), 2**64) | st.sampled_from([-1, 0, 1, 49151, 49152, 60000, 10**19])
_WILD_FLOAT = st.floats(allow_nan=False) | st.sampled_from([1e-300, 1e-6, -0.0, 3.0, 1e308])
_WILD = _JSON | _WILD_INT | _WILD_FLOAT | st.text(max_size=16) | st.sampled_from(["\u00b2", "\u0663", "", "<|im_end|>"])
_WORDS = st.text(st.sampled_from("abcdefgh ,.!?\n\u00e9\u4e2d\U0001f600"), min_size=1, max_size=20)
_IDS = st.lists(st.integers(0, 49151), min_size=1, max_size=6)
# Sane values of every sampling field: a body starts valid, then up to two fields are made wild.
_SAMPLING = {
    "temperature": st.sampled_from([0.0, 1e-300, 0.7, 1.0, 1.5]), "top_p": st.sampled_from([0.1, 0.9, 1.0]),
    "top_k": st.sampled_from([-1, 1, 5, 100_000]), "min_p": st.sampled_from([0.0, 0.05]),
    "seed": st.integers(0, 2**40), "stop": _WORDS | st.lists(_WORDS, max_size=3), "stop_token_ids": _IDS,
    "ignore_eos": st.booleans(), "n": st.integers(1, 3), "presence_penalty": st.sampled_from([-2.0, 0.0, 1.0]),
    "frequency_penalty": st.sampled_from([0.0, 0.5, 2.0]), "repetition_penalty": st.sampled_from([0.5, 1.0, 1.3]),
    "logit_bias": st.dictionaries(st.integers(0, 49151).map(str), st.sampled_from([-100, -1.5, 5, 100]),
                                  max_size=3),
}
_OPENAI = {**_SAMPLING, "min_tokens": st.integers(0, 3), "stream": st.booleans(), "cache_salt": _WORDS,
           "extra_key": _WORDS, "rid": _WORDS, "user": _WORDS, "model": st.just("SmolLM2-135M-Instruct")}
_MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                            "content": _WORDS}), min_size=1, max_size=3)
_VALID = {
    COMPLETIONS: st.fixed_dictionaries({"prompt": _WORDS | st.lists(_WORDS, min_size=1, max_size=3) | _IDS,
                                        "max_tokens": st.integers(1, 3)},
                                       optional={**_OPENAI, "logprobs": st.integers(0, 5), "echo": st.booleans()}),
    CHAT: st.fixed_dictionaries({"messages": _MESSAGES, "max_tokens": st.integers(1, 3)},
                                optional={**_OPENAI, "logprobs": st.booleans()}),
    "/generate": st.fixed_dictionaries(
        {"sampling_params": st.fixed_dictionaries({"max_new_tokens": st.integers(0, 3)},
                                                  optional={**_SAMPLING, "min_new_tokens": st.integers(0, 3)})},
        optional={"text": _WORDS, "return_logprob": st.booleans(), "top_logprobs_num": st.integers(0, 5),
                  "stream": st.booleans(), "logprob_start_len": st.integers(-1, 0), "rid": _WORDS}),
    "/tokenize": st.fixed_dictionaries({"prompt": _WORDS}, optional={"add_special_tokens": st.booleans()}),
    "/detokenize": st.fixed_dictionaries({"tokens": _IDS}),
    "/abort_request": st.fixed_dictionaries({"rid": _WORDS}, optional={"abort_all": st.booleans()}),
}
_FIELDS = sorted({*_OPENAI, "prompt", "messages", "text", "input_ids", "tokens", "sampling_params", "logprobs",
                  "top_logprobs", "echo", "return_logprob", "top_logprobs_num", "logprob_start_len", "abort_all",
                  "max_tokens", "max_completion_tokens", "min_new_tokens", "max_new_tokens"})


@st.composite
def _typed_body(draw: st.DrawFn, path: str) -> dict:
    """A valid body for `path`, with up to two fields (top level or in sampling_params) replaced by wild values."""
    body = draw(_VALID[path])
    if path == "/generate" and "text" not in body:
        body["input_ids"] = draw(_IDS | st.lists(_IDS, min_size=1, max_size=3))
    for _ in range(draw(st.integers(0, 2))):
        target = body["sampling_params"] if path == "/generate" and draw(st.booleans()) else body
        if isinstance(target, dict):
            target[draw(st.sampled_from(_FIELDS))] = draw(_WILD)
    return body


def _post(server: ServerHandle, path: str, body: object) -> httpx.Response:
    content = json.dumps(body).encode() if not isinstance(body, bytes) else body
    return server.post(path, content=content, headers={"content-type": "application/json"}, timeout=120)


@pytest.mark.long
@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_generated_bodies_never_get_a_5xx(server: ServerHandle, data: st.DataObject) -> None:
    path = data.draw(st.sampled_from(sorted(_VALID)))
    kind = data.draw(st.sampled_from(["typed", "typed", "untyped", "bytes"]))
    if kind == "typed":
        body: object = data.draw(_typed_body(path))
    elif kind == "untyped":
        body = data.draw(st.dictionaries(st.sampled_from(_FIELDS) | st.text(max_size=6), _WILD, max_size=5))
    else:
        body = data.draw(st.binary(max_size=64))
    if isinstance(body, dict) and kind == "untyped":
        body.setdefault("max_tokens", 2)  # NOTE: unset, it means the rest of the context: minutes per example
    r = _post(server, path, body)
    assert r.status_code < 500, (path, body, r.text)
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


# ----------------------------------------------------------------------- the served schema, fuzzed


def test_the_served_schema_documents_bodies_errors_and_metrics(server: ServerHandle) -> None:
    schema = server.get("/openapi.json").json()
    paths, components = schema["paths"], schema["components"]["schemas"]
    for path in ("/v1/completions", "/v1/chat/completions", "/generate", "/abort_request", "/tokenize",
                 "/detokenize"):
        operation = paths[path]["post"]
        body = operation["requestBody"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[-1]
        assert body in components and components[body]["properties"], path
        assert {"400", "401", "413"} <= set(operation["responses"]), path
        error = operation["responses"]["400"]["content"]["application/json"]["schema"]["$ref"]
        assert error.endswith("/ErrorResponse")
    assert "sampling_params" in components["GenerateRequest"]["properties"]
    assert components["NativeSamplingParams"]["additionalProperties"] is False
    assert "Retry-After" in paths["/v1/completions"]["post"]["responses"]["503"]["headers"]
    assert set(paths["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert "409" in paths["/flush_cache"]["post"]["responses"]
    r = server.get(CHAT)
    assert r.status_code == 405 and r.headers["allow"] == "POST", r.headers
    with server.client() as c:
        r = c.request("DELETE", "/flush_cache")
    assert r.status_code == 405 and set(r.headers["allow"].split(", ")) == {"GET", "POST"}
