"""Pydantic models of chat tool calls: OpenAI's `tools` and `tool_choice`, the legacy `functions` and
`function_call` (served as tools: function_call/legacy.py), calls sent back in a chat's history, and the calls
of an answer, whole and streamed (docs/structured_outputs.md)."""

from __future__ import annotations

from typing import Any, Literal

from radixserve.entrypoints.protocol_base import RequestModel, ResponseModel

# ---------------------------------------------------------------------------------------- requests


class FunctionDefinition(RequestModel):
    """A function the model may call: an entry of `tools` (inside `function`) or of the legacy `functions`."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None  # accepted; the grammar always enforces the parameters' schema


class ToolDefinition(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(RequestModel):
    """A forced function: inside a named `tool_choice`, or the legacy `function_call: {"name": ...}`."""

    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
LegacyFunctionChoice = Literal["none", "auto"] | FunctionName  # the legacy `function_call` of a request


class FunctionCall(RequestModel):
    """A call of an earlier assistant turn: inside a tool call, or the legacy `function_call` of the message."""

    name: str
    arguments: str  # JSON text, as the model wrote it; must hold a JSON object (entrypoints/chat_history.py)


class ToolCall(RequestModel):
    """A call of an earlier assistant turn, sent back in the history."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


# --------------------------------------------------------------------------------------- responses


class FunctionCallOut(ResponseModel):
    """A call in an answer: inside a tool call, or the legacy `message.function_call`."""

    name: str
    arguments: str


class ToolCallOut(ResponseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class DeltaFunctionCall(ResponseModel):
    """A piece of a streamed call (or of the legacy `delta.function_call`): the name first, then argument text."""

    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(ResponseModel):
    """A piece of a streamed call: the first has `id`, `type` and the name, later ones argument text."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall
