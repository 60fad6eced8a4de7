"""The tool calls and answers of a chat's history, checked before the chat template renders them.

A history is refused (400, the error naming the field as `messages.3.tool_call_id`) when:

- a `tool` message has no `tool_call_id`, or one that names no call of the assistant turn right before it
  (only tool answers may come between: OpenAI's rule);
- a call's `function.arguments` is not a JSON object as text;
- the request declares tools (`tools` or the legacy `functions`) and a call names another function;
- two calls of one assistant turn share an `id`;
- `tool_calls` or `function_call` is on a message that is not an assistant's, `tool_call_id` on one that is not
  a tool answer, or an assistant message has both `tool_calls` and `function_call`;
- a legacy `function` message has no `name`, or one that no call of the assistant turn right before it names.

The legacy turns come back as tool ones: an assistant's `function_call` as a tool call, a `function` message as
the tool answer to it; so the chat template and the radix cache see one shape of history.
"""

from __future__ import annotations

import json
from collections.abc import Collection

from radixserve.entrypoints.http_errors import ApiError, bad_request
from radixserve.entrypoints.openai_protocol import ChatMessage
from radixserve.entrypoints.tool_protocol import FunctionCall, ToolCall


def check_history(chat: list[ChatMessage], declared: Collection[str] | None) -> list[ChatMessage]:
    """Checks `chat`'s calls and answers (`declared`: the names of the request's tools, None without tools) and
    returns it with its legacy turns as tool ones; a fault is a 400 naming the field."""
    out: list[ChatMessage] = []
    # the calls of the assistant turn that the following answers may answer, by id and by name (the first)
    # NOTE: dicts, so a turn of many calls and many answers costs their number, not its product
    by_id: dict[str, ToolCall] = {}
    by_name: dict[str, ToolCall] = {}
    for i, m in enumerate(chat):
        at = f"messages.{i}"
        _check_roles(m, at)
        if m.role == "tool":
            if m.tool_call_id is None or m.tool_call_id not in by_id:
                raise _fault(f"{at}.tool_call_id", _unanswered(m.tool_call_id, "id"))
            out.append(m)
        elif m.role == "function":
            call = by_name.get(m.name) if m.name is not None else None
            if call is None:
                raise _fault(f"{at}.name", _unanswered(m.name, "function name"))
            out.append(m.model_copy(update={"role": "tool", "tool_call_id": call.id, "name": None}))
        else:
            calls = _calls(m, i, declared)
            by_id = {c.id: c for c in calls if c.id is not None}
            by_name = {}
            for c in calls:
                by_name.setdefault(c.function.name, c)
            out.append(m.model_copy(update={"tool_calls": calls, "function_call": None}) if m.function_call else m)
    return out


def _check_roles(m: ChatMessage, at: str) -> None:
    if m.tool_calls and m.role != "assistant":
        raise _fault(f"{at}.tool_calls", "only an assistant message can hold 'tool_calls'")
    if m.function_call is not None:
        if m.role != "assistant":
            raise _fault(f"{at}.function_call", "only an assistant message can hold 'function_call'")
        if m.tool_calls:
            raise _fault(f"{at}.function_call", "an assistant message holds 'tool_calls' or the legacy "
                                                "'function_call', not both")
    if m.tool_call_id is not None and m.role != "tool":
        raise _fault(f"{at}.tool_call_id", "only a tool message answers a call ('tool_call_id')")


def _calls(m: ChatMessage, i: int, declared: Collection[str] | None) -> list[ToolCall]:
    """An assistant turn's calls, checked (a legacy call as a tool call with an id of its own)."""
    if m.function_call is not None:
        _check_call(m.function_call, f"messages.{i}.function_call", declared)
        return [ToolCall(id=f"call_legacy_{i}", function=m.function_call)]
    seen: set[str] = set()
    for j, call in enumerate(m.tool_calls or []):
        at = f"messages.{i}.tool_calls.{j}"
        _check_call(call.function, f"{at}.function", declared)
        if call.id is not None:
            if call.id in seen:
                raise _fault(f"{at}.id", f"two calls of this message have the id {_shown(call.id)}")
            seen.add(call.id)
    return list(m.tool_calls or [])


def _check_call(call: FunctionCall, at: str, declared: Collection[str] | None) -> None:
    if declared is not None and call.name not in declared:
        raise _fault(f"{at}.name", f"calls the function {_shown(call.name)}, which the request does not declare "
                                   "in its tools")
    try:
        arguments = json.loads(call.arguments)
    except RecursionError:  # NOTE: the body's nesting limit does not see inside a string
        raise _fault(f"{at}.arguments", "must be a JSON object as text; it nests too deep") from None
    except ValueError as e:
        raise _fault(f"{at}.arguments", f"must be a JSON object as text; it is not JSON ({e})") from None
    if not isinstance(arguments, dict):
        raise _fault(f"{at}.arguments", f"must be a JSON object as text, got a JSON {type(arguments).__name__}")


def _unanswered(value: str | None, what: str) -> str:
    if value is None:
        return f"is missing: the message must give the {what} of the call it answers"
    return (f"{_shown(value)} names no call of the assistant message before it (a tool answer follows the "
            "assistant message that made the call, or other answers to it)")


def _fault(param: str, message: str) -> ApiError:
    return bad_request(f"'{param}' {message}", param=param, code="invalid_value")


def _shown(text: str, limit: int = 64) -> str:
    """A client's string in an error, quoted and cut short."""
    return json.dumps(text[:limit] + ("..." if len(text) > limit else ""))
