"""Reasoning output on the OpenAI Responses API through the real server (`--reasoning-parser deepseek-r1`, the
embedded model, the same server as test_server_reasoning.py) and the real `openai` SDK: the think block as a
reasoning item before the message (the same split as chat's `reasoning_content`), the typed stream events
reassembling to it, `usage.output_tokens_details.reasoning_tokens`, `reasoning.effort`'s budget closing the block,
a replayed reasoning input item accepted (and dropped from the prompt), a `previous_response_id` chain that
finds the whole earlier turn cached, bad reasoning fields as 400s naming the field. Conservation after each
test.

NOTE: the embedded model does not think by itself; under deepseek-r1 its output starts inside the think block,
so a budget (`thinking_budget`, or `reasoning.effort`) with `ignore_eos` is what makes a block and an answer.
"""

from __future__ import annotations

from typing import Any

import pytest
from openai import OpenAI
from server_harness import API_SERVER_ARGS, ServerHandle, check_idle_conservation, shared_server

pytestmark = pytest.mark.slow

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
def _conserved(server: ServerHandle):
    yield
    check_idle_conservation(server)


def _create(client: OpenAI, **args: Any) -> Any:
    extra = {k: args.pop(k) for k in ("thinking_budget", "ignore_eos") if k in args}
    return client.responses.create(input=args.pop("input", ASK), temperature=0, extra_body=extra or None, **args)


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


def test_a_chain_through_previous_response_id_finds_the_whole_turn_cached(client: OpenAI) -> None:
    first = _create(client, max_output_tokens=16, **BUDGET)
    assert first.output[0].type == "reasoning"
    second = _create(client, previous_response_id=first.id, input="And at night?", max_output_tokens=4)
    # NOTE: the prompt continues the first turn's ids as generated (think block included): all but the last cached
    seen = first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= seen - 1, (first.usage, second.usage)
    assert second.usage.input_tokens > seen


@pytest.mark.parametrize(("body", "param"), [
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"reasoning": {"effort": 3}}, "reasoning.effort"),
    ({"reasoning": "low"}, "reasoning"),
    ({"reasoning": {"effort": "low"}, "thinking_budget": 5}, "thinking_budget"),
    ({"input": [{"type": "reasoning", "summary": "x"}]}, "input.0.summary"),
    ({"input": [{"type": "reasoning", "summary": [], "content": [{"type": "text", "text": "x"}]}]},
     "input.0.content.0.type"),
])
def test_bad_reasoning_fields_are_400s_naming_the_field(server: ServerHandle, body: dict, param: str) -> None:
    r = server.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 2, **body})
    assert r.status_code == 400, r.text[:400]
    assert r.json()["error"]["param"] == param, r.text[:400]
