"""Reasoning output on the OpenAI Responses API through the real server (`--reasoning-parser deepseek-r1`, the
embedded model, the same server as test_server_reasoning.py) and the real `openai` SDK: the think block as a
reasoning item before the message (the same split as chat's `reasoning_content`), the typed stream events
reassembling to it, `usage.output_tokens_details.reasoning_tokens`, `reasoning.effort`'s budget closing the block,
a replayed reasoning input item accepted (and dropped from the prompt), a `previous_response_id` chain that
finds the whole earlier turn cached, bad reasoning fields as 400s naming the field. Conservation after each
server test. Without a server: the tool-call parser reads the answer only, the stream's items in order, the
translation of reasoning items and `reasoning.effort`.

NOTE: the embedded model does not think by itself; under deepseek-r1 its output starts inside the think block,
so a budget (`thinking_budget`, or `reasoning.effort`) with `ignore_eos` is what makes a block and an answer.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
from openai import OpenAI
from server_harness import API_SERVER_ARGS, ServerHandle, check_idle_conservation, shared_server

from radixserve.entrypoints.chat_reasoning import ReasoningPlan
from radixserve.entrypoints.http_errors import ApiError
from radixserve.entrypoints.openai_protocol import ChatCompletionRequest
from radixserve.entrypoints.responses_protocol import (
    ResponsesRequest,
    chat_body,
    chat_messages,
    output_as_items,
    parse_input,
    responses_error,
)
from radixserve.entrypoints.responses_store import ResponseStore
from radixserve.entrypoints.responses_stream import ResponseEvents
from radixserve.entrypoints.serving_responses import _Turn
from radixserve.function_call.formats import FORMATS
from radixserve.function_call.legacy import plan_request_tools

ASK = "Think about the sky, then say what colour it is."
# NOTE: 5 tokens of the model's, then the closing tag's tokens (forced), then the answer
BUDGET = {"thinking_budget": 5, "ignore_eos": True}


@pytest.fixture(scope="module")
def server() -> ServerHandle:
    # NOTE: test_server_reasoning.py's arguments: the harness starts one server for both files
    return shared_server(*API_SERVER_ARGS, "--reasoning-parser", "deepseek-r1")


@pytest.fixture(scope="module")
def client(server: ServerHandle) -> OpenAI:
    return OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=180)


@pytest.fixture(scope="module")
def close_tokens(server: ServerHandle) -> int:
    return server.post("/tokenize", json={"prompt": "</think>", "add_special_tokens": False}).json()["count"]


@pytest.fixture(autouse=True)
def _conserved(request: pytest.FixtureRequest):
    yield
    if "server" in request.fixturenames:  # NOTE: every server test asks for it (client does through it)
        check_idle_conservation(request.getfixturevalue("server"))


def _create(client: OpenAI, **args: Any) -> Any:
    extra = {k: args.pop(k) for k in ("thinking_budget", "ignore_eos") if k in args}
    return client.responses.create(input=args.pop("input", ASK), temperature=0, extra_body=extra or None, **args)


@pytest.mark.slow
def test_the_think_block_is_a_reasoning_item_before_the_message(server: ServerHandle, client: OpenAI,
                                                                 close_tokens: int) -> None:
    r = _create(client, max_output_tokens=24, **BUDGET)
    assert [o.type for o in r.output] == ["reasoning", "message"], r.output
    item, message = r.output
    assert item.id.startswith("rs_") and item.summary == [] and item.status == "completed", item
    assert len(item.content) == 1 and item.content[0].type == "reasoning_text" and item.content[0].text, item
    assert r.output_text and "</think>" not in r.output_text and "</think>" not in item.content[0].text
    assert r.usage.output_tokens_details.reasoning_tokens == 5 + close_tokens, r.usage
    assert r.usage.output_tokens == 24 and r.status == "incomplete"
    # the same split as chat's reasoning_content / content for the same request
    chat = server.post("/v1/chat/completions", timeout=180, json={
        "messages": [{"role": "user", "content": ASK}], "temperature": 0, "max_tokens": 24, **BUDGET}).json()
    assert chat["choices"][0]["message"]["reasoning_content"] == item.content[0].text
    assert chat["choices"][0]["message"]["content"] == r.output_text
    assert chat["usage"]["completion_tokens_details"]["reasoning_tokens"] == 5 + close_tokens
    got = client.responses.retrieve(r.id)
    assert got.output[0].content[0].text == item.content[0].text and got.usage == r.usage


@pytest.mark.slow
def test_the_streamed_events_reassemble_to_the_whole_answer(client: OpenAI, close_tokens: int) -> None:
    whole = _create(client, max_output_tokens=24, store=False, **BUDGET)
    events = list(_create(client, max_output_tokens=24, store=False, stream=True, **BUDGET))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"], kinds
    assert events[2].item.type == "reasoning" and events[2].output_index == 0
    done = kinds.index("response.reasoning_text.done")
    assert set(kinds[3:done]) == {"response.reasoning_text.delta"}, kinds
    assert kinds[done + 1:done + 4] == ["response.output_item.done", "response.output_item.added",
                                        "response.content_part.added"], kinds
    assert events[done + 1].item.type == "reasoning" and events[done + 1].item.status == "completed"
    assert events[done + 2].item.type == "message" and events[done + 2].output_index == 1
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert thought == events[done].text == events[done + 1].item.content[0].text == whole.output[0].content[0].text
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text and text
    final = events[-1].response
    assert events[-1].type == "response.incomplete" and [o.type for o in final.output] == ["reasoning", "message"]
    assert final.usage.output_tokens_details.reasoning_tokens == 5 + close_tokens
    assert final.output[0].content[0].text == thought and final.output_text == text


@pytest.mark.long  # NOTE: minutes on 2 loaded cores; the long run (CI) keeps it
@pytest.mark.slow
def test_reasoning_effort_is_chats_budget(client: OpenAI, close_tokens: int) -> None:
    # low: 256 tokens; the model's 256, the forced closing tag, then the answer
    r = _create(client, max_output_tokens=256 + close_tokens + 4, reasoning={"effort": "low"}, ignore_eos=True,
                store=False)
    assert [o.type for o in r.output] == ["reasoning", "message"], r.output
    assert r.usage.output_tokens_details.reasoning_tokens == 256 + close_tokens, r.usage
    assert r.output_text and r.reasoning.effort == "low"
    # a budget the output never reaches forces nothing: all of it is reasoning, the message is empty
    short = _create(client, max_output_tokens=12, reasoning={"effort": "high"}, ignore_eos=True, store=False)
    assert [o.type for o in short.output] == ["reasoning", "message"] and short.output_text == ""
    assert short.output[0].status == "incomplete" and short.status == "incomplete"
    assert short.usage.output_tokens_details.reasoning_tokens == 12


@pytest.mark.slow
def test_a_replayed_reasoning_item_is_accepted_and_not_rendered(client: OpenAI) -> None:
    first = _create(client, max_output_tokens=16, **BUDGET)
    answer = {"role": "assistant", "content": first.output_text}
    turn = [{"role": "user", "content": ASK}, answer, {"role": "user", "content": "And at night?"}]
    replayed = [turn[0], first.output[0].model_dump(exclude_none=True), *turn[1:]]
    plain = _create(client, input=turn, max_output_tokens=4, store=False)
    again = _create(client, input=replayed, max_output_tokens=4)
    # NOTE: dropped from the prompt as chat drops reasoning_content: the same prompt, the same answer
    assert again.usage.input_tokens == plain.usage.input_tokens
    assert again.output_text == plain.output_text
    items = client.responses.input_items.list(again.id, order="asc").data
    assert [i.type for i in items] == ["message", "reasoning", "message", "message"]
    assert items[1].content[0].text == first.output[0].content[0].text and items[1].id.startswith("rs_")


@pytest.mark.slow
def test_a_chain_through_previous_response_id_finds_the_whole_turn_cached(client: OpenAI) -> None:
    first = _create(client, max_output_tokens=16, **BUDGET)
    assert first.output[0].type == "reasoning"
    second = _create(client, previous_response_id=first.id, input="And at night?", max_output_tokens=4)
    # NOTE: the prompt continues the first turn's ids as generated (think block included): all but the last cached
    seen = first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= seen - 1, (first.usage, second.usage)
    assert second.usage.input_tokens > seen


@pytest.mark.slow
@pytest.mark.parametrize(("body", "param"), [
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"reasoning": {"effort": 3}}, "reasoning.effort"),
    ({"reasoning": "low"}, "reasoning"),
    ({"reasoning": {"effort": "low"}, "thinking_budget": 5}, "thinking_budget"),
    ({"input": [{"type": "reasoning", "summary": "x"}]}, "input.0.summary"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"),  # NOTE: nothing left to render
    ({"input": [{"type": "reasoning", "summary": [], "content": [{"type": "text", "text": "x"}]}]},
     "input.0.content.0.type"),
])
def test_bad_reasoning_fields_are_400s_naming_the_field(server: ServerHandle, body: dict, param: str) -> None:
    r = server.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 2, **body})
    assert r.status_code == 400, r.text[:400]
    assert r.json()["error"]["param"] == param, r.text[:400]


# ---------------------------------------------------------------------------------------- without a server


class _CharTokenizer:
    """One token per character (what reasoning_tokens needs: decode of a prefix)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(map(chr, ids))


def _whole(text: str, tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """`text` as the non-streamed answer of a deepseek-r1 server with the hermes tool format."""
    req = ResponsesRequest.model_validate({"input": ASK, "tools": tools, "store": False})
    chat_req = ChatCompletionRequest.model_validate(chat_body(req, chat_messages(parse_input(req.input), None)))
    plan = plan_request_tools(FORMATS["hermes"], chat_req)
    serving = SimpleNamespace(chat=SimpleNamespace(model_name="m"), tm=SimpleNamespace(tokenizer=_CharTokenizer()),
                              store=ResponseStore(4, 1 << 20))
    turn = _Turn(serving, req, None, [], [], plan, "", [], ReasoningPlan("deepseek-r1", False))
    return turn.whole(text, "stop", [ord(c) for c in text], len(text), 0)


def test_the_tool_call_parser_reads_the_answer_only() -> None:
    tool = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}
    call = FORMATS["hermes"].render_calls([("get_weather", '{"city": "Paris"}')])
    inside = _whole(f"maybe {call}</think>It is blue.", [tool])
    assert [o["type"] for o in inside["output"]] == ["reasoning", "message"], inside["output"]
    assert inside["output"][0]["content"][0]["text"] == f"maybe {call}"
    assert inside["usage"]["output_tokens_details"]["reasoning_tokens"] == len(f"maybe {call}</think>")
    after = _whole(f"the weather</think>{call}", [tool])
    assert [o["type"] for o in after["output"]] == ["reasoning", "function_call"], after["output"]
    assert json.loads(after["output"][1]["arguments"]) == {"city": "Paris"}
    assert after["output"][0]["status"] == "completed"
    # a block never closed: all reasoning, an empty message
    open_block = _whole("still thinking")
    assert [o["type"] for o in open_block["output"]] == ["reasoning", "message"]
    assert open_block["output"][1]["content"][0]["text"] == ""
    assert open_block["usage"]["output_tokens_details"]["reasoning_tokens"] == len("still thinking")


def test_stream_events_put_the_reasoning_item_first_and_close_it_before_the_answer() -> None:
    events = ResponseEvents({"id": "resp_x"})
    out = events.start() + events.reasoning("a") + events.reasoning("b") + events.text("c")
    out += events.close()
    kinds = [e["type"] for e in out]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.reasoning_text.delta", "response.reasoning_text.delta", "response.reasoning_text.done",
                     "response.output_item.done", "response.output_item.added", "response.content_part.added",
                     "response.output_text.delta", "response.output_text.done", "response.content_part.done",
                     "response.output_item.done"], kinds
    assert out[2]["item"]["content"] == [] and out[5]["text"] == "ab" and out[6]["item"]["status"] == "completed"
    assert [o["type"] for o in events.output] == ["reasoning", "message"]
    # a stream cut inside the block: the reasoning item incomplete, then an empty message (as the whole answer)
    cut = ResponseEvents({"id": "resp_y"})
    cut.start()
    cut.reasoning("a")
    cut.status = "incomplete"
    kinds = [e["type"] for e in cut.close()]
    assert kinds[:2] == ["response.reasoning_text.done", "response.output_item.done"], kinds
    assert [o["type"] for o in cut.output] == ["reasoning", "message"] and cut.output[0]["status"] == "incomplete"


def test_reasoning_items_translate_and_reasoning_effort_is_chats() -> None:
    items = parse_input([{"role": "user", "content": "Hi"},
                         {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "s"}],
                          "content": [{"type": "reasoning_text", "text": "t"}], "encrypted_content": "zz"},
                         {"role": "assistant", "content": "Hello"}])
    assert items[1] == {"type": "reasoning", "content": "t"}
    assert [m["role"] for m in chat_messages(items, None)] == ["user", "assistant"]  # NOTE: not rendered
    output = [{"type": "reasoning", "id": "rs_2", "summary": [], "status": "completed",
               "content": [{"type": "reasoning_text", "text": "why"}]}]
    assert output_as_items(output) == [{"type": "reasoning", "content": "why"}]
    req = ResponsesRequest.model_validate({"input": "x", "reasoning": {"effort": "medium", "summary": "auto"}})
    assert chat_body(req, [])["reasoning_effort"] == "medium"
    e = responses_error(ApiError(400, "'reasoning_effort' must be one of low, medium, high, got 'x'",
                                 param="reasoning_effort"))
    assert e.param == "reasoning.effort" and "'reasoning.effort'" in e.message
