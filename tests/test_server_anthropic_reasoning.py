"""Thinking blocks on Anthropic's Messages API through the real server (`--reasoning-parser deepseek-r1`, the same
server as test_server_reasoning.py) with the real `anthropic` SDK: a budget-closed think block is a thinking
block, then the text block (the same split the chat API gives); a stream reassembles to it through
`thinking_delta` events; a budget is what closes the block; `disabled` keeps the raw text; replayed thinking
blocks in the input are accepted and dropped; bad `thinking` fields are 400s naming the field.
Conservation after each test."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import pytest
from server_harness import API_SERVER_ARGS, ServerHandle, check_idle_conservation, shared_server

pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "Think about the sky, then say what colour it is."}]
GREEDY = {"temperature": 0}
# NOTE: the embedded model does not think by itself: under deepseek-r1 its output starts inside the block, and
# the budget forces `</think>` after 5 tokens; the model answers after it
BUDGET = {"type": "enabled", "budget_tokens": 5}


@pytest.fixture(scope="module")
def server() -> ServerHandle:
    return shared_server(*API_SERVER_ARGS, "--reasoning-parser", "deepseek-r1")


@pytest.fixture(autouse=True)
def _conserved(server: ServerHandle):
    yield
    check_idle_conservation(server)


@pytest.fixture(scope="module")
def client(server: ServerHandle) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=180)


@pytest.fixture(scope="module")
def model(server: ServerHandle) -> str:
    return server.get("/v1/models").json()["data"][0]["id"]


def _create(client: anthropic.Anthropic, model: str, **kwargs: Any) -> anthropic.types.Message:
    kwargs.setdefault("messages", ASK)
    return client.messages.create(model=model, extra_body=GREEDY, **kwargs)


def test_a_budget_closed_think_block_is_a_thinking_block_then_text(client: anthropic.Anthropic, model: str,
                                                                   server: ServerHandle) -> None:
    m = _create(client, model, max_tokens=24, thinking=BUDGET)
    assert [b.type for b in m.content] == ["thinking", "text"], m
    thinking, text = m.content
    assert thinking.thinking.strip() and thinking.signature == "", thinking
    assert text.text.strip() and "<" not in text.text and "</think>" not in thinking.thinking, m
    # the same split as the chat API's for the same prompt and budget
    chat = server.post("/v1/chat/completions", timeout=180, json={
        "messages": ASK, "max_tokens": 24, "temperature": 0, "thinking_budget": 5}).json()
    message = chat["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (thinking.thinking, text.text), (chat, m)
    assert m.usage.output_tokens == chat["usage"]["completion_tokens"]
    close = server.post("/tokenize", json={"prompt": "</think>", "add_special_tokens": False}).json()["count"]
    assert chat["usage"]["completion_tokens_details"]["reasoning_tokens"] == 5 + close  # NOTE: the budget closed it


def test_a_stream_reassembles_through_thinking_deltas(client: anthropic.Anthropic, model: str) -> None:
    whole = _create(client, model, max_tokens=24, thinking=BUDGET)
    with client.messages.stream(model=model, max_tokens=24, messages=ASK, thinking=BUDGET,
                                extra_body=GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    wire = [(e.type, getattr(e, "index", None), getattr(getattr(e, "delta", None), "type", None))
            for e in events if e.type.startswith("content_block")]
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["thinking", "text"], wire
    # NOTE: Anthropic's order: the thinking block whole (its deltas, its signature), then the text block
    thinking_part = wire[:wire.index(("content_block_stop", 0, None)) + 1]
    assert thinking_part[0] == ("content_block_start", 0, None)
    assert {d for _, i, d in thinking_part[1:-1]} == {"thinking_delta", "signature_delta"}
    assert thinking_part[-2][2] == "signature_delta"
    assert all(i == 1 for _, i, _ in wire[len(thinking_part):]), wire
    joined = "".join(e.delta.thinking for e in events if e.type == "content_block_delta"
                     and e.delta.type == "thinking_delta")
    assert joined == whole.content[0].thinking


def test_the_budget_closes_the_block_and_disabled_keeps_the_raw_text(client: anthropic.Anthropic,
                                                                     model: str) -> None:
    # without a budget the block never closes within max_tokens: all of the output is thinking
    free = _create(client, model, max_tokens=12)
    assert [b.type for b in free.content] == ["thinking"] and free.stop_reason == "max_tokens", free
    closed = _create(client, model, max_tokens=12, thinking=BUDGET)
    assert [b.type for b in closed.content] == ["thinking", "text"], closed
    # greedy: the budgeted block is the start of the free one, cut where the budget forced `</think>`
    assert free.content[0].thinking.startswith(closed.content[0].thinking.rstrip())
    assert len(closed.content[0].thinking) < len(free.content[0].thinking)
    adaptive = _create(client, model, max_tokens=12, thinking={"type": "adaptive"})
    assert [b.model_dump() for b in adaptive.content] == [b.model_dump() for b in free.content]
    raw = _create(client, model, max_tokens=12, thinking={"type": "disabled"})
    assert [b.type for b in raw.content] == ["text"] and raw.content[0].text == free.content[0].thinking, raw


REPLAYED = [*ASK, {"role": "assistant", "content": [
    {"type": "thinking", "thinking": "The sky scatters blue light.", "signature": ""},
    {"type": "redacted_thinking", "data": "opaque"},
    {"type": "text", "text": "It is blue."}]}, {"role": "user", "content": "And at night?"}]


def test_replayed_thinking_blocks_are_accepted_and_dropped(client: anthropic.Anthropic, model: str) -> None:
    m = _create(client, model, max_tokens=24, messages=REPLAYED, thinking=BUDGET)
    assert [b.type for b in m.content][0] == "thinking", m
    plain = [*ASK, {"role": "assistant", "content": "It is blue."}, REPLAYED[-1]]
    count = client.messages.count_tokens(model=model, messages=REPLAYED, thinking=BUDGET).input_tokens
    assert count == client.messages.count_tokens(model=model, messages=plain).input_tokens
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == count


BAD = [
    ({"thinking": {"type": "enabled", "budget_tokens": 0}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "enabled", "budget_tokens": 8}}, "thinking.budget_tokens"),  # not below max_tokens
    ({"thinking": {"type": "enabled", "budget_tokens": "5"}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "sometimes"}}, "thinking.type"),
    ({"thinking": {"type": "enabled", "budget_tokens": 5, "display": "omitted"}}, "thinking.display"),
    ({"thinking": {"type": "disabled", "budget_tokens": 5}}, "thinking.budget_tokens"),
    ({"thinking": True}, "thinking"),
    ({"messages": [{"role": "user", "content": [{"type": "thinking", "thinking": "x", "signature": ""}]}]},
     "messages.0.content.0.type"),
    ({"messages": [*ASK, {"role": "assistant", "content": [{"type": "thinking", "thinking": 1}]},
                   {"role": "user", "content": "hi"}]}, "messages.1.content.0.thinking"),
]


@pytest.mark.parametrize(("change", "field"), BAD, ids=[f"{field}-{i}" for i, (_, field) in enumerate(BAD)])
def test_bad_thinking_is_a_400_naming_the_field(server: ServerHandle, model: str, change: dict, field: str) -> None:
    body = {"model": model, "max_tokens": 8, "messages": ASK} | change
    r = httpx.post(server.base_url + "/v1/messages", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error", error
    assert f"'{field}'" in error["error"]["message"], error


def test_tool_calls_are_read_from_the_answer_only_whole_and_streamed() -> None:
    """No server: the Messages answer of a text with a call inside the think block (thinking) and one after it
    (the answer's tool_use), built whole and as stream events (qwen3 style, hermes calls, one char a token)."""
    from radixserve.entrypoints.chat_reasoning import ReasoningPlan, StreamedReasoning
    from radixserve.entrypoints.serving_anthropic import AnthropicServing
    from radixserve.entrypoints.serving_common import ChoiceResult
    from radixserve.frontend.frontend_io import GenerateOutput
    from radixserve.function_call.chat_tools import plan_tools
    from radixserve.function_call.formats import FORMATS

    class Chars:
        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            return "".join(map(chr, ids))

    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}
    tools = plan_tools(FORMATS["hermes"], [tool], "auto", True)
    inner = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    text = f"<think>maybe {inner}</think>\n\n" + '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>'
    plan = ReasoningPlan("qwen3", False)
    serving = object.__new__(AnthropicServing)
    serving.model_name = "m"
    result = ChoiceResult(text=text, finish={"type": "stop"}, prompt_tokens=3, completion_tokens=len(text))
    body = json.loads(serving._chat_response("r", [result], None, False, tools, plan).body)
    assert [b["type"] for b in body["content"]] == ["thinking", "tool_use"], body
    assert body["content"][0] == {"type": "thinking", "thinking": f"maybe {inner}", "signature": ""}
    assert body["content"][1]["input"] == {"a": 2} and body["stop_reason"] == "tool_use"
    render = serving._chat_renderer("r", None, False, tools, StreamedReasoning(plan, Chars()))
    events = []
    for i, ch in enumerate(text):
        last = i == len(text) - 1
        events += render(0, GenerateOutput(rid="r", text_delta=ch, token_ids=[ord(ch)],
                                           finish={"type": "stop"} if last else None, prompt_tokens=3,
                                           completion_tokens=i + 1, cached_tokens=0))
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == ["thinking", "tool_use"], events
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == f"maybe {inner}"
    assert json.loads("".join(d.get("partial_json", "") for d in deltas)) == {"a": 2}
    assert events[-2]["delta"]["stop_reason"] == "tool_use" and events[-1]["type"] == "message_stop"
