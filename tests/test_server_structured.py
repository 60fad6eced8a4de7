"""Structured outputs through the real server: OpenAI `response_format` (the openai client's `parse` with a
pydantic model, json_object, json_schema) on /v1/chat/completions and /v1/completions, the native
`json_schema`/`regex`/`ebnf`, and a bad grammar as a 400 naming the field; conservation after each test."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field
from server_harness import ServerHandle

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "Describe Paris: its name, country and population in millions."}]


class City(BaseModel):
    # NOTE: bounded strings: given an unbounded one, the 135M model may write it until max_tokens
    name: str = Field(max_length=24)
    country: str = Field(max_length=24)
    population_millions: int = Field(ge=0, le=100)


def test_the_openai_client_parses_a_pydantic_model(api_client: OpenAI) -> None:
    model = api_client.models.list().data[0].id
    done = api_client.chat.completions.parse(model=model, messages=QUESTION, response_format=City, max_tokens=120,
                                         temperature=0)
    city = done.choices[0].message.parsed
    assert isinstance(city, City) and done.choices[0].finish_reason == "stop"


def test_json_object_and_json_schema_on_chat_and_completions(api_server: ServerHandle) -> None:
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                               "confidence": {"type": "integer", "minimum": 0, "maximum": 100}},
              "required": ["answer", "confidence"], "additionalProperties": False}
    formats = [{"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "a", "schema": schema,
                                                                                 "strict": True}}]
    for fmt in formats:
        chat = httpx.post(api_server.base_url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "Is the sky blue? Answer in JSON."}], "max_tokens": 80,
            "temperature": 0.8, "seed": 4, "n": 2, "response_format": fmt}).json()
        completion = httpx.post(api_server.base_url + "/v1/completions", timeout=120, json={
            "prompt": "Is the sky blue? JSON:", "max_tokens": 80, "temperature": 0, "response_format": fmt}).json()
        answers = [(c["message"]["content"], c["finish_reason"]) for c in chat["choices"]] + \
            [(completion["choices"][0]["text"], completion["choices"][0]["finish_reason"])]
        # NOTE: any JSON object may run past max_tokens (sampled, the 135M model can write one without end); the
        # bounded schema always ends
        finished = [text for text, reason in answers if reason == "stop"]
        assert finished and (fmt["type"] == "json_object" or len(finished) == len(answers)), answers
        for text in finished:
            value = json.loads(text)
            assert isinstance(value, dict)
            if fmt["type"] == "json_schema":
                jsonschema.validate(value, schema)


def test_native_generate_regex_and_streaming_ebnf(api_server: ServerHandle) -> None:
    r = httpx.post(api_server.base_url + "/generate", timeout=120, json={
        "text": "A phone number:", "sampling_params": {"regex": r"\+33 [0-9]{9}", "max_new_tokens": 20}})
    assert r.status_code == 200 and re.fullmatch(r"\+33 [0-9]{9}", r.json()["text"])
    text = ""
    with httpx.stream("POST", api_server.base_url + "/generate", timeout=120, json={
            "text": "Pick a colour:", "stream": True,
            "sampling_params": {"ebnf": 'root ::= "colour: " ("red" | "green" | "blue")', "max_new_tokens": 10}}) as s:
        for line in s.iter_lines():
            if line.startswith("data:") and line != "data: [DONE]":
                text = json.loads(line[5:])["text"]
    assert text in ("colour: red", "colour: green", "colour: blue")


def test_response_format_structural_tag(api_server: ServerHandle) -> None:
    answer = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}
    fmt = {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["<answer>"], "at_least_one": True, "stop_after_first": True,
        "tags": [{"type": "tag", "begin": "<answer>", "content": {"type": "json_schema", "json_schema": answer},
                  "end": "</answer>"}]}}
    r = httpx.post(api_server.base_url + "/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "Capital of France?"}], "max_tokens": 60, "temperature": 0,
        "response_format": fmt})
    assert r.status_code == 200, r.text
    tagged = re.fullmatch(r"(?s).*?<answer>(.*?)</answer>", r.json()["choices"][0]["message"]["content"])
    assert tagged is not None and json.loads(tagged.group(1))["city"] in ("Paris", "Rome")


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/generate", {"text": "x", "sampling_params": {"regex": "(unclosed"}}, "regex"),
    ("/generate", {"text": "x", "sampling_params": {"json_schema": "{nope"}}, "json_schema"),
    ("/generate", {"text": "x", "sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}}, "ebnf"),
    ("/v1/chat/completions", {"messages": QUESTION, "response_format": {"type": "json_schema"}}, "response_format"),
    ("/v1/chat/completions", {"messages": QUESTION, "response_format": {"type": "xml"}}, "response_format"),
    ("/v1/chat/completions", {"messages": QUESTION, "response_format": {"type": "structural_tag"}}, "response_format"),
    ("/generate", {"text": "x", "sampling_params": {"structural_tag": "[1, 2]"}}, "structural_tag"),
])
def test_a_bad_grammar_is_a_400_naming_the_field(api_server: ServerHandle, path: str, body: dict, param: str) -> None:
    r = httpx.post(api_server.base_url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert param in r.text
