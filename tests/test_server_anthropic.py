"""Anthropic's Messages API through the real server with the real `anthropic` SDK: text, a forced tool call whose
input validates against its schema, a tool round trip, streams that reassemble to the non-streamed message, the
named SSE events, count_tokens against generation's own count, cache reads of a shared system prompt, stop
sequences, bad input as 400s in Anthropic's error shape naming the field, x-api-key on a server with keys, and
LangChain's ChatAnthropic with bound tools. Conservation after each test (conftest.py; the keyed server by hand)."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest
from server_harness import ServerHandle, check_idle_conservation, tenant_server

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0}  # NOTE: this SDK has no `temperature` argument; the server reads it from the body
# NOTE: bounded strings: given an unbounded one, the 135M model may write it until max_tokens
WEATHER = {"name": "get_weather", "description": "The current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                             "unit": {"enum": ["celsius", "fahrenheit"]}},
                            "required": ["city", "unit"], "additionalProperties": False}}
ADD = {"name": "add", "description": "Adds two integers",
       "input_schema": {"type": "object", "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                                                         "b": {"type": "integer", "minimum": -1000, "maximum": 1000}},
                        "required": ["a", "b"], "additionalProperties": False}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
FORCE_WEATHER = {"type": "tool", "name": "get_weather"}


@pytest.fixture(scope="module")
def client(api_server: ServerHandle) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=api_server.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(api_server: ServerHandle) -> str:
    return api_server.get("/v1/models").json()["data"][0]["id"]


def _post(server: ServerHandle, body: dict, **kwargs) -> httpx.Response:
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        return c.post("/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"}, **kwargs)


def test_create_text(client: anthropic.Anthropic, model: str) -> None:
    m = client.messages.create(model=model, max_tokens=16, messages=[{"role": "user", "content": "Say hello."}],
                               system=[{"type": "text", "text": "You are terse."}], metadata={"user_id": "u-1"},
                               extra_body=GREEDY)
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant" and m.model == model
    assert [b.type for b in m.content] == ["text"] and m.content[0].text.strip()
    assert m.stop_reason in ("end_turn", "max_tokens") and m.stop_sequence is None
    assert 0 < m.usage.output_tokens <= 16 and m.usage.input_tokens + m.usage.cache_read_input_tokens > 5
    assert m.usage.cache_creation_input_tokens == 0


def test_stop_sequence_is_reported(client: anthropic.Anthropic, model: str) -> None:
    ask = [{"role": "user", "content": "Count from one to ten in words."}]
    free = client.messages.create(model=model, max_tokens=24, messages=ask, extra_body=GREEDY)
    words = free.content[0].text.split()
    assert len(words) >= 3, free.content[0].text
    stop = words[2]
    m = client.messages.create(model=model, max_tokens=24, messages=ask, stop_sequences=[stop], extra_body=GREEDY)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert stop not in m.content[0].text and free.content[0].text.startswith(m.content[0].text)


@pytest.mark.long  # NOTE: minutes on 2 loaded cores; the long run (CI) keeps it
def test_forced_tool_gives_a_valid_tool_use(client: anthropic.Anthropic, model: str) -> None:
    m = client.messages.create(model=model, max_tokens=64, messages=ASK, tools=[WEATHER, ADD],
                               tool_choice=FORCE_WEATHER, extra_body=GREEDY)
    calls = [b for b in m.content if b.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].id, m
    jsonschema.validate(calls[0].input, WEATHER["input_schema"])
    assert m.stop_reason == "tool_use"
    # `any` forces some call; `none` forbids them
    anyone = client.messages.create(model=model, max_tokens=64, messages=ASK, tools=[WEATHER, ADD],
                                    tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                    extra_body=GREEDY)
    assert anyone.stop_reason == "tool_use" and any(b.type == "tool_use" for b in anyone.content)
    none = client.messages.create(model=model, max_tokens=8, messages=ASK, tools=[WEATHER],
                                  tool_choice={"type": "none"}, extra_body=GREEDY)
    assert all(b.type == "text" for b in none.content) and none.stop_reason != "tool_use"


def test_tool_round_trip(client: anthropic.Anthropic, model: str) -> None:
    first = client.messages.create(model=model, max_tokens=64, messages=ASK, tools=[WEATHER],
                                   tool_choice=FORCE_WEATHER, extra_body=GREEDY)
    call = next(b for b in first.content if b.type == "tool_use")
    history = [*ASK, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
               {"role": "user", "content": [
                   {"type": "tool_result", "tool_use_id": call.id,
                    "content": [{"type": "text", "text": "Sunny, 24 degrees celsius."}]},
                   {"type": "text", "text": "So, what should I wear?"}]}]
    m = client.messages.create(model=model, max_tokens=24, messages=history, tools=[WEATHER],
                               tool_choice={"type": "none"}, extra_body=GREEDY)
    assert m.content and m.content[0].type == "text" and m.content[0].text.strip()
    assert m.stop_reason in ("end_turn", "max_tokens")
    # the second turn's prompt starts with the first's: the radix cache serves it
    assert m.usage.cache_read_input_tokens >= first.usage.input_tokens // 2, (first.usage, m.usage)
    # the result is in the prompt (count_tokens renders the same history); an error result renders too
    with_result = client.messages.count_tokens(model=model, messages=history, tools=[WEATHER]).input_tokens
    assert with_result == m.usage.input_tokens + m.usage.cache_read_input_tokens
    history[2]["content"][0] |= {"is_error": True, "content": "timeout"}
    errored = client.messages.create(model=model, max_tokens=8, messages=history, tools=[WEATHER],
                                     tool_choice={"type": "none"}, extra_body=GREEDY)
    assert errored.content[0].type == "text"


@pytest.mark.parametrize("tools", [None, pytest.param([WEATHER, ADD], marks=pytest.mark.long)], ids=["text", "forced_tool"])
def test_stream_reassembles_to_the_create_message(client: anthropic.Anthropic, model: str, tools) -> None:
    kwargs = {"model": model, "max_tokens": 40, "messages": ASK, "extra_body": GREEDY}
    if tools is not None:
        kwargs |= {"tools": tools, "tool_choice": FORCE_WEATHER}
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert [b.model_dump(exclude={"id"}) for b in streamed.content] == [
        b.model_dump(exclude={"id"}) for b in whole.content]
    assert streamed.stop_reason == whole.stop_reason and streamed.usage.output_tokens == whole.usage.output_tokens
    assert (streamed.usage.input_tokens + streamed.usage.cache_read_input_tokens
            == whole.usage.input_tokens + whole.usage.cache_read_input_tokens)
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    if tools is not None:
        assert "input_json" in kinds and streamed.content[-1].type == "tool_use"


def test_stream_events_are_named(api_server: ServerHandle, model: str) -> None:
    r = _post(api_server, {"model": model, "max_tokens": 6, "messages": ASK, "stream": True, "temperature": 0})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [e for e in r.text.split("\n\n") if e.strip()]
    names = []
    for e in events:
        event_line, data_line = e.split("\n")
        name = event_line.removeprefix("event: ")
        assert json.loads(data_line.removeprefix("data: "))["type"] == name, e
        names.append(name)
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"} and "[DONE]" not in r.text


def test_count_tokens_matches_generation(client: anthropic.Anthropic, model: str) -> None:
    kwargs = {"model": model, "messages": ASK, "system": "You answer about weather.", "tools": [WEATHER]}
    counted = client.messages.count_tokens(**kwargs).input_tokens
    m = client.messages.create(max_tokens=4, extra_body=GREEDY, **kwargs)
    assert counted == m.usage.input_tokens + m.usage.cache_read_input_tokens
    bare = client.messages.count_tokens(model=model, messages=ASK).input_tokens
    assert 0 < bare < counted  # the system prompt and the tool are rendered into the prompt


def test_a_shared_system_prompt_is_read_from_the_cache(client: anthropic.Anthropic, model: str) -> None:
    system = " ".join(f"Rule {i}: answer politely, briefly and only about the weather in city {i}." for i in range(20))
    asks = ["Is it raining in Oslo?", "Is it windy in Lima?"]
    first, second = (client.messages.create(model=model, max_tokens=4, system=system, extra_body=GREEDY,
                                            messages=[{"role": "user", "content": a}]) for a in asks)
    system_tokens = client.messages.count_tokens(model=model, system=system, messages=[
        {"role": "user", "content": ""}]).input_tokens
    assert system_tokens > 200
    assert second.usage.cache_read_input_tokens >= system_tokens - 16, second.usage
    assert second.usage.input_tokens < first.usage.input_tokens + first.usage.cache_read_input_tokens


BAD = [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64"}}]}]},
     "messages.0.content.0.type"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "messages.0.content.0.type"),
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
    ({"tools": [{"name": "f"}]}, "tools.0.input_schema"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x", "content": "1"}]}]},
     "messages.0.content.0.tool_use_id"),
    ({"messages": [{"role": "system", "content": "hi"}]}, "messages.0.role"),
    ({"messages": [*ASK, {"role": "assistant", "content": "It is"}]}, "messages.1"),
    ({"system": [{"type": "image", "source": {}}]}, "system.0.type"),
    ({"stop_sequences": ["x"] * 100}, "stop_sequences"),
    ({"temperature": "hot"}, "temperature"),
]


@pytest.mark.parametrize(("change", "field"), BAD, ids=[field for _, field in BAD])
def test_bad_input_is_a_400_naming_the_field(api_server: ServerHandle, model: str, change: dict, field: str) -> None:
    body = {"model": model, "max_tokens": 4, "messages": ASK} | change
    body = {k: v for k, v in body.items() if v is not None}
    r = _post(api_server, body)
    assert r.status_code == 400, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error", error
    assert f"'{field}'" in error["error"]["message"], error


def test_errors_through_the_sdk(client: anthropic.Anthropic, model: str) -> None:
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model=model, max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x/a.png"}}]}])
    assert bad.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="claude-not-here", max_tokens=4, messages=ASK)
    assert missing.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError):
        client.messages.count_tokens(model=model, messages=[{"role": "user", "content": [{"type": "image"}]}])


def test_x_api_key_on_a_server_with_keys() -> None:
    server = tenant_server()
    base = {"base_url": server.base_url, "max_retries": 0, "timeout": 120}
    with pytest.raises(anthropic.AuthenticationError) as denied:
        anthropic.Anthropic(api_key="wrong-key", **base).messages.create(model="any", max_tokens=4, messages=ASK)
    assert denied.value.status_code == 401 and denied.value.body["error"]["type"] == "authentication_error"
    assert _post(server, {"model": "x", "max_tokens": 4, "messages": ASK}).status_code == 401  # no key at all
    keyed = anthropic.Anthropic(api_key=server.api_key, **base)
    model = server.get("/v1/models").json()["data"][0]["id"]
    m = keyed.messages.create(model=model, max_tokens=4, messages=ASK, extra_body=GREEDY)
    assert m.content and m.usage.output_tokens > 0
    assert keyed.messages.count_tokens(model=model, messages=ASK).input_tokens > 0
    check_idle_conservation(server)


def test_langchain_chat_anthropic_binds_tools(api_server: ServerHandle, model: str) -> None:
    from langchain_anthropic import ChatAnthropic

    llm = ChatAnthropic(model=model, base_url=api_server.base_url, api_key="unused", max_tokens=64, temperature=0,
                        max_retries=0, timeout=120)
    answer = llm.bind_tools([WEATHER, ADD], tool_choice="get_weather").invoke("What is the weather in Paris?")
    assert answer.tool_calls and answer.tool_calls[0]["name"] == "get_weather", answer
    jsonschema.validate(answer.tool_calls[0]["args"], WEATHER["input_schema"])
    assert answer.usage_metadata["output_tokens"] > 0


# ------------------------------------------------------------------------------ the translation, no server


def test_translate_maps_blocks_to_the_chat_request() -> None:
    from radixserve.entrypoints.anthropic_protocol import MessagesRequest, anthropic_error, translate
    from radixserve.entrypoints.http_errors import bad_request

    req = MessagesRequest.model_validate({
        "model": "m", "max_tokens": 8, "stop_sequences": ["END"], "metadata": {"user_id": "u"},
        "system": [{"type": "text", "text": "A"}, {"type": "text", "text": "B", "cache_control": {"type": "ephemeral"}}],
        "tools": [WEATHER], "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "messages": [*ASK, {"role": "assistant", "content": [
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris", "unit": "celsius"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny",
                                          "is_error": True}, {"type": "text", "text": "And?"}]}]})
    t = translate(req)
    chat = t.chat
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "tool", "user"]
    assert chat.messages[0].content == "A\n\nB" and chat.messages[3].content == "Error: sunny"
    assert chat.messages[2].content == "Let me look." and chat.messages[3].tool_call_id == "toolu_1"
    assert json.loads(chat.messages[2].tool_calls[0].function.arguments) == {"city": "Paris", "unit": "celsius"}
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert chat.tools[0].function.parameters == WEATHER["input_schema"]
    assert chat.stop == ["END"] and chat.user == "u" and chat.max_tokens == 8
    assert t.origin == ["system", "messages.0", "messages.1", "messages.2.content.0", "messages.2"]
    # an error the chat path raises names the Messages request's field
    error = anthropic_error(bad_request("'messages.3.content' is bad", param="messages.3.content"), t.origin)
    assert error.param == "messages.2.content.0" and "'messages.2.content.0'" in error.message
    assert error.body() == {"type": "error", "error": {"type": "invalid_request_error", "message": error.message}}


def test_stream_events_get_their_names_and_errors_their_shape() -> None:
    from radixserve.entrypoints.serving_anthropic import _name_events

    body = (b'data: {"type":"message_stop"}\n\n'
            b'data: {"error":{"message":"gone","type":"service_unavailable_error","param":null,"code":"x"}}\n\n'
            b"data: [DONE]\n\n")
    assert _name_events(body) == (
        b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
        b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error","message":"gone"}}\n\n')


def test_x_api_key_is_the_bearer_keys_principal() -> None:
    from starlette.requests import Request

    from radixserve.entrypoints.http_auth import Auth
    from radixserve.entrypoints.http_errors import ApiError

    auth = Auth(["k1", "k2"], "admin")

    def request(headers: dict[str, str]) -> Request:
        return Request({"type": "http", "headers": [(k.encode(), v.encode()) for k, v in headers.items()]})

    assert auth.principal(request({"x-api-key": "k2"})) == auth.principal(request({"authorization": "Bearer k2"}))
    assert auth.principal(request({"x-api-key": "admin"})).admin
    assert auth.has_key(request({"x-api-key": "k1"})) and not auth.has_key(request({"x-api-key": "k3"}))
    with pytest.raises(ApiError) as denied:
        auth.principal(request({"x-api-key": "k3"}))
    assert denied.value.status == 401
