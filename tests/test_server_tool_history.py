"""Chat histories with tool calls, and the legacy `functions` / `function_call` API, through the real server.

A broken history is a 400 whose error names the field (`messages.3.tool_call_id`, as the other validation
errors name theirs): a tool answer to no call of the assistant turn before it, a call whose arguments are not a
JSON object, a call of a tool the request does not declare, call fields on the wrong role, and the same faults
in the legacy `function_call` / `function` role. The legacy request fields are served: mapped to tools, answered
in the legacy shape (`message.function_call`, `finish_reason: "function_call"`), whole and streamed. The server
keeps serving after each refusal; conservation is checked after every test (conftest's fixture)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from openai import OpenAI
from server_harness import ServerHandle, check_idle_conservation

pytestmark = pytest.mark.slow

WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                  "required": ["city"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": WEATHER_PARAMS}}
WEATHER_FN = WEATHER["function"]
ASK = {"role": "user", "content": "What is the weather in Paris?"}
ARGS = '{"city": "Paris"}'


def _call(id_: str = "call_1", name: str = "get_weather", arguments: str = ARGS) -> dict:
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": arguments}}


def _asked(*calls: dict) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": list(calls) or [_call()]}


def _answer(id_: str | None = "call_1", content: str = "22 degrees, sunny") -> dict:
    message = {"role": "tool", "content": content}
    return message | ({"tool_call_id": id_} if id_ is not None else {})


LEGACY_ASKED = {"role": "assistant", "content": None, "function_call": {"name": "get_weather", "arguments": ARGS}}
LEGACY_ANSWER = {"role": "function", "name": "get_weather", "content": "22 degrees, sunny"}


@pytest.fixture(scope="module")
def model(api_client: OpenAI) -> str:
    return api_client.models.list().data[0].id


def _post(server: ServerHandle, body: dict, path: str = "/v1/chat/completions") -> httpx.Response:
    return httpx.post(server.base_url + path, timeout=120, json={"max_tokens": 5} | body)


REFUSED = [
    # a tool answer must answer a call of the assistant turn right before it (only tool answers between)
    ("tool answers an unknown id", {"messages": [ASK, _asked(), _answer("call_2")]}, "messages.2.tool_call_id"),
    ("tool answers nothing", {"messages": [ASK, _answer()]}, "messages.1.tool_call_id"),
    ("tool without tool_call_id", {"messages": [ASK, _asked(), _answer(None)]}, "messages.2.tool_call_id"),
    ("tool after a user turn", {"messages": [ASK, _asked(), ASK, _answer()]}, "messages.3.tool_call_id"),
    ("tool answers an older turn", {"messages": [ASK, _asked(), _answer(), {"role": "assistant", "content": "ok"},
                                                 _answer()]}, "messages.4.tool_call_id"),
    # a call's arguments: a JSON object, as text
    ("arguments not JSON", {"messages": [ASK, _asked(_call(arguments='{"city": "Par')), _answer()]},
     "messages.1.tool_calls.0.function.arguments"),
    ("arguments not an object", {"messages": [ASK, _asked(_call(), _call("call_2", arguments='["Paris"]'))]},
     "messages.1.tool_calls.1.function.arguments"),
    ("arguments empty", {"messages": [ASK, _asked(_call(arguments=""))]},
     "messages.1.tool_calls.0.function.arguments"),
    # with `tools`, only declared tools can have been called
    ("undeclared tool", {"tools": [WEATHER], "messages": [ASK, _asked(_call(name="rm_rf")), _answer()]},
     "messages.1.tool_calls.0.function.name"),
    ("undeclared tool, choice none", {"tools": [WEATHER], "tool_choice": "none",
                                      "messages": [ASK, _asked(_call(name="add"))]},
     "messages.1.tool_calls.0.function.name"),
    ("two calls, one id", {"messages": [ASK, _asked(_call(), _call())]}, "messages.1.tool_calls.1.id"),
    # call fields on the wrong role
    ("tool_calls on a user turn", {"messages": [ASK | {"tool_calls": [_call()]}]}, "messages.0.tool_calls"),
    ("tool_call_id on a user turn", {"messages": [ASK | {"tool_call_id": "call_1"}]}, "messages.0.tool_call_id"),
    ("function_call on a system turn", {"messages": [{"role": "system", "content": "x",
                                                      "function_call": {"name": "f", "arguments": "{}"}}, ASK]},
     "messages.0.function_call"),
    # the legacy history: an assistant `function_call`, answered by a `function` message naming it
    ("function answer without name", {"messages": [ASK, LEGACY_ASKED, {"role": "function", "content": "22"}]},
     "messages.2.name"),
    ("function answers another name", {"messages": [ASK, LEGACY_ASKED, LEGACY_ANSWER | {"name": "add"}]},
     "messages.2.name"),
    ("function answers nothing", {"messages": [ASK, LEGACY_ANSWER]}, "messages.1.name"),
    ("legacy arguments not JSON", {"messages": [ASK, LEGACY_ASKED | {"function_call": {
        "name": "get_weather", "arguments": "Paris"}}, LEGACY_ANSWER]}, "messages.1.function_call.arguments"),
    ("legacy call undeclared", {"functions": [WEATHER_FN], "messages": [ASK, LEGACY_ASKED | {"function_call": {
        "name": "add", "arguments": "{}"}}]}, "messages.1.function_call.name"),
    ("both call fields", {"messages": [ASK, _asked() | {"function_call": {"name": "get_weather", "arguments": ARGS}}]},
     "messages.1.function_call"),
    # the legacy request fields: checked as `tools` and `tool_choice` are, under their own names
    ("functions and tools", {"functions": [WEATHER_FN], "tools": [WEATHER], "messages": [ASK]}, "functions"),
    ("function_call and tool_choice", {"functions": [WEATHER_FN], "tool_choice": "auto",
                                       "function_call": "auto", "messages": [ASK]}, "function_call"),
    ("function_call without functions", {"function_call": "auto", "messages": [ASK]}, "function_call"),
    ("function_call names no function", {"functions": [WEATHER_FN], "function_call": {"name": "add"},
                                         "messages": [ASK]}, "function_call"),
    ("function_call required", {"functions": [WEATHER_FN], "function_call": "required", "messages": [ASK]},
     "function_call"),
    ("two functions of one name", {"functions": [WEATHER_FN, WEATHER_FN], "messages": [ASK]}, "functions"),
    ("bad function name", {"functions": [WEATHER_FN | {"name": "a b"}], "messages": [ASK]}, "functions.0.name"),
]


@pytest.mark.parametrize("body, param", [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_broken_histories_and_legacy_faults_are_400s_naming_the_field(api_server: ServerHandle, body: dict,
                                                                      param: str) -> None:
    r = _post(api_server, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and param in error["message"], error


@pytest.mark.parametrize("messages, param", [
    ([ASK, _asked(), _answer("call_9")], "messages.2.tool_call_id"),
    ([ASK, _asked(_call(arguments="{"))], "messages.1.tool_calls.0.function.arguments"),
])
def test_tokenize_checks_the_history_too(api_server: ServerHandle, messages: list, param: str) -> None:
    r = httpx.post(api_server.base_url + "/tokenize", json={"messages": messages}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_well_formed_histories_are_served(api_server: ServerHandle) -> None:
    calls = [_call(), _call("call_2", arguments='{"city": "Rome"}')]
    histories = [
        # two calls answered in either order, then a text turn and a new question
        [ASK, _asked(*calls), _answer("call_2", "18 degrees"), _answer("call_1"),
         {"role": "assistant", "content": "Sunny in Paris."}, ASK],
        # without `tools`, a history's calls may name any function (the tools of an earlier request)
        [ASK, _asked(_call(name="lookup", arguments="{}")), _answer()],
        # the legacy shape of the same loop
        [ASK, LEGACY_ASKED, LEGACY_ANSWER],
        # `name` on the other roles is accepted (a participant's name) and not rendered
        [ASK | {"name": "alice"}, {"role": "assistant", "content": "Hello.", "name": "bot"}],
    ]
    for messages in histories:
        r = _post(api_server, {"messages": messages, "temperature": 0})
        assert r.status_code == 200, (messages, r.text)
    r = _post(api_server, {"messages": histories[0], "tools": [WEATHER], "temperature": 0})
    assert r.status_code == 200, r.text
    r = _post(api_server, {"messages": histories[2], "functions": [WEATHER_FN], "function_call": "none",
                           "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["message"].get("function_call") is None, r.text


def _legacy_args(model: str) -> dict:
    return dict(model=model, messages=[ASK], functions=[WEATHER_FN], function_call={"name": "get_weather"},
                max_tokens=60, temperature=0)


def test_a_forced_legacy_function_call_is_answered_in_the_legacy_shape(api_client: OpenAI, model: str) -> None:
    done = api_client.chat.completions.create(**_legacy_args(model), n=2)
    for choice in done.choices:
        assert choice.finish_reason == "function_call", choice
        message = choice.message
        assert message.tool_calls is None and not message.content, message
        assert message.function_call.name == "get_weather"
        jsonschema.validate(json.loads(message.function_call.arguments), WEATHER_PARAMS)
    raw = done.model_dump()["choices"][0]["message"]
    assert set(raw["function_call"]) == {"name", "arguments"}


def test_a_streamed_legacy_call_reassembles_to_the_whole_one(api_server: ServerHandle, model: str) -> None:
    whole = _post(api_server, _legacy_args(model)).json()["choices"][0]
    pieces, reasons = [], []
    with httpx.stream("POST", api_server.base_url + "/v1/chat/completions", timeout=120,
                      json=_legacy_args(model) | {"stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[6:])["choices"][0]
            reasons.append(choice["finish_reason"])
            assert "tool_calls" not in choice["delta"] or choice["delta"]["tool_calls"] is None, choice
            if choice["delta"].get("function_call"):
                pieces.append(choice["delta"]["function_call"])
    # OpenAI's legacy pieces: the first has the name, later ones argument text only
    assert pieces and pieces[0]["name"] == "get_weather" and all("name" not in p for p in pieces[1:]), pieces
    assert "".join(p.get("arguments", "") for p in pieces) == whole["message"]["function_call"]["arguments"]
    assert reasons[-1] == whole["finish_reason"] == "function_call"


def test_a_legacy_loop_runs_a_second_turn_on_the_cached_first(api_client: OpenAI, model: str) -> None:
    first = api_client.chat.completions.create(**_legacy_args(model))
    asked = first.choices[0].message.model_dump(exclude_none=True)
    history = [ASK, asked, {"role": "function", "name": "get_weather", "content": "22 degrees, sunny"}]
    second = api_client.chat.completions.create(model=model, messages=history, functions=[WEATHER_FN],
                                                max_tokens=20, temperature=0)
    assert second.choices[0].finish_reason in ("stop", "length", "function_call")
    seen = first.usage.prompt_tokens + first.usage.completion_tokens
    assert second.usage.prompt_tokens_details.cached_tokens >= seen - 1, (first.usage, second.usage)


def test_the_server_still_serves_after_the_refusals(api_server: ServerHandle) -> None:
    pid = api_server.scheduler_pid()
    for _, body, _ in REFUSED:
        assert _post(api_server, body).status_code == 400
    assert api_server.get("/health").status_code == 200 and api_server.scheduler_pid() == pid
    assert _post(api_server, {"messages": [ASK]}).status_code == 200
    check_idle_conservation(api_server)
