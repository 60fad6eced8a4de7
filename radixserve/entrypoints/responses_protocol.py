"""The OpenAI Responses API's request, checked and translated into the server's chat request, and its answer.

`ResponsesRequest` validates the top level; `input` items, `tools`, `tool_choice` and `text.format` are checked
here one by one, so every refusal is a 400 naming the field as the client wrote it (`input.2.content.0.type`,
`tools.1.type`). `chat_body` turns the request into the JSON body of a `ChatCompletionRequest` (serving_responses
runs it through the chat path: one generation path). The `*_item` and `response_body` builders give the shapes
the `openai` SDK parses (openai/types/responses/).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from radixserve.entrypoints.http_errors import ApiError, bad_request
from radixserve.entrypoints.protocol_base import RequestModel
from radixserve.mem_cache.tiers import tier_details

# NOTE: OpenAI's metadata bounds: 16 pairs, keys of 64 characters, values of 512
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
MAX_TOOLS = 128
MAX_PARTS = 1024  # content parts of one message
_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(RequestModel):
    """POST /v1/responses; items and tools stay plain JSON here and are checked by `parse_input` / `parse_tools`
    (bounded first: a count check costs nothing, a pydantic object per item does)."""

    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    parallel_tool_calls: bool | None = None
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    stream: bool = False
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    reasoning: Any = None
    # radixserve's extensions, as on chat: a think-block budget in tokens (instead of reasoning.effort), and
    # generation past the end-of-sequence token
    thinking_budget: int | None = None
    ignore_eos: bool = False


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def check_bounds(req: ResponsesRequest, max_items: int, max_id_chars: int) -> None:
    """The sizes of the list and map fields, before any item is read."""
    if isinstance(req.input, list) and len(req.input) > max_items:
        raise bad_request(f"'input' has {len(req.input)} items; the server takes at most {max_items} "
                          "(--max-chat-messages)", param="input", code="over_limit")
    if req.tools is not None and len(req.tools) > MAX_TOOLS:
        raise bad_request(f"'tools' has {len(req.tools)} entries; the server takes at most {MAX_TOOLS}",
                          param="tools", code="over_limit")
    for name in ("previous_response_id", "user"):
        value = getattr(req, name)
        if value is not None and len(value) > max_id_chars:
            raise bad_request(f"'{name}' has {len(value)} characters; the server takes at most {max_id_chars} "
                              "(--max-id-chars)", param=name, code="over_limit")
    for name in ("background", "conversation", "prompt"):
        if getattr(req, name):
            raise bad_request(f"'{name}' is not supported by this server", param=name, code="unsupported_parameter")
    if req.metadata is not None:
        if len(req.metadata) > MAX_METADATA_PAIRS:
            raise bad_request(f"'metadata' has {len(req.metadata)} pairs; at most {MAX_METADATA_PAIRS}",
                              param="metadata", code="over_limit")
        for k, v in req.metadata.items():
            if len(k) > MAX_METADATA_KEY_CHARS or not isinstance(v, str) or len(v) > MAX_METADATA_VALUE_CHARS:
                raise bad_request(f"'metadata' keys are strings of at most {MAX_METADATA_KEY_CHARS} characters and "
                                  f"values strings of at most {MAX_METADATA_VALUE_CHARS}", param=f"metadata.{k[:64]}",
                                  code="invalid_value")


# ------------------------------------------------------------------------------------------ input items


def _fault(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return bad_request(f"'{param}' {message}", param=param, code=code)


def _text_of(content: Any, at: str) -> str:
    """A message's content (a string, or text parts) as one text; any other part is refused."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _fault(at, "must be a string or a list of text parts")
    if len(content) > MAX_PARTS:
        raise _fault(at, f"has {len(content)} parts; at most {MAX_PARTS}", "over_limit")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise _fault(f"{at}.{j}.type", f"is {str(kind)[:40]!r}; this server takes text parts only "
                                           "(input_text, output_text)", "unsupported_value")
        if not isinstance(part.get("text"), str):
            raise _fault(f"{at}.{j}.text", "must be a string")
        texts.append(part["text"])
    return "".join(texts)


def _reasoning_text(item: dict[str, Any], at: str) -> str:
    """A reasoning item's text: its `content` parts (reasoning_text); its `summary` parts (summary_text) are
    checked. NOTE: `encrypted_content` is another provider's opaque state: ignored."""
    texts = []
    for name, kind in (("summary", "summary_text"), ("content", "reasoning_text")):
        parts = item.get(name)
        if parts is None and name == "content":
            continue
        if not isinstance(parts, list) or len(parts) > MAX_PARTS:
            raise _fault(f"{at}.{name}", f"must be a list of at most {MAX_PARTS} {kind} parts")
        for j, part in enumerate(parts):
            if not isinstance(part, dict) or part.get("type") != kind:
                raise _fault(f"{at}.{name}.{j}.type", f"must be {kind!r}", "unsupported_value")
            if not isinstance(part.get("text"), str):
                raise _fault(f"{at}.{name}.{j}.text", "must be a string")
            if name == "content":
                texts.append(part["text"])
    return "".join(texts)


def normalize_item(item: Any, i: int) -> dict[str, Any]:
    """One input item, checked, in the stored form: a message {type, role, content: str}, a function_call
    {type, call_id, name, arguments}, a function_call_output {type, call_id, output: str} or a reasoning
    {type, content: str} (a think block the client replays from an earlier turn)."""
    at = f"input.{i}"
    if not isinstance(item, dict):
        raise _fault(at, "must be an object (an input item)")
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in _ROLES:
            raise _fault(f"{at}.role", f"must be one of {', '.join(_ROLES)}")
        return {"type": "message", "role": role, "content": _text_of(item.get("content"), f"{at}.content")}
    if kind == "function_call":
        for name in ("call_id", "name", "arguments"):
            if not isinstance(item.get(name), str):
                raise _fault(f"{at}.{name}", "must be a string")
        return {"type": "function_call", "call_id": item["call_id"], "name": item["name"],
                "arguments": item["arguments"]}
    if kind == "function_call_output":
        if not isinstance(item.get("call_id"), str):
            raise _fault(f"{at}.call_id", "must be a string")
        return {"type": "function_call_output", "call_id": item["call_id"],
                "output": _text_of(item.get("output"), f"{at}.output")}
    if kind == "reasoning":
        return {"type": "reasoning", "content": _reasoning_text(item, at)}
    raise _fault(f"{at}.type", f"is {str(kind)[:40]!r}; this server takes message, function_call, "
                               "function_call_output and reasoning items", "unsupported_value")


def parse_input(value: str | list[Any]) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    return [normalize_item(item, i) for i, item in enumerate(value)]


def chat_messages(items: list[dict[str, Any]], instructions: str | None) -> list[dict[str, Any]]:
    """Stored items as chat messages: consecutive function calls are one assistant turn's tool calls.
    NOTE: reasoning items are dropped, as chat drops an assistant message's `reasoning_content`: an earlier
    turn's think block is not rendered into the prompt (a `previous_response_id` chain continues the tokens
    as the model ran them instead: serving_responses._prompt)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    for item in items:
        if item["type"] == "reasoning":
            continue
        if item["type"] == "message":
            messages.append({"role": item["role"], "content": item["content"]})
        elif item["type"] == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return messages


def output_as_items(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items in the stored input form (what the next turn's history holds)."""
    items = []
    for o in output:
        if o["type"] == "message":
            items.append({"type": "message", "role": "assistant",
                          "content": "".join(p["text"] for p in o["content"])})
        elif o["type"] == "reasoning":
            items.append({"type": "reasoning", "content": "".join(p["text"] for p in o["content"])})
        else:
            items.append({k: o[k] for k in ("type", "call_id", "name", "arguments")})
    return items


# ------------------------------------------------------------------------------------------ tools and format


def parse_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """Responses function tools ({type, name, description, parameters, strict}) in the chat shape."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise _fault(f"tools.{i}.type", f"is {str(kind)[:40]!r}; this server serves function tools only",
                         "unsupported_value")
        if not isinstance(tool.get("name"), str):
            raise _fault(f"tools.{i}.name", "must be a string")
        if tool.get("parameters") is not None and not isinstance(tool["parameters"], dict):
            raise _fault(f"tools.{i}.parameters", "must be a JSON schema object")
        if tool.get("description") is not None and not isinstance(tool["description"], str):
            raise _fault(f"tools.{i}.description", "must be a string")
        function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def echoed_tools(tools: list[Any] | None) -> list[dict[str, Any]]:
    return [{"type": "function", "name": t["name"], "description": t.get("description"),
             "parameters": t.get("parameters"), "strict": t.get("strict", True)} for t in tools or []]


def chat_tool_choice(choice: str | dict[str, Any] | None) -> Any:
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _fault("tool_choice", "must be auto, none, required or {\"type\": \"function\", \"name\": ...}",
                 "unsupported_value")


def chat_response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as the chat `response_format` (the same grammar path)."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise _fault("text.format.schema", "must be a JSON schema object")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name") or "response", "schema": fmt["schema"]}}
    raise _fault("text.format.type", "must be text, json_object or json_schema", "unsupported_value")


def reasoning_effort(reasoning: Any) -> str | None:
    """`reasoning.effort` (low / medium / high: chat's `reasoning_effort`, checked by the chat path); the
    object's other fields (`summary`, ...) are accepted and ignored."""
    if reasoning is None:
        return None
    if not isinstance(reasoning, dict):
        raise _fault("reasoning", "must be an object ({\"effort\": ...})")
    effort = reasoning.get("effort")
    if effort is not None and not isinstance(effort, str):
        raise _fault("reasoning.effort", "must be a string (low, medium or high)")
    return effort


def chat_body(req: ResponsesRequest, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON body of the chat request this request means."""
    body: dict[str, Any] = {"reasoning_effort": reasoning_effort(req.reasoning),"messages": messages, "max_tokens": req.max_output_tokens,
                            "tools": parse_tools(req.tools), "tool_choice": chat_tool_choice(req.tool_choice),
                            "response_format": chat_response_format(req.text), "user": req.user,
                            "ignore_eos": req.ignore_eos}
    if req.model is not None:
        body["model"] = req.model
    for name in ("temperature", "top_p", "parallel_tool_calls", "thinking_budget"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    return body


# NOTE: a chat field named in an error of the chat path, as the Responses request names it
_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format",
           "reasoning_effort": "reasoning.effort"}


def responses_error(e: ApiError) -> ApiError:
    """An error of the chat path with the Responses request's field names."""
    param = e.param
    if param is not None:
        head, _, rest = param.partition(".")
        if head == "tools":
            param = param.replace(".function.", ".", 1)
        elif head == "messages":  # NOTE: chat turns do not line up with input items (instructions, merged calls)
            param = "input"
        elif head in _PARAMS:
            param = _PARAMS[head] + (f".{rest}" if rest else "")
    message = e.message.replace(e.param, param) if e.param and param else e.message
    for old, new in (("response_format", "text.format"), ("max_tokens", "max_output_tokens"),
                     ("'messages", "'input"), ("reasoning_effort", "reasoning.effort")):
        message = message.replace(old, new)
    return ApiError(e.status, message, param=param, code=e.code, type=e.type, extra=e.extra, headers=e.headers)


# ------------------------------------------------------------------------------------------ the answer


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    """The think block (--reasoning-parser) as a reasoning item: its text as one reasoning_text part."""
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def usage(input_tokens: int, output_tokens: int, cached: int, reasoning: int = 0,
          details: dict[str, int] | None = None) -> dict[str, Any]:
    """`details`: the cached tokens by tier (hierarchical cache), as `input_tokens_details.cached_tokens_details`."""
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": cached, **tier_details(details)},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": input_tokens + output_tokens}


def response_body(rid: str, req: ResponsesRequest, model: str, status: Literal["in_progress", "completed",
                  "incomplete"], output: list[dict[str, Any]], use: dict[str, Any] | None,
                  created_at: int | None = None) -> dict[str, Any]:
    """The Response object, with the request's fields echoed as the SDK expects them."""
    fmt = (req.text or {}).get("format") or {"type": "text"}
    return {
        "id": rid, "object": "response", "created_at": created_at or int(time.time()), "status": status,
        "error": None, "background": False,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "model": model, "output": output, "usage": use,
        "instructions": req.instructions, "tools": echoed_tools(req.tools),
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "parallel_tool_calls": req.parallel_tool_calls if req.parallel_tool_calls is not None else True,
        "temperature": req.temperature if req.temperature is not None else 1.0,
        "top_p": req.top_p if req.top_p is not None else 1.0, "max_output_tokens": req.max_output_tokens,
        "previous_response_id": req.previous_response_id, "metadata": req.metadata or {}, "store": req.store,
        "text": {"format": fmt}, "truncation": "disabled", "user": req.user,
        "reasoning": {"effort": reasoning_effort(req.reasoning), "summary": None} if req.reasoning else None,
    }
