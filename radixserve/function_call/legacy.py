"""OpenAI's legacy function calling, served as tools: a request's `functions` and `function_call` become `tools`
(each a function) and `tool_choice` (`"none"`, `"auto"`, or the named function), one call at most; its answer
comes back in the legacy shape, `message.function_call` (`delta.function_call` pieces when streamed) with
`finish_reason: "function_call"`. The history's legacy turns (an assistant `function_call`, a `function`
message) are read as tool calls and answers by entrypoints/chat_history.py."""

from __future__ import annotations

import dataclasses
from typing import Any

from radixserve.function_call.chat_tools import ToolError, ToolFields, ToolPlan, plan_tools
from radixserve.function_call.formats import ToolCallFormat

LEGACY_FIELDS = ToolFields(tools="functions", choice="function_call", name="functions.{i}.name")
_MODERN = {"functions": "tools", "function_call": "tool_choice"}


def plan_request_tools(fmt: ToolCallFormat, req: Any) -> ToolPlan | None:
    """A chat request's tool plan, from `tools` / `tool_choice` or from the legacy `functions` / `function_call`
    (never both: a ToolError naming the legacy field); None when it offers no tools."""
    legacy = [f for f in ("functions", "function_call") if getattr(req, f) is not None]
    if not legacy:
        return plan_tools(fmt, req.tools, req.tool_choice, req.parallel_tool_calls)
    modern = [f for f in ("tools", "tool_choice") if getattr(req, f) is not None]
    if modern:
        old = "function_call" if req.function_call is not None and req.tool_choice is not None else legacy[0]
        raise ToolError(f"'{old}' is the deprecated form of '{_MODERN[old]}' and cannot be combined with "
                        f"'{modern[0]}'; send 'tools' and 'tool_choice' only", old)
    choice = req.function_call
    if choice is not None and not isinstance(choice, str):
        choice = {"type": "function", "function": {"name": choice.name}}
    tools = [{"type": "function", "function": f.model_dump(exclude_none=True)} for f in req.functions or []]
    plan = plan_tools(fmt, tools, choice, False, LEGACY_FIELDS)  # NOTE: the legacy answer holds one call
    return dataclasses.replace(plan, legacy=True) if plan is not None else None


def legacy_reason(reason: str | None) -> str | None:
    """The legacy finish reason of a choice that called a function."""
    return "function_call" if reason == "tool_calls" else reason


def legacy_message(message: dict[str, Any]) -> dict[str, Any]:
    """A whole answer's fields (content, tool_calls) in the legacy shape (content, function_call: the first
    call; the plan's grammar allows only one)."""
    calls = message.get("tool_calls") or []
    call = dict(calls[0]["function"]) if calls else None
    return {"content": message["content"], "function_call": call}


def legacy_pieces(pieces: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """A stream delta's call pieces (StreamedCalls) as one legacy `function_call` piece: the name in the first
    (with its arguments so far), argument text after; pieces of a later call (none under the plan's grammar)
    are left out."""
    if not pieces:
        return None
    piece: dict[str, Any] = {}
    for p in pieces:
        if p["index"] != 0:
            continue
        if "name" in p["function"]:
            piece["name"] = p["function"]["name"]
        piece["arguments"] = piece.get("arguments", "") + (p["function"].get("arguments") or "")
    return piece or None
