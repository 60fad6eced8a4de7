"""A chat choice's text as OpenAI's message: content and `tool_calls`, whole or as stream deltas."""

from __future__ import annotations

from typing import Any

from radixserve.function_call.chat_tools import ToolPlan
from radixserve.function_call.legacy import legacy_message, legacy_pieces, legacy_reason
from radixserve.function_call.parser import CallDelta, ToolCallParser


def finish_reason(reason: str | None, parser: ToolCallParser) -> str | None:
    """A choice that stopped after calling tools finished with `tool_calls` (OpenAI's reason)."""
    return "tool_calls" if reason == "stop" and parser.calls else reason


def whole_message(plan: ToolPlan, text: str, reason: str | None) -> tuple[dict[str, Any], str | None]:
    """The message fields (content, tool_calls; for a legacy plan content, function_call) of a finished choice,
    and its finish reason."""
    parser = ToolCallParser(plan.fmt)
    content = parser.feed(text).content + parser.finish().content
    calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
             for c in parser.calls]
    message = {"content": content or (None if calls else ""), "tool_calls": calls or None}
    if plan.legacy:
        return legacy_message(message), legacy_reason(finish_reason(reason, parser))
    return message, finish_reason(reason, parser)


class StreamedCalls:
    """Per choice of a streamed answer: its parser; `delta` turns text into the delta's fields."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self._parsers: dict[int, ToolCallParser] = {}

    def delta(self, index: int, text: str, reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The delta's `content` and `tool_calls` pieces (a legacy plan: `function_call` piece), and the finish
        reason."""
        parser = self._parsers.setdefault(index, ToolCallParser(self.plan.fmt))
        out = parser.feed(text)
        content, calls = out.content, out.calls
        if reason is not None:
            tail = parser.finish()
            content, calls = content + tail.content, calls + tail.calls
            reason = finish_reason(reason, parser)
        pieces = [_delta(c) for c in calls] or None
        if self.plan.legacy:
            return {"content": content or None, "function_call": legacy_pieces(pieces)}, legacy_reason(reason)
        return {"content": content or None, "tool_calls": pieces}, reason


def _delta(call: CallDelta) -> dict[str, Any]:
    piece: dict[str, Any] = {"index": call.index, "function": {"arguments": call.arguments}}
    if call.id is not None:
        piece |= {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return piece
