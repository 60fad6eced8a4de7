"""The OpenAI Responses API through the real server and the real `openai` SDK: text, `text.format` json_schema,
forced function tools, typed stream events (in order, reassembling to the whole answer), a two-turn tool loop
through `previous_response_id` that finds the first turn cached, the store's GET / DELETE / input_items, tenant
isolation, the store's count and byte bounds under a flood, 400s naming the field, and the OpenAI Agents SDK's
default (Responses) model finishing a tool round trip. KV conservation after each server test."""

from __future__ import annotations

import json
import random

import httpx
import jsonschema
import pytest
from openai import NotFoundError, OpenAI
from server_harness import API_SERVER_ARGS, ServerHandle, check_idle_conservation, start_server

from radixserve.entrypoints.http_errors import ApiError
from radixserve.entrypoints.responses_protocol import chat_messages, parse_input, responses_error
from radixserve.entrypoints.responses_store import ResponseStore, StoredResponse

WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"], "additionalProperties": False}}
ADD = {"type": "function", "name": "add", "description": "Adds two integers", "strict": True,
       "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                                                       "b": {"type": "integer", "minimum": -1000, "maximum": 1000}},
                      "required": ["a", "b"], "additionalProperties": False}}
ASK = "What is the weather in Paris?"
KEYS = ("resp-key-a", "resp-key-b")
ADMIN = "resp-admin"


@pytest.fixture(scope="module")
def model(api_client: OpenAI) -> str:
    return api_client.models.list().data[0].id


@pytest.fixture(scope="module")
def keyed() -> ServerHandle:
    """Two tenant keys and a small store: 4 responses, 24,000 bytes."""
    server = start_server(*API_SERVER_ARGS, "--api-key", ",".join(KEYS), "--admin-api-key", ADMIN,
                          "--responses-store-max-count", "4", "--responses-store-max-bytes", "24000",
                          api_key=KEYS[0], admin_key=ADMIN)
    yield server
    server.stop()


def _client(server: ServerHandle, key: str) -> OpenAI:
    return OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0, timeout=120)


def _refused(server: ServerHandle, body: dict, status: int = 400) -> dict:
    r = server.post("/v1/responses", json=body)
    assert r.status_code == status, r.text[:400]
    return r.json()["error"]


# ---------------------------------------------------------------------------------------- the store, alone


def _entry(chars: int) -> StoredResponse:
    return StoredResponse({"id": "r", "output": []}, [{"type": "message", "content": "x" * chars}], [], None, None,
                          "", [1] * 10, [2] * 5)


def test_the_store_keeps_its_count_and_byte_bounds_and_evicts_least_recently_used() -> None:
    store = ResponseStore(max_count=5, max_bytes=20_000)
    rng = random.Random(0)
    for i in range(300):
        tenant = rng.choice(("a", "b"))
        store.put(tenant, f"r{i}", _entry(rng.randrange(0, 6000)))
        if i % 7 == 0:
            store.get("a", f"r{i - 3}")
        assert len(store) <= 5 and store.bytes <= 20_000, store.stats()
        assert store.bytes == sum(e.size for e in store._entries.values())
    assert store.evicted > 0
    lru = ResponseStore(max_count=2, max_bytes=1 << 20)
    lru.put("a", "one", _entry(10))
    lru.put("a", "two", _entry(10))
    assert lru.get("a", "one") is not None  # "one" is now the most recent: "two" goes first
    lru.put("a", "three", _entry(10))
    assert lru.get("a", "two") is None and lru.get("a", "one") is not None
    assert lru.get("b", "one") is None  # another tenant's id does not exist for it
    assert not lru.put("a", "huge", _entry(2 << 20)) and lru.get("a", "huge") is None


def test_items_become_chat_turns_and_chat_errors_name_the_responses_fields() -> None:
    items = parse_input([{"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text",
                                                                                          "text": "b"}]},
                         {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}", "id": "fc_1"},
                         {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
                         {"type": "function_call_output", "call_id": "c1", "output": "ok"}])
    messages = chat_messages(items, "be brief")
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool"]
    assert messages[1]["content"] == "ab" and [c["id"] for c in messages[2]["tool_calls"]] == ["c1", "c2"]
    for param, expected in (("tools.0.function.name", "tools.0.name"), ("max_tokens", "max_output_tokens"),
                            ("response_format", "text.format"), ("messages.3.tool_call_id", "input")):
        error = responses_error(ApiError(400, f"'{param}' is bad", param=param))
        assert error.param == expected and error.status == 400, (param, error.param)
    assert responses_error(ApiError(400, "'max_tokens' must be at least 1", param="max_tokens")).message == \
        "'max_output_tokens' must be at least 1"


# ---------------------------------------------------------------------------------------- one server


def test_a_text_response_parses_in_the_sdk_with_its_fields_echoed(api_client: OpenAI, model: str) -> None:
    r = api_client.responses.create(model=model, input="Name a color.", instructions="Answer in one word.",
                                    max_output_tokens=8, temperature=0, metadata={"run": "t1"}, user="u1")
    assert r.object == "response" and r.id.startswith("resp_") and r.status in ("completed", "incomplete")
    assert r.output[0].type == "message" and r.output[0].role == "assistant" and r.output_text
    assert r.instructions == "Answer in one word." and r.metadata == {"run": "t1"} and r.temperature == 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens and 0 < r.usage.output_tokens <= 8
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"


def test_a_json_schema_text_format_gives_valid_json(api_client: OpenAI, model: str) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "sunny": {"type": "boolean"}},
              "required": ["city", "sunny"], "additionalProperties": False}
    r = api_client.responses.create(model=model, input="Describe the weather in Paris as JSON.", temperature=0,
                                    max_output_tokens=60, text={"format": {"type": "json_schema", "name": "weather",
                                                                           "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"


@pytest.mark.long  # NOTE: minutes on 2 loaded cores; the long run (CI) keeps it
def test_forced_function_tools_give_valid_calls(api_client: OpenAI, model: str) -> None:
    for choice, name in (({"type": "function", "name": "add"}, "add"), ("required", None)):
        r = api_client.responses.create(model=model, input="What is 2 + 3, and the weather in Paris?",
                                        tools=[WEATHER, ADD], tool_choice=choice, parallel_tool_calls=False,
                                        max_output_tokens=60, temperature=0)
        calls = [o for o in r.output if o.type == "function_call"]
        assert len(calls) == 1 and calls[0].call_id.startswith("call_") and calls[0].status == "completed", r.output
        schemas = {"get_weather": WEATHER["parameters"], "add": ADD["parameters"]}
        assert name is None or calls[0].name == name
        jsonschema.validate(json.loads(calls[0].arguments), schemas[calls[0].name])
        assert [t.name for t in r.tools] == ["get_weather", "add"]


def _streamed(api_client: OpenAI, **args) -> list:
    events = list(api_client.responses.create(stream=True, **args))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert events[-1].type == f"response.{events[-1].response.status}"
    return events


def test_streamed_events_come_in_order_and_reassemble_to_the_whole_answer(api_client: OpenAI, model: str) -> None:
    args = dict(model=model, input="Say hello to Paris.", max_output_tokens=48, temperature=0, store=False)
    whole = api_client.responses.create(**args)
    events = _streamed(api_client, **args)
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert "".join(deltas) == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens
    # a function call: added, argument deltas, done, item done; the arguments are the non-streamed call's
    args = dict(model=model, input=ASK, tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
                max_output_tokens=60, temperature=0, store=False)
    whole_call = api_client.responses.create(**args).output[-1]
    events = _streamed(api_client, **args)
    kinds = [e.type for e in events]
    assert kinds[2] == "response.output_item.added" and events[2].item.type == "function_call"
    assert kinds[-3:-1] == ["response.function_call_arguments.done", "response.output_item.done"]
    assert set(kinds[3:-3]) == {"response.function_call_arguments.delta"}
    streamed = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert streamed == events[-3].arguments == whole_call.arguments
    assert events[-2].item.name == whole_call.name == "get_weather"


def test_a_tool_loop_through_previous_response_id_finds_the_first_turn_cached(api_client: OpenAI,
                                                                              model: str) -> None:
    first = api_client.responses.create(model=model, input=ASK, tools=[WEATHER, ADD], max_output_tokens=60,
                                        tool_choice={"type": "function", "name": "get_weather"}, temperature=0)
    call = first.output[-1]
    assert call.type == "function_call"
    second = api_client.responses.create(model=model, previous_response_id=first.id, tools=[WEATHER, ADD],
                                         input=[{"type": "function_call_output", "call_id": call.call_id,
                                                 "output": "22 degrees, sunny"}],
                                         max_output_tokens=30, temperature=0)
    assert second.previous_response_id == first.id and second.status in ("completed", "incomplete")
    # NOTE: the prompt reuses the first turn's ids and generated ids: all but the last (never fed) are cached
    seen = first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= seen - 1, (first.usage, second.usage)
    assert second.usage.input_tokens > seen


def test_stored_responses_get_delete_and_input_items(api_client: OpenAI, model: str) -> None:
    r = api_client.responses.create(model=model, input=[{"role": "user", "content": "Hi"}], max_output_tokens=4,
                                    temperature=0)
    got = api_client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.usage == r.usage
    turn = api_client.responses.create(model=model, previous_response_id=r.id, max_output_tokens=4, temperature=0,
                                       input=[{"role": "user", "content": [{"type": "input_text", "text": "Bye"}]}])
    # a plain turn continues the stored ids too: the first turn's prompt and answer are cached
    assert turn.usage.input_tokens_details.cached_tokens >= r.usage.input_tokens + r.usage.output_tokens - 1
    items = list(api_client.responses.input_items.list(turn.id, order="asc"))
    assert len(items) == 1 and items[0].content[0].text == "Bye" and items[0].id
    assert api_client.responses.delete(r.id) is None
    for call in (lambda: api_client.responses.retrieve(r.id), lambda: api_client.responses.delete(r.id)):
        with pytest.raises(NotFoundError):
            call()
    streamed = list(api_client.responses.create(model=model, input="Hi", max_output_tokens=3, stream=True))[-1]
    assert api_client.responses.retrieve(streamed.response.id).output_text == streamed.response.output_text
    unstored = api_client.responses.create(model=model, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(NotFoundError):
        api_client.responses.retrieve(unstored.id)


def test_bad_requests_are_400s_naming_the_field(api_server: ServerHandle) -> None:
    cases = [
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
         "input.0.content.0.type"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type"),
        ({"input": "x", "text": {"format": {"type": "grammar"}}}, "text.format.type"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, "text.format.schema"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"input": "x", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"input": ["x"] * 2000}, "input"),
        ({"input": "x", "background": True}, "background"),
        ({"input": 3}, "input"),
    ]
    for body, param in cases:
        error = _refused(api_server, {**body, "max_output_tokens": body.get("max_output_tokens", 2)})
        assert error["param"] == param, (body, error)
    assert _refused(api_server, {"input": "x", "previous_response_id": "resp_nope"}, 404)["param"] == \
        "previous_response_id"


def test_the_openai_agents_sdk_default_model_runs_a_tool_loop(api_server: ServerHandle, model: str) -> None:
    from agents import (
        Agent,
        ModelSettings,
        Runner,
        function_tool,
        set_default_openai_client,
        set_tracing_disabled,
    )
    from agents.models.openai_responses import OpenAIResponsesModel
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return f"22 degrees and sunny in {city}"

    set_default_openai_client(AsyncOpenAI(base_url=api_server.base_url + "/v1", api_key="unused", max_retries=0),
                              use_for_tracing=False)
    agent = Agent(name="weather", instructions="Answer weather questions with the weather tool.", tools=[weather],
                  model=model, model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False,
                                                            temperature=0, max_tokens=60))
    result = Runner.run_sync(agent, "What is the weather in Paris?", max_turns=4)
    assert calls and isinstance(result.final_output, str) and len(result.raw_responses) >= 2
    from agents.models.multi_provider import MultiProvider
    assert isinstance(MultiProvider().get_model(model), OpenAIResponsesModel)  # the SDK's default model
    first, second = result.raw_responses[:2]
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens, (first.usage, second.usage)


# ---------------------------------------------------------------------------------------- tenants and bounds


def test_another_tenants_response_is_a_404(keyed: ServerHandle) -> None:
    a, b = _client(keyed, KEYS[0]), _client(keyed, KEYS[1])
    r = a.responses.create(input="Hi", max_output_tokens=2, temperature=0)
    for call in (lambda: b.responses.retrieve(r.id), lambda: b.responses.input_items.list(r.id),
                 lambda: b.responses.delete(r.id),
                 lambda: b.responses.create(input="Hi", previous_response_id=r.id, max_output_tokens=2)):
        with pytest.raises(NotFoundError):
            call()
    assert a.responses.retrieve(r.id).id == r.id
    assert httpx.get(keyed.base_url + f"/v1/responses/{r.id}").status_code == 401
    check_idle_conservation(keyed)


def _stored(client: OpenAI, ids: list[str]) -> list[bool]:
    out = []
    for i in ids:
        try:
            client.responses.retrieve(i)
            out.append(True)
        except NotFoundError:
            out.append(False)
    return out


@pytest.mark.long  # NOTE: minutes on 2 loaded cores; the long run (CI) keeps it
def test_the_store_bounds_hold_under_a_flood(keyed: ServerHandle) -> None:
    a = _client(keyed, KEYS[0])
    small = [a.responses.create(input=f"Hi {i}", max_output_tokens=1, temperature=0).id for i in range(10)]
    assert _stored(a, small) == [False] * 6 + [True] * 4  # the count bound (4), oldest first
    # NOTE: each of these holds its 3,000-character input three times (items, history, prompt): over 9,000 bytes,
    # so the 24,000-byte bound keeps two at most, whatever the count bound allows
    big = [a.responses.create(input=f"{i} " + "hello " * 500, max_output_tokens=1, temperature=0).id
           for i in range(4)]
    kept = _stored(a, big)
    assert kept[-1] and 1 <= sum(kept) <= 2 and kept == sorted(kept), kept
    assert not any(_stored(a, small))
    check_idle_conservation(keyed)
