"""Every bad input gets an OpenAI-shaped error with the right status, and the server keeps serving."""

from __future__ import annotations

import re

import httpx
import openai
import pytest
from server_harness import API_SERVER_ARGS, ServerHandle, check_idle_conservation, shared_server

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server() -> ServerHandle:
    return shared_server(*API_SERVER_ARGS)


@pytest.fixture(autouse=True)
def _still_serving_after_each_test(server: ServerHandle):
    yield
    ok = server.post(COMPLETIONS, json={"prompt": "Hello", "max_tokens": 1})
    assert ok.status_code == 200, ok.text
    check_idle_conservation(server)


def _error(r: httpx.Response, status: int, code: str | None = None, param: str | None = None) -> str:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if code is not None:
        assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error
    return error["message"]


def _raw(server: ServerHandle, path: str, content: bytes) -> httpx.Response:
    return server.post(path, content=content, headers={"content-type": "application/json"})


def test_malformed_json(server: ServerHandle) -> None:
    message = _error(_raw(server, CHAT, b'{"messages": [{"role": "user", "content": "Hi"}'), 400, "invalid_json")
    assert "could not parse" in message
    _error(_raw(server, CHAT, b"[1, 2]"), 400, "invalid_json")
    _error(_raw(server, CHAT, b""), 400, "invalid_json")


def test_wrong_types(server: ServerHandle) -> None:
    _error(server.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": "10"}), 400, "invalid_type", "max_tokens")
    _error(server.post(CHAT, json={"messages": "Hi"}), 400, "invalid_type", "messages")
    _error(server.post(COMPLETIONS, json={"prompt": "Hi", "temperature": "hot"}), 400, param="temperature")
    _error(server.post(COMPLETIONS, json={"prompt": ["a", 1]}), 400, param="prompt")
    _error(server.post(COMPLETIONS, json={"prompt": "Hi", "stream": "yes"}), 400, param="stream")
    _error(server.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": "5"}}), 400,
           param="sampling_params.max_new_tokens")


def test_negative_max_tokens(server: ServerHandle) -> None:
    _error(server.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": -1}), 400, param="max_tokens")
    _error(server.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 0}), 400, param="max_tokens")


def test_huge_max_tokens_is_context_length_exceeded_with_the_numbers(server: ServerHandle) -> None:
    message = _error(server.post(CHAT, json={"messages": MESSAGES, "max_tokens": 10**12}), 400,
                     "context_length_exceeded", "max_tokens")
    assert "maximum context length is 2048 tokens" in message
    assert re.search(r"requested \d+ tokens \(\d+ in the messages, 1000000000000 in the completion\)", message)


def test_n_out_of_range(server: ServerHandle) -> None:
    _error(server.post(COMPLETIONS, json={"prompt": "Hi", "n": 0}), 400, param="n")
    _error(server.post(COMPLETIONS, json={"prompt": "Hi", "n": 17}), 400, param="n")


def test_unknown_model(server: ServerHandle) -> None:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-17", messages=MESSAGES, max_tokens=1)
    assert e.value.status_code == 404 and e.value.code == "model_not_found"
    assert "gpt-17" in e.value.message


def test_empty_prompt(server: ServerHandle) -> None:
    _error(server.post(COMPLETIONS, json={"prompt": ""}), 400, "empty_prompt", "prompt")
    _error(server.post(COMPLETIONS, json={"prompt": []}), 400, "empty_prompt", "prompt")
    _error(server.post(CHAT, json={"messages": []}), 400, "empty_prompt", "messages")
    _error(server.post("/generate", json={"input_ids": []}), 400, "empty_prompt", "input_ids")


def test_token_ids_outside_the_vocabulary(server: ServerHandle) -> None:
    vocab = server.info()["model"]["vocab_size"]
    message = _error(server.post(COMPLETIONS, json={"prompt": [1, vocab]}), 400, "invalid_token_id", "prompt")
    assert str(vocab) in message
    _error(server.post(COMPLETIONS, json={"prompt": [1, -3]}), 400, "invalid_token_id", "prompt")
    _error(server.post("/generate", json={"input_ids": [10**9]}), 400, "invalid_token_id", "input_ids")


def test_prompt_over_the_context(server: ServerHandle) -> None:
    message = _error(server.post(COMPLETIONS, json={"prompt": [7] * 2100, "max_tokens": 1}), 400,
                     "context_length_exceeded", "prompt")
    assert "maximum context length is 2048 tokens" in message and "(2100 in the prompt, 1 in the completion)" in message


def test_prompt_over_the_pool(server: ServerHandle) -> None:
    # NOTE: 1100 tokens fit the 2048 context but not the 1024-token KV pool: rejected, never queued.
    message = _error(server.post(COMPLETIONS, json={"prompt": [7] * 1100, "max_tokens": 1}), 400,
                     "kv_pool_exceeded", "prompt")
    assert "KV cache pool holds 1024 tokens" in message and "1100 in the prompt" in message


def test_invalid_utf8(server: ServerHandle) -> None:
    body = b'{"prompt": "caf\xc3\x28 au lait", "max_tokens": 1}'
    assert "not valid UTF-8" in _error(_raw(server, COMPLETIONS, body), 400, "invalid_utf8")
    # A lone surrogate escape is valid JSON but not valid text.
    _error(_raw(server, COMPLETIONS, b'{"prompt": "x\\ud800y", "max_tokens": 1}'), 400, "invalid_utf8", "prompt")


def test_body_over_the_size_limit(server: ServerHandle) -> None:
    big = b'{"prompt": "' + b"a" * (4 * 1024 * 1024) + b'"}'
    _error(_raw(server, COMPLETIONS, big), 413, "request_too_large")


def test_sampling_values_out_of_range(server: ServerHandle) -> None:
    _error(server.post(COMPLETIONS, json={"prompt": "Hi", "temperature": -0.5}), 400, param="temperature")
    _error(server.post(COMPLETIONS, json={"prompt": "Hi", "top_p": 0}), 400, param="top_p")
    _error(server.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 2, "beam": 3}}), 400,
           param="sampling_params")


def test_unsupported_parameters_are_refused_clearly(server: ServerHandle) -> None:
    message = _error(server.post(CHAT, json={"messages": MESSAGES, "echo": True}), 400, "unsupported_parameter", "echo")
    assert "/v1/completions only" in message
    _error(server.post(COMPLETIONS, json={"prompt": "Hi", "suffix": "!"}), 400, "unsupported_parameter", "suffix")
    _error(server.post(COMPLETIONS, json={"prompt": "Hi", "best_of": 2}), 400, "unsupported_parameter", "best_of")
    _error(server.post(COMPLETIONS, json={"prompt": "Hi", "presence_penalty": 2.5}), 400, None, "presence_penalty")
    _error(server.post(COMPLETIONS, json={"prompt": "Hi", "logit_bias": {"x": 1}}), 400, "invalid_value", "logit_bias")
    _error(server.post(COMPLETIONS, json={"prompt": "Hi", "logit_bias": {"5": 101}}), 400, None, "logit_bias")
    _error(server.post(COMPLETIONS, json={"prompt": "Hi", "min_tokens": -1}), 400, None, "min_tokens")


def test_logprobs_out_of_range_or_without_logprobs(server: ServerHandle) -> None:
    message = _error(server.post(CHAT, json={"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}), 400,
                     "invalid_value", "top_logprobs")
    assert "between 0 and 20, got 21" in message
    _error(server.post(CHAT, json={"messages": MESSAGES, "logprobs": True, "top_logprobs": -1}), 400,
           "invalid_value", "top_logprobs")
    _error(server.post(CHAT, json={"messages": MESSAGES, "top_logprobs": 2}), 400, "invalid_value", "top_logprobs")
    _error(server.post(CHAT, json={"messages": MESSAGES, "logprobs": False, "top_logprobs": 0}), 400,
           "invalid_value", "top_logprobs")
    _error(server.post(CHAT, json={"messages": MESSAGES, "logprobs": 1}), 400, "invalid_type", "logprobs")
    _error(server.post(COMPLETIONS, json={"prompt": "Hi", "logprobs": 21}), 400, "invalid_value", "logprobs")
    _error(server.post(COMPLETIONS, json={"prompt": "Hi", "logprobs": True}), 400, "invalid_type", "logprobs")
    _error(server.post("/generate", json={"text": "Hi", "return_logprob": True, "top_logprobs_num": 21}), 400,
           "invalid_value", "top_logprobs_num")
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=MESSAGES, max_tokens=1,
                                       logprobs=True, top_logprobs=21)
    assert e.value.param == "top_logprobs"


def test_unknown_route_and_method(server: ServerHandle) -> None:
    _error(server.post("/v1/no_such_route", json={}), 404)
    _error(server.get(CHAT), 405)
