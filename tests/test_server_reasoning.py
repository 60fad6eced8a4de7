"""Reasoning output through the real server (`--reasoning-parser deepseek-r1`, the embedded model): a think block
forced by a grammar comes back as `reasoning_content` apart from `content`, streamed deltas reassemble to the
non-streamed message, `separate_reasoning: false` keeps the raw text; a reasoning budget (`thinking_budget`,
`reasoning_effort`) closes the block after that many tokens; bad budget fields are 400s naming the field.
Conservation after each test."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import pytest
from server_harness import API_SERVER_ARGS, ServerHandle, check_idle_conservation, shared_server

pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "Think about the sky, then say what colour it is."}]
# NOTE: the embedded model does not think by itself: the grammar writes a think block, then a short answer
THINK = r"<think>[a-z ]{1,40}</think>[A-Za-z ]{1,30}"
FORCED = {"type": "structural_tag", "format": {"type": "regex", "pattern": THINK}}


@pytest.fixture(scope="module")
def server() -> ServerHandle:
    return shared_server(*API_SERVER_ARGS, "--reasoning-parser", "deepseek-r1")


@pytest.fixture(autouse=True)
def _conserved(server: ServerHandle):
    yield
    check_idle_conservation(server)


def _chat(server: ServerHandle, **body: Any) -> dict[str, Any]:
    r = server.post("/v1/chat/completions", json={"messages": ASK, "temperature": 0, **body}, timeout=180)
    assert r.status_code == 200, r.text[:500]
    return r.json()


def _stream(server: ServerHandle, **body: Any) -> tuple[str, str, list[dict[str, Any]], dict[str, Any]]:
    """The stream's joined reasoning and content, its deltas, and its usage chunk."""
    payload = {"messages": ASK, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, **body}
    with server.client(timeout=180) as c, c.stream("POST", "/v1/chat/completions", json=payload) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    usage = events[-1]["usage"]
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    return reasoning, "".join(d.get("content") or "" for d in deltas), deltas, usage


def test_a_forced_think_block_is_split_and_the_stream_matches(server: ServerHandle) -> None:
    whole = _chat(server, max_tokens=120, response_format=FORCED)
    message = whole["choices"][0]["message"]
    assert whole["choices"][0]["finish_reason"] == "stop", whole
    assert re.fullmatch(r"[a-z ]{1,40}", message["reasoning_content"]), message
    assert re.fullmatch(r"[A-Za-z ]{1,30}", message["content"]) and "<" not in message["content"], message
    usage = whole["usage"]
    spent = usage["completion_tokens_details"]["reasoning_tokens"]
    assert 0 < spent < usage["completion_tokens"], usage
    raw = _chat(server, max_tokens=120, response_format=FORCED, separate_reasoning=False)
    assert "reasoning_content" not in raw["choices"][0]["message"] and "completion_tokens_details" not in raw["usage"]
    text = raw["choices"][0]["message"]["content"]
    assert text == f"<think>{message['reasoning_content']}</think>{text.split('</think>')[1]}", text
    assert text.split("</think>")[1].lstrip() == message["content"]
    reasoning, content, deltas, stream_usage = _stream(server, max_tokens=120, response_format=FORCED)
    assert (reasoning, content) == (message["reasoning_content"], message["content"])
    assert stream_usage["completion_tokens_details"]["reasoning_tokens"] == spent
    assert any(d.get("reasoning_content") for d in deltas) and any(d.get("content") for d in deltas)
    assert not any(d.get("reasoning_content") and d.get("content") for d in deltas[:3])  # NOTE: block first
    _, _, raw_deltas, _ = _stream(server, max_tokens=120, response_format=FORCED, separate_reasoning=False)
    assert all("reasoning_content" not in d for d in raw_deltas)


@pytest.mark.long  # NOTE: minutes on 2 loaded cores; the long run (CI) keeps it
def test_a_thinking_budget_closes_the_block_after_that_many_tokens(server: ServerHandle) -> None:
    close = server.post("/tokenize", json={"prompt": "</think>", "add_special_tokens": False}).json()["count"]
    body = {"max_tokens": 24, "ignore_eos": True, "thinking_budget": 5}
    whole = _chat(server, **body)
    message, usage = whole["choices"][0]["message"], whole["usage"]
    assert message["reasoning_content"] and message["content"], message
    # NOTE: 5 tokens of the model's, then the closing tag's tokens, forced
    assert usage["completion_tokens_details"]["reasoning_tokens"] == 5 + close, usage
    assert usage["completion_tokens"] == 24
    raw = _chat(server, **body, separate_reasoning=False)["choices"][0]["message"]["content"]
    assert raw.count("</think>") == 1 and raw.split("</think>")[0] == message["reasoning_content"], raw
    assert raw.split("</think>")[1].lstrip() == message["content"]
    reasoning, content, _, stream_usage = _stream(server, **body)
    assert (reasoning, content) == (message["reasoning_content"], message["content"])
    assert stream_usage["completion_tokens_details"]["reasoning_tokens"] == 5 + close
    # a budget the output never reaches forces nothing: all of it is reasoning
    low = _chat(server, max_tokens=12, ignore_eos=True, reasoning_effort="low")
    assert low["choices"][0]["message"]["content"] == "" and low["choices"][0]["message"]["reasoning_content"]
    assert low["usage"]["completion_tokens_details"]["reasoning_tokens"] == 12


def test_a_json_answer_is_not_read_as_reasoning(server: ServerHandle) -> None:
    """Under deepseek-r1 an output without `</think>` is all reasoning, but a JSON grammar writes the output
    from its first token: such a request is not split."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    message = _chat(server, max_tokens=20, response_format=fmt)["choices"][0]["message"]
    assert "reasoning_content" not in message and json.loads(message["content"]) in ({"ok": True}, {"ok": False})


@pytest.mark.parametrize(("fields", "param"), [
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"thinking_budget": 0}, "thinking_budget"),
    ({"thinking_budget": 5, "reasoning_effort": "low"}, "thinking_budget"),
    ({"thinking_budget": "5"}, "thinking_budget"),
])
def test_bad_budget_fields_are_400s_naming_the_field(server: ServerHandle, fields: dict, param: str) -> None:
    r = httpx.post(server.base_url + "/v1/chat/completions", timeout=60,
                   json={"messages": ASK, "max_tokens": 4, **fields})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
