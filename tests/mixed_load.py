"""A mixed, concurrent load against the real server, as users of several features at once send it.

`run_mixed_load` drives N streaming chat clients for a fixed time against one server: plain chat, `json_schema`
and tool requests (tool_choice `required`: a grammar), greedy and sampled, some disconnecting mid-stream, while a
bystander polls `/health`. It returns what each request ended as; the caller asserts (test_server_soak.py).
Every loop is bounded in count and time and talks to the loopback server only.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
import jsonschema

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0,
                                                                              "maximum": 120},
                         "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["red", "green", "blue"]}}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city", "unit"],
    "properties": {"city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
KINDS = ("plain", "json_schema", "tools")


@dataclass
class LoadReport:
    """What the requests of one run ended as."""

    finished: Counter = field(default_factory=Counter)  # kind -> requests answered in full
    disconnected: int = 0  # requests the client itself dropped mid-stream
    unexpected: list[str] = field(default_factory=list)  # errors or aborts the client did not ask for
    invalid: list[str] = field(default_factory=list)  # answers that do not match their grammar
    health_failures: int = 0
    health_polls: int = 0

    @property
    def total(self) -> int:
        return sum(self.finished.values()) + self.disconnected + len(self.unexpected)


def _body(kind: str, rng: random.Random, model: str) -> dict[str, Any]:
    who = rng.choice(["a pirate", "a baker", "a pilot", "Ada", "a cat"])
    body: dict[str, Any] = {"model": model, "stream": True, "max_tokens": rng.choice([24, 48, 96]),
                            "temperature": rng.choice([0.0, 0.7]), "messages": [
                                {"role": "user", "content": f"Describe {who} as JSON, then say it again: "
                                                            f"{who} {who} {who}."}]}
    if kind == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    elif kind == "tools":
        body["messages"][0]["content"] = f"What is the weather where {who} lives?"
        body["tools"] = [WEATHER]
        body["tool_choice"] = "required"
    return body


def _check(kind: str, text: str, calls: dict[int, dict[str, str]], finish: str | None) -> str | None:
    """Why a complete answer is invalid for its kind, or None."""
    if kind == "json_schema" and finish == "stop":
        try:
            jsonschema.validate(json.loads(text), PERSON)
        except (ValueError, jsonschema.ValidationError) as e:
            return f"json_schema answer {text!r}: {e}"[:300]
    if kind == "tools" and finish in ("stop", "tool_calls"):
        if not calls:
            return f"tool_choice required gave no call: {text!r}"[:300]
        for call in calls.values():
            try:
                jsonschema.validate(json.loads(call["arguments"]), WEATHER["function"]["parameters"])
            except (ValueError, jsonschema.ValidationError) as e:
                return f"tool call {call}: {e}"[:300]
    return None


async def _one(client: httpx.AsyncClient, kind: str, rng: random.Random, model: str, disconnect: bool,
               report: LoadReport) -> None:
    text, calls, finish, chunks = "", {}, None, 0
    stop_after = rng.randint(1, 8)
    try:
        async with client.stream("POST", "/v1/chat/completions", json=_body(kind, rng, model)) as r:
            if r.status_code != 200:
                report.unexpected.append(f"{kind}: HTTP {r.status_code} {(await r.aread())[:200]!r}")
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    report.unexpected.append(f"{kind}: {json.dumps(event['error'])[:300]}")
                    return
                chunks += 1
                if disconnect and chunks >= stop_after:
                    report.disconnected += 1
                    return  # NOTE: leaving the block closes the connection: the server aborts the request
                for choice in event.get("choices", []):
                    delta = choice.get("delta") or {}
                    text += delta.get("content") or ""
                    for call in delta.get("tool_calls") or []:
                        slot = calls.setdefault(call.get("index", 0), {"name": "", "arguments": ""})
                        fn = call.get("function") or {}
                        slot["name"] += fn.get("name") or ""
                        slot["arguments"] += fn.get("arguments") or ""
                    finish = choice.get("finish_reason") or finish
    except httpx.HTTPError as e:
        report.unexpected.append(f"{kind}: {type(e).__name__}: {e}"[:300])
        return
    if disconnect and chunks < stop_after:
        report.disconnected += 1  # NOTE: it ended before the client dropped it
    problem = _check(kind, text, calls, finish)
    if problem is not None:
        report.invalid.append(problem)
    report.finished[kind] += 1


async def _client_loop(base_url: str, headers: dict[str, str], seed: int, deadline: float, model: str,
                       disconnect_share: float, report: LoadReport) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=120.0) as client:
        while time.monotonic() < deadline:
            await _one(client, rng.choice(KINDS), rng, model, rng.random() < disconnect_share, report)


async def _bystander(base_url: str, deadline: float, report: LoadReport) -> None:
    async with httpx.AsyncClient(base_url=base_url, timeout=10.0) as client:
        while time.monotonic() < deadline:
            try:
                ok = (await client.get("/health")).status_code == 200
            except httpx.HTTPError:
                ok = False
            report.health_polls += 1
            report.health_failures += not ok
            await asyncio.sleep(0.1)


def run_mixed_load(base_url: str, model: str, clients: int = 32, seconds: float = 45.0,
                   disconnect_share: float = 0.25, headers: dict[str, str] | None = None, seed: int = 0) -> LoadReport:
    """`clients` streaming chat clients for `seconds` (each finishes the request it is in), plus a /health poller."""
    report = LoadReport()

    async def main() -> None:
        deadline = time.monotonic() + seconds
        await asyncio.gather(_bystander(base_url, deadline, report),
                             *(_client_loop(base_url, headers or {}, seed * 1000 + i, deadline, model,
                                            disconnect_share, report) for i in range(clients)))

    asyncio.run(main())
    return report
