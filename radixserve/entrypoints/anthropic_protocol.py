"""Anthropic's Messages API (the subset radixserve serves): the request models, their bounds, and the
translation of a Messages request into the server's own chat request (openai_protocol.ChatCompletionRequest),
so `/v1/messages` runs through the one chat path (serving_anthropic.py; docs/server.md, "Anthropic Messages API").

Scalar fields validate with pydantic (strict); `system`, `messages`, `tools` and `tool_choice` are walked here
by hand, so an unsupported block (an image, a document) or a server tool is a 400 naming the exact field
(`messages.2.content.1.type`). `thinking` and replayed thinking blocks: anthropic_thinking.py.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from pydantic import ConfigDict, ValidationError

from radixserve.entrypoints.anthropic_thinking import THINKING_BLOCKS, check_replayed, thinking_fields
from radixserve.entrypoints.http_errors import (
    ApiError,
    bad_request,
    check_strings,
    parse_json,
    validation_error,
)
from radixserve.entrypoints.openai_protocol import ChatCompletionRequest
from radixserve.entrypoints.protocol_base import RequestModel
from radixserve.frontend.request_bounds import BoundError, RequestBounds, check_fields
from radixserve.sampling_params import MAX_STOP_STRINGS

MAX_TOOLS = 128  # tools of one request (fixed)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class _Strict(RequestModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class CountTokensRequest(_Strict):
    """`/v1/messages/count_tokens`: what the prompt is made of."""

    model: str
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None  # accepted: the radix cache reuses every shared prefix unasked
    thinking: Any = None  # checked by anthropic_thinking.thinking_fields (400s naming `thinking.<field>`)


class MessagesRequest(CountTokensRequest):
    """`/v1/messages`: a prompt and how to sample its answer."""

    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    metadata: dict[str, Any] | None = None  # accepted: `user_id` is the chat request's `user`
    stream: bool = False


def decode_messages(raw: bytes, model: type[CountTokensRequest], bounds: RequestBounds) -> CountTokensRequest:
    """Parses, bounds (before validation, request_bounds.py and `check_bounds`) and validates a body; CPU work
    for a parser process (TokenizerManager.run_parse), as http_errors.decode_body."""
    data = parse_json(raw)
    if not isinstance(data, dict):
        raise bad_request(f"request body must be a JSON object, got {type(data).__name__}", code="invalid_json")
    for name in data:
        if name not in model.model_fields:
            raise bad_request(f"'{name}' is not supported by this server's Messages API", param=name,
                              code="unsupported_parameter")
    try:
        check_fields(data, bounds)
        check_bounds(data, bounds)
    except BoundError as e:
        raise bad_request(str(e), param=e.param, code="over_limit") from None
    if _SURROGATE_ESCAPE.search(raw):
        check_strings(data)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None


def check_bounds(data: dict[str, Any], bounds: RequestBounds) -> None:
    """The Messages API's own lists (check_fields bounds `messages`): every content block of the request (system,
    messages, tool results) at most --max-chat-messages in all, `tools`, `stop_sequences`, `metadata.user_id`."""
    blocks = _size(data.get("system"))
    for m in data.get("messages") or []:
        content = m.get("content") if isinstance(m, dict) else None
        blocks += _size(content)
        for block in content if isinstance(content, list) else []:
            blocks += _size(block.get("content")) if isinstance(block, dict) else 0
    _bound(blocks, bounds.max_chat_messages, "messages", "content blocks", "--max-chat-messages")
    _bound(_size(data.get("tools")), MAX_TOOLS, "tools", "tools", "fixed")
    stops = data.get("stop_sequences")
    stops = stops if isinstance(stops, list) else []
    _bound(len(stops), MAX_STOP_STRINGS, "stop_sequences", "stop sequences", "fixed")
    longest = max((len(s) for s in stops if isinstance(s, str)), default=0)
    _bound(longest, bounds.max_stop_string_chars, "stop_sequences", "characters in a stop sequence",
           "--max-stop-string-chars")
    metadata = data.get("metadata")
    user = metadata.get("user_id") if isinstance(metadata, dict) else None
    _bound(len(user) if isinstance(user, str) else 0, bounds.max_id_chars, "metadata.user_id", "characters",
           "--max-id-chars")


def _size(value: Any) -> int:
    return len(value) if isinstance(value, list) else 0


def _bound(size: int, limit: int, param: str, what: str, flag: str) -> None:
    if size > limit:
        raise BoundError(param, f"'{param}' has {size} {what}; the server takes at most {limit} ({flag})")


# ------------------------------------------------------------------------------------------ translation


@dataclass
class Translated:
    """The chat request a Messages request means, and where each of its messages came from (`origin[k]`: the
    Anthropic path of chat message k), so an error the chat path raises names the client's field."""

    chat: ChatCompletionRequest
    origin: list[str]

    def param(self, param: str | None) -> str | None:
        """An error's chat-request field as the Messages request's field."""
        return _remap(self.origin, param)


def _remap(origin: list[str], param: str | None) -> str | None:
    if param is None:
        return None
    head, _, rest = param.partition(".")
    if head == "messages" and rest:
        index = rest.partition(".")[0]
        if index.isdigit() and int(index) < len(origin):
            return origin[int(index)]
    renames = {"stop": "stop_sequences", "user": "metadata.user_id", "max_completion_tokens": "max_tokens",
               "thinking_budget": "thinking.budget_tokens", "separate_reasoning": "thinking"}
    if head in renames:
        return renames[head]
    if head == "tools":  # tools.N.function.parameters -> tools.N.input_schema
        return param.replace(".function.parameters", ".input_schema").replace(".function.name", ".name")
    if head == "tool_choice":
        return "tool_choice"
    return param


def translate(req: CountTokensRequest, reasoning: bool = False) -> Translated:
    """The chat request of `req` (sampling fields only when it is a MessagesRequest); a 400 naming the field for
    what the Messages API has and this server does not serve; `reasoning`: the server runs a reasoning parser."""
    messages, origin = [], []
    system = _system_text(req.system)
    if system is not None:
        messages.append({"role": "system", "content": system})
        origin.append("system")
    calls: set[str] = set()  # the tool_use ids of the assistant message just before
    for i, m in enumerate(req.messages):
        at = f"messages.{i}"
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise bad_request(f"'{at}.role' must be 'user' or 'assistant', got {_shown(role)}", param=f"{at}.role")
        unknown = set(m) - {"role", "content"}
        if unknown:
            name = sorted(unknown)[0]
            raise bad_request(f"'{at}.{name}' is not a field of a message", param=f"{at}.{name}",
                              code="unsupported_parameter")
        content = m.get("content")
        if role == "assistant":
            message, calls = _assistant(content, at)
            messages.append(message)
            origin.append(at)
        else:
            for message, where in _user(content, at, calls):
                messages.append(message)
                origin.append(where)
            calls = set()
    if req.messages and req.messages[-1].get("role") == "assistant":
        at = f"messages.{len(req.messages) - 1}"
        raise bad_request(f"'{at}': a last assistant message (a prefill to continue) is not supported; end with a "
                          "user message", param=at, code="unsupported_parameter")
    fields: dict[str, Any] = {"model": req.model, "messages": messages}
    fields |= _tools(req.tools, req.tool_choice)
    fields |= thinking_fields(req.thinking, req.max_tokens if isinstance(req, MessagesRequest) else None, reasoning)
    if isinstance(req, MessagesRequest):
        if req.max_tokens < 1:
            raise bad_request(f"'max_tokens' must be at least 1, got {req.max_tokens}", param="max_tokens",
                              code="invalid_value")
        user = (req.metadata or {}).get("user_id")
        if user is not None and not isinstance(user, str):
            raise bad_request("'metadata.user_id' must be a string", param="metadata.user_id")
        fields |= {"max_tokens": req.max_tokens, "temperature": req.temperature, "top_p": req.top_p,
                   "top_k": req.top_k, "stop": req.stop_sequences, "stream": req.stream, "user": user}
    try:
        chat = ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:
        error = validation_error(e)
        raise anthropic_error(error, origin) from None
    return Translated(chat, origin)


def _shown(value: Any, limit: int = 64) -> str:
    text = json.dumps(value) if not isinstance(value, str) else json.dumps(value[:limit])
    return text[:limit + 2]


def _block_type(block: Any, at: str) -> str:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise bad_request(f"'{at}' must be a content block object with a 'type'", param=at)
    return block["type"]


def _text_block(block: Any, at: str) -> str:
    """The text of a `{"type": "text", "text": ...}` block (`cache_control` and `citations` accepted)."""
    kind = _block_type(block, at)
    if kind != "text":
        raise bad_request(f"'{at}.type': content blocks of type {_shown(kind)} are not supported here; this "
                          "server takes text blocks", param=f"{at}.type", code="unsupported_content")
    if not isinstance(block.get("text"), str):
        raise bad_request(f"'{at}.text' must be a string", param=f"{at}.text")
    _only(block, at, {"type", "text", "cache_control", "citations"})
    return block["text"]


def _only(block: dict[str, Any], at: str, allowed: set[str]) -> None:
    unknown = sorted(set(block) - allowed)
    if unknown:
        raise bad_request(f"'{at}.{unknown[0]}' is not supported in this block", param=f"{at}.{unknown[0]}",
                          code="unsupported_parameter")


def _system_text(system: str | list[dict[str, Any]] | None) -> str | None:
    if system is None or isinstance(system, str):
        return system or None
    return "\n\n".join(_text_block(b, f"system.{j}") for j, b in enumerate(system)) or None


def _assistant(content: Any, at: str) -> tuple[dict[str, Any], set[str]]:
    """An assistant message: its text, and its tool_use blocks as tool calls (arguments: the input as JSON)."""
    if isinstance(content, str):
        return {"role": "assistant", "content": content}, set()
    if not isinstance(content, list):
        raise bad_request(f"'{at}.content' must be a string or a list of content blocks", param=f"{at}.content")
    texts, calls = [], []
    for j, block in enumerate(content):
        where = f"{at}.content.{j}"
        kind = _block_type(block, where)
        if kind in THINKING_BLOCKS:  # NOTE: dropped, as reasoning templates drop earlier turns' reasoning
            check_replayed(block, where)
            continue
        if kind != "tool_use":
            texts.append(_text_block(block, where))
            continue
        _only(block, where, {"type", "id", "name", "input", "cache_control"})
        for name, kind in (("id", str), ("name", str), ("input", dict)):
            if not isinstance(block.get(name), kind):
                raise bad_request(f"'{where}.{name}' must be a {'string' if kind is str else 'JSON object'}",
                                  param=f"{where}.{name}")
        if any(c["id"] == block["id"] for c in calls):
            raise bad_request(f"'{where}.id': two tool_use blocks of this message have the id {_shown(block['id'])}",
                              param=f"{where}.id")
        calls.append({"id": block["id"], "type": "function", "function": {
            "name": block["name"], "arguments": json.dumps(block["input"], ensure_ascii=False)}})
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
    if calls:
        message["tool_calls"] = calls
    return message, {c["id"] for c in calls}


def _user(content: Any, at: str, calls: set[str]) -> list[tuple[dict[str, Any], str]]:
    """A user message: its tool_result blocks first (each a tool message), then its text as one user message."""
    if isinstance(content, str):
        return [({"role": "user", "content": content}, at)]
    if not isinstance(content, list):
        raise bad_request(f"'{at}.content' must be a string or a list of content blocks", param=f"{at}.content")
    out: list[tuple[dict[str, Any], str]] = []
    texts: list[str] = []
    for j, block in enumerate(content):
        where = f"{at}.content.{j}"
        if _block_type(block, where) != "tool_result":
            texts.append(_text_block(block, where))
            continue
        # NOTE: a tool answer must follow the assistant turn that made the call (chat_history.py): so the
        # tool_result blocks of a user message come first, as Anthropic requires too
        if texts:
            raise bad_request(f"'{where}': tool_result blocks must come before any text in a message",
                              param=where)
        _only(block, where, {"type", "tool_use_id", "content", "is_error", "cache_control"})
        call_id = block.get("tool_use_id")
        if not isinstance(call_id, str) or call_id not in calls:
            raise bad_request(f"'{where}.tool_use_id' {_shown(call_id)} names no tool_use block of the assistant "
                              "message just before", param=f"{where}.tool_use_id")
        result = block.get("content", "")
        if isinstance(result, list):
            result = "\n\n".join(_text_block(b, f"{where}.content.{k}") for k, b in enumerate(result))
        elif not isinstance(result, str):
            raise bad_request(f"'{where}.content' must be a string or a list of text blocks",
                              param=f"{where}.content")
        is_error = block.get("is_error", False)
        if not isinstance(is_error, bool):
            raise bad_request(f"'{where}.is_error' must be a boolean", param=f"{where}.is_error")
        out.append(({"role": "tool", "tool_call_id": call_id,
                     "content": f"Error: {result}" if is_error else result}, where))
    if texts or not out:
        out.append(({"role": "user", "content": "".join(texts)}, at))
    return out


def _tools(tools: list[dict[str, Any]] | None, choice: dict[str, Any] | None) -> dict[str, Any]:
    """`tools` and `tool_choice` as the chat request's (custom tools only; server tools are refused)."""
    out: dict[str, Any] = {}
    if tools is not None:
        specs = []
        for i, tool in enumerate(tools):
            at = f"tools.{i}"
            if not isinstance(tool, dict):
                raise bad_request(f"'{at}' must be a tool object", param=at)
            if tool.get("type", "custom") != "custom":
                raise bad_request(f"'{at}.type': {_shown(tool.get('type'))} (a server tool) is not supported; "
                                  "give custom tools with 'name' and 'input_schema'", param=f"{at}.type",
                                  code="unsupported_tool")
            _only(tool, at, {"type", "name", "description", "input_schema", "cache_control"})
            if not isinstance(tool.get("name"), str):
                raise bad_request(f"'{at}.name' must be a string", param=f"{at}.name")
            if not isinstance(tool.get("input_schema"), dict):
                raise bad_request(f"'{at}.input_schema' must be a JSON schema object", param=f"{at}.input_schema")
            description = tool.get("description")
            if description is not None and not isinstance(description, str):
                raise bad_request(f"'{at}.description' must be a string", param=f"{at}.description")
            specs.append({"type": "function", "function": {"name": tool["name"], "description": description,
                                                           "parameters": tool["input_schema"]}})
        out["tools"] = specs
    if choice is not None:
        kind = choice.get("type")
        allowed = {"auto": {"type", "disable_parallel_tool_use"}, "any": {"type", "disable_parallel_tool_use"},
                   "tool": {"type", "name", "disable_parallel_tool_use"}, "none": {"type"}}
        if kind not in allowed:
            raise bad_request(f"'tool_choice.type' must be auto, any, tool or none, got {_shown(kind)}",
                              param="tool_choice.type")
        _only(choice, "tool_choice", allowed[kind])
        if kind == "tool" and not isinstance(choice.get("name"), str):
            raise bad_request("'tool_choice.name' must name a tool", param="tool_choice.name")
        parallel = choice.get("disable_parallel_tool_use", False)
        if not isinstance(parallel, bool):
            raise bad_request("'tool_choice.disable_parallel_tool_use' must be a boolean",
                              param="tool_choice.disable_parallel_tool_use")
        out["parallel_tool_calls"] = not parallel
        out["tool_choice"] = ({"type": "function", "function": {"name": choice["name"]}} if kind == "tool"
                              else {"auto": "auto", "any": "required", "none": "none"}[kind])
    return out


# ------------------------------------------------------------------------------------------------ errors

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error shape: `{"type": "error", "error": {"type", "message"}}`."""
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"), "message": message}}


def anthropic_error(e: ApiError, origin: list[str] | None = None) -> ApiError:
    """`e` in Anthropic's shape (the same status and headers), its field renamed to the Messages request's
    (`origin`: Translated.origin)."""
    message, param = e.message, e.param
    if origin is not None and e.param is not None:
        param = _remap(origin, e.param)
        if param != e.param:
            message = message.replace(f"'{e.param}'", f"'{param}'")
            if f"'{param}'" not in message:
                message = f"'{param}': {message}"
    return AnthropicError(e.status, message, param=param, headers=e.headers)


class AnthropicError(ApiError):
    """An ApiError answered in Anthropic's shape."""

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message)
