"""Tool calls through the real server: `required` and a named function always give valid calls (their
arguments validate against the function's schema) over tool sets and sampling settings; streamed deltas
reassemble to the non-streamed call; the next turn finds the history cached; bad tools are 400s; LangChain
(`bind_tools`, `with_structured_output`) and the OpenAI Agents SDK each finish a tool loop with a local
Python tool. Conservation after each test."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from openai import OpenAI
from server_harness import ServerHandle

pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]


def _tool(name: str, properties: dict, description: str = "") -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}}}


# NOTE: bounded strings and numbers: given an unbounded one, the 135M model may write it until max_tokens
WEATHER = _tool("get_weather", {"city": {"type": "string", "maxLength": 20},
                                "unit": {"enum": ["celsius", "fahrenheit"]}}, "The current weather in a city")
ADD = _tool("add", {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                    "b": {"type": "integer", "minimum": -1000, "maximum": 1000}}, "Adds two integers")
FLIGHTS = _tool("search_flights", {"origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
                                   "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
                                   "direct": {"type": "boolean"}}, "Flights between two airports")
TOOLSETS = [[WEATHER, ADD], [FLIGHTS], [WEATHER, ADD, FLIGHTS]]
SAMPLINGS = [{"temperature": 0}, {"temperature": 0.9, "seed": 7, "top_p": 0.95},
             {"temperature": 1.1, "seed": 3, "frequency_penalty": 0.4, "extra_body": {"top_k": 30}}]


@pytest.fixture(scope="module")
def model(api_client: OpenAI) -> str:
    return api_client.models.list().data[0].id


def _check_calls(message, tools: list[dict], only: str | None = None) -> None:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in schemas
        assert only is None or call.function.name == only
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def _drop_the_call_cut_short(message) -> None:
    """A parallel answer that max_tokens ended: its last call (or the start of one, as content) is cut short."""
    if message.content:  # a call cut before its arguments began is text: the calls before it are whole
        assert message.content.lstrip().startswith(("<tool_call>", '{"name"')), message.content
    else:
        message.tool_calls.pop()


@pytest.mark.long  # NOTE: ~30 s; the default tool tests force a named call
def test_required_and_named_choices_always_give_valid_calls(api_client: OpenAI, model: str) -> None:
    for i, tools in enumerate(TOOLSETS):
        for sampling in SAMPLINGS:
            choices = ["required", {"type": "function", "function": {"name": tools[-1]["function"]["name"]}}]
            for choice in choices:
                done = api_client.chat.completions.create(model=model, messages=ASK, tools=tools, tool_choice=choice,
                                                      parallel_tool_calls=i % 2 == 1, max_tokens=80, n=2,
                                                      **sampling)
                for c in done.choices:
                    only = None if choice == "required" else choice["function"]["name"]
                    parallel = choice == "required" and i % 2 == 1
                    if parallel and c.finish_reason == "length":  # NOTE: free to call again, it may until max_tokens
                        _drop_the_call_cut_short(c.message)
                    else:
                        assert c.finish_reason == "tool_calls" and (len(c.message.tool_calls) == 1 or parallel)
                        assert not c.message.content
                    _check_calls(c.message, tools, only)


def test_streamed_deltas_reassemble_to_the_non_streamed_call(api_client: OpenAI, model: str) -> None:
    for tools, parallel in (([WEATHER, ADD], False), ([WEATHER, ADD, FLIGHTS], True)):
        args = dict(model=model, messages=ASK, tools=tools, tool_choice="required", parallel_tool_calls=parallel,
                    max_tokens=120, temperature=0)
        whole = api_client.chat.completions.create(**args).choices[0]
        calls: dict[int, dict] = {}
        reasons, first_pieces = [], []
        for chunk in api_client.chat.completions.create(stream=True, **args):
            choice = chunk.choices[0]
            reasons.append(choice.finish_reason)
            for piece in choice.delta.tool_calls or []:
                if piece.index not in calls:
                    first_pieces.append(piece)
                    calls[piece.index] = {"id": piece.id, "name": piece.function.name, "arguments": ""}
                else:  # OpenAI's later pieces carry only argument text
                    assert piece.id is None and piece.function.name is None
                calls[piece.index]["arguments"] += piece.function.arguments or ""
        assert [(c["name"], c["arguments"]) for c in calls.values()] == \
            [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
        assert all(p.id and p.type == "function" for p in first_pieces) and len(calls) > 1 or not parallel
        assert reasons[-1] == whole.finish_reason


def test_the_next_turn_finds_the_call_and_the_history_cached(api_client: OpenAI, model: str) -> None:
    first = api_client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER, ADD], max_tokens=60,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           temperature=0)
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "22 degrees, sunny"}]
    second = api_client.chat.completions.create(model=model, messages=history, tools=[WEATHER, ADD], max_tokens=30,
                                            temperature=0)
    # the first turn's prompt and every token of its call: the call renders to the text the model wrote
    seen = first.usage.prompt_tokens + first.usage.completion_tokens
    assert second.usage.prompt_tokens_details.cached_tokens >= seen - 1, (second.usage, first.usage)


def test_auto_with_a_json_response_format_answers_json_or_calls(api_client: OpenAI, model: str) -> None:
    answer = {"type": "object", "properties": {"weather": {"enum": ["sunny", "rainy"]}}, "required": ["weather"],
              "additionalProperties": False}
    done = api_client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], max_tokens=60, n=3,
                                          parallel_tool_calls=False,
                                          temperature=1.0, seed=5, response_format={
                                              "type": "json_schema", "json_schema": {"name": "a", "schema": answer}})
    for c in done.choices:
        assert c.finish_reason in ("stop", "tool_calls"), c
        if c.message.tool_calls:
            _check_calls(c.message, [WEATHER])
        else:
            jsonschema.validate(json.loads(c.message.content), answer)


@pytest.mark.parametrize("body, param, message", [
    ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "add"}}}, "tool_choice",
     "not in 'tools'"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "same name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, None, "invalid grammar"),
    ({"tools": [WEATHER], "response_format": {"type": "structural_tag", "structures": [], "triggers": []}},
     "response_format", "cannot be combined"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type", ""),
])
def test_bad_tools_are_400s_naming_the_field(api_server: ServerHandle, body: dict, param: str | None,
                                             message: str) -> None:
    r = httpx.post(api_server.base_url + "/v1/chat/completions", timeout=60,
                   json={"messages": ASK, "max_tokens": 5} | body)
    error = r.json()["error"]
    assert r.status_code == 400 and message in error["message"], r.text
    assert param is None or error["param"] == param, error


def test_langchain_bind_tools_loop_and_structured_output(api_server: ServerHandle, model: str) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return f"22 degrees and sunny in {city}"

    llm = ChatOpenAI(model=model, base_url=api_server.base_url + "/v1", api_key="unused", temperature=0,
                     max_tokens=60, max_retries=0)
    messages = [HumanMessage("What is the weather in Paris?")]
    asked = llm.bind_tools([get_weather], tool_choice="get_weather").invoke(messages)
    assert [c["name"] for c in asked.tool_calls] == ["get_weather"] and asked.tool_calls[0]["args"]["city"]
    messages += [asked] + [ToolMessage(get_weather.invoke(c["args"]), tool_call_id=c["id"])
                           for c in asked.tool_calls]
    answered = llm.bind_tools([get_weather]).invoke(messages)
    assert isinstance(answered.content, str)
    cached = answered.usage_metadata["input_token_details"]["cache_read"]
    assert cached >= asked.usage_metadata["input_tokens"], (asked.usage_metadata, answered.usage_metadata)

    class City(BaseModel):
        name: str = Field(max_length=20)
        country: str = Field(max_length=20)

    for method in ("json_schema", "function_calling"):
        city = llm.with_structured_output(City, method=method).invoke("Describe Paris.")
        assert isinstance(city, City), method


def test_the_openai_agents_sdk_runs_a_tool_loop(api_server: ServerHandle, model: str) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return f"22 degrees and sunny in {city}"

    async_client = AsyncOpenAI(base_url=api_server.base_url + "/v1", api_key="unused", max_retries=0)
    agent = Agent(name="weather", instructions="Answer weather questions with the weather tool.", tools=[weather],
                  model=OpenAIChatCompletionsModel(model=model, openai_client=async_client),
                  model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0,
                                               max_tokens=60))
    # NOTE: the SDK resets tool_choice to auto after a call, so the second turn may answer in text
    result = Runner.run_sync(agent, "What is the weather in Paris?", max_turns=4)
    assert calls and isinstance(result.final_output, str) and len(result.raw_responses) >= 2
    first, second = result.raw_responses[:2]
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens, \
        (first.usage, second.usage)
