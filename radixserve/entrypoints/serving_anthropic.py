"""`/v1/messages` and `/v1/messages/count_tokens`: Anthropic's Messages API over the chat path.

A Messages request is translated into the server's chat request (anthropic_protocol.translate) and served by
`OpenAIServing.chat`: the same checks, chat template, tool plan and grammars, and the one scheduler client path.
Only the answer differs: `AnthropicServing` builds it as a message (whole) or as Anthropic's stream events, and
`AnthropicEventStream` names each event on the wire (`event:` lines) and writes errors in Anthropic's shape.
With `--reasoning-parser`, the chat path's reasoning split (chat_reasoning.py) gives a thinking block first
(anthropic_thinking.py); the tool-call parser reads the answer after it.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import Message, Receive, Scope, Send

from radixserve.entrypoints import chat_reasoning
from radixserve.entrypoints.anthropic_protocol import (
    AnthropicError,
    CountTokensRequest,
    MessagesRequest,
    Translated,
    anthropic_error,
    decode_messages,
    error_body,
    translate,
)
from radixserve.entrypoints.anthropic_thinking import thinking_block
from radixserve.entrypoints.http_auth import Auth, Principal
from radixserve.entrypoints.http_errors import ApiError, read_body
from radixserve.entrypoints.logprobs import TokenTexts
from radixserve.entrypoints.openai_protocol import UsageInfo
from radixserve.entrypoints.serving_common import ChoiceResult, Render, guarded
from radixserve.entrypoints.serving_openai import OpenAIServing
from radixserve.frontend.tokenizer_manager import (
    FrontendBusy,
    GenerateOutput,
    TokenizerManager,
    cache_namespace,
)
from radixserve.function_call.answer import StreamedCalls, whole_message
from radixserve.function_call.chat_tools import ToolError, ToolPlan
from radixserve.function_call.legacy import plan_request_tools
from radixserve.mem_cache.tiers import tier_details

logger = logging.getLogger(__name__)

_INLINE_BODY_BYTES = 4 * 1024  # smaller bodies are parsed on the loop (as http_errors.parse_request)
_EVENT_TYPE = re.compile(rb'^data: \{"type":"([a-z_]+)"')


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def stop_reason(reason: str | None, finish: dict[str, Any] | None) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) of a chat finish reason (`tool_calls` after the tool-call parser) and the
    scheduler's finish (its `matched`: a stop string, or a stop token's id)."""
    if reason == "tool_calls":
        return "tool_use", None
    if reason == "length":
        return "max_tokens", None
    matched = (finish or {}).get("matched")
    if isinstance(matched, str):
        return "stop_sequence", matched
    return ("end_turn" if reason is not None else None), None


def usage_of(prompt: int, completion: int, cached: int, details: dict[str, int] | None = None) -> dict[str, Any]:
    """Anthropic's usage: `input_tokens` are the prompt tokens computed, `cache_read_input_tokens` those the
    radix cache served (their sum is the prompt); the cache is written without being asked, so creation is 0.
    With the hierarchical cache, `cached_tokens_details` splits `cache_read_input_tokens` by tier (an extension)."""
    return {"input_tokens": prompt - cached, "output_tokens": completion, "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0, **tier_details(details)}


class AnthropicServing(OpenAIServing):
    """The chat path (OpenAIServing) with Anthropic's answers: `_chat_response` and `_chat_renderer` are the
    two places the chat path builds its answer."""

    async def messages(self, req: MessagesRequest, principal: Principal, request: Request, key: Any) -> Response:
        translated = translate(req, self.reasoning_parser is not None)
        chat = translated.chat
        try:
            response = await guarded(lambda: self.chat(chat, cache_namespace(principal.key_id, None, None),
                                                       request, key))
        except ApiError as e:
            raise anthropic_error(e, translated.origin) from None
        if req.stream and response.status_code == 200:
            return AnthropicEventStream(response)
        return response

    async def count_tokens(self, req: CountTokensRequest, key: Any) -> dict[str, int]:
        """The prompt's tokens as generation renders it: system, messages, tools, through the chat template."""
        translated = translate(req, self.reasoning_parser is not None)
        try:
            self.check_model(req.model)
            tools = self._plan(translated)
            ids = await self.tm.run_tokenizer(key, self.chat_prompt, translated.chat.messages, tools)
        except ApiError as e:
            raise anthropic_error(e, translated.origin) from None
        return {"input_tokens": len(ids)}

    def _plan(self, translated: Translated) -> ToolPlan | None:
        try:
            return plan_request_tools(self.tool_format, translated.chat)
        except ToolError as e:
            raise ApiError(400, str(e), param=e.param, code="invalid_value") from None

    def _chat_response(self, rid: str, results: list[ChoiceResult], usage: UsageInfo, logprobs: bool,
                       tools: ToolPlan | None = None, *more: Any) -> JSONResponse:
        # NOTE: one choice: a Messages request has no `n`; `more`: the chat path's ReasoningPlan or None
        r = results[0]
        reasoning, text = chat_reasoning.whole_fields(more[0] if more else None, r.text)
        # NOTE: the tool-call parser reads the answer only (a call written inside the think block is thinking)
        message, reason = whole_message(tools, text, r.finish_reason) if tools else ({"content": text},
                                                                                    r.finish_reason)
        content: list[dict[str, Any]] = [thinking_block(reasoning)] if reasoning else []
        if message["content"]:
            content.append({"type": "text", "text": message["content"]})
        for call in message.get("tool_calls") or []:
            try:
                arguments = json.loads(call["function"]["arguments"] or "{}")
            except ValueError:  # NOTE: only a call that max_tokens cut short; the grammar made the rest whole
                continue
            content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                            "input": arguments})
        stop, sequence = stop_reason(reason, r.finish)
        body = {"id": new_message_id(), "type": "message", "role": "assistant", "model": self.model_name,
                "content": content, "stop_reason": stop, "stop_sequence": sequence,
                "usage": usage_of(r.prompt_tokens, r.completion_tokens, r.cached_tokens, r.cached_tokens_details)}
        return JSONResponse(body)

    def _chat_renderer(self, rid: str, usage: Any, logprobs: bool, tools: ToolPlan | None = None,
                       *more: Any) -> Render:
        # NOTE: `more`: the chat path's StreamedReasoning or None
        return _StreamState(self.model_name, StreamedCalls(tools) if tools is not None else None,
                            more[0] if more else None).render


class _StreamState:
    """One streamed message: which content block is open, turning chat outputs into Anthropic's events."""

    def __init__(self, model: str, calls: StreamedCalls | None,
                 thinking: chat_reasoning.StreamedReasoning | None = None) -> None:
        self.model = model
        self.calls = calls
        self.thinking = thinking
        self.started = False
        self.blocks = 0  # content blocks started so far; the open one is blocks - 1
        self.open: str | int | None = None  # "thinking", "text", a tool call's index, or None

    def render(self, index: int, out: GenerateOutput) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if not self.started:
            self.started = True
            message = {"id": new_message_id(), "type": "message", "role": "assistant", "model": self.model,
                       "content": [], "stop_reason": None, "stop_sequence": None,
                       "usage": usage_of(out.prompt_tokens, 0, out.cached_tokens, out.cached_tokens_details)}
            events += [{"type": "message_start", "message": message}, {"type": "ping"}]
        content, pieces, reason = out.text_delta, [], out.finish_reason
        if self.thinking is not None:
            thought, content = self.thinking.delta(index, out.text_delta, out.token_ids, reason is not None)
            if thought:  # NOTE: the block comes first: the parser hands out no answer before it is closed
                if self.open != "thinking":
                    self._start(events, "thinking", thinking_block(""))
                events.append(self._delta({"type": "thinking_delta", "thinking": thought}))
        if self.calls is not None:
            delta, reason = self.calls.delta(index, content, out.finish_reason)
            content, pieces = delta["content"], delta["tool_calls"] or []
        if content:
            if self.open != "text":
                self._start(events, "text", {"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": content}))
        for piece in pieces:
            if piece.get("id") is not None:
                self._start(events, piece["index"], {"type": "tool_use", "id": piece["id"],
                                                     "name": piece["function"]["name"], "input": {}})
            arguments = piece["function"].get("arguments")
            if arguments:
                # NOTE: the pieces of one call follow its first piece: the open block is that call's
                events.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
        if reason is not None:
            self._stop(events)
            stop, sequence = stop_reason(reason, out.finish)
            events.append({"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": sequence},
                           "usage": usage_of(out.prompt_tokens, out.completion_tokens, out.cached_tokens,
                                             out.cached_tokens_details)})
            events.append({"type": "message_stop"})
        return events

    def _start(self, events: list[dict[str, Any]], kind: str | int, block: dict[str, Any]) -> None:
        self._stop(events)
        events.append({"type": "content_block_start", "index": self.blocks, "content_block": block})
        self.blocks += 1
        self.open = kind

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self.blocks - 1, "delta": delta}

    def _stop(self, events: list[dict[str, Any]]) -> None:
        if self.open == "thinking":  # NOTE: as Anthropic's stream: the signature (here "") ends the block
            events.append(self._delta({"type": "signature_delta", "signature": ""}))
        if self.open is not None:
            events.append({"type": "content_block_stop", "index": self.blocks - 1})
            self.open = None


class AnthropicEventStream(Response):
    """The chat path's event stream (serving_common.stream_response) as Anthropic's: each `data:` event gets
    its `event:` line (the event's type), an error event Anthropic's shape, and the closing `[DONE]` is dropped.
    Wraps the inner response at the ASGI level, so its disconnect watching and abort-on-close stay as they are."""

    def __init__(self, inner: Response) -> None:
        super().__init__(status_code=inner.status_code)
        self.inner = inner

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def named(message: Message) -> None:
            if message["type"] == "http.response.body" and message.get("body"):
                message = {**message, "body": _name_events(message["body"])}
            await send(message)
        await self.inner(scope, receive, named)


def _name_events(body: bytes) -> bytes:
    out = []
    for event in body.split(b"\n\n"):
        if not event or event == b"data: [DONE]":
            continue
        match = _EVENT_TYPE.match(event)
        if match is not None:
            out.append(b"event: " + match.group(1) + b"\n" + event + b"\n\n")
            continue
        # NOTE: an error mid-stream (serving_common.stream_response writes {"error": {...}}); the status
        # line went out already, so its status is only a hint for the type
        try:
            error = json.loads(event[len(b"data: "):])["error"]
            status = 503 if error.get("type") == "service_unavailable_error" else 500
            if error.get("type") == "invalid_request_error":
                status = 400
            data = json.dumps(error_body(status, str(error.get("message"))), separators=(",", ":")).encode()
        except (ValueError, KeyError, TypeError, AttributeError):
            data = event[len(b"data: "):]
        out.append(b"event: error\ndata: " + data + b"\n\n")
    return b"".join(out)


def register_anthropic_routes(app: FastAPI, tm: TokenizerManager, auth: Auth, texts: TokenTexts,
                              work_key: Callable[[Principal, Request], Any]) -> None:
    """`POST /v1/messages` and `POST /v1/messages/count_tokens` (docs/server.md, "Anthropic Messages API");
    `work_key`: whose turn a request's CPU work takes (http_server.create_app)."""
    serving = AnthropicServing(tm, texts)
    limit = tm.config.max_body_bytes

    async def parse(request: Request, model: type[CountTokensRequest]) -> tuple[Any, Principal, Any]:
        principal = auth.principal(request)
        key = work_key(principal, request)
        raw = await read_body(request, limit)
        if len(raw) < _INLINE_BODY_BYTES:
            return decode_messages(raw, model, tm.config.bounds), principal, key
        return await tm.run_parse(key, decode_messages, raw, model, tm.config.bounds), principal, key

    async def answer(work: Callable[[], Any]) -> Response:
        try:
            return await work()
        except ApiError as e:
            return (e if isinstance(e, AnthropicError) else anthropic_error(e)).response()
        except FrontendBusy as e:
            return Response(json.dumps(error_body(503, str(e))), status_code=503, headers={"Retry-After": "1"},
                            media_type="application/json")

    @app.post("/v1/messages", include_in_schema=False)
    async def messages(request: Request) -> Response:
        async def work() -> Response:
            req, principal, key = await parse(request, MessagesRequest)
            return await serving.messages(req, principal, request, key)
        return await answer(work)

    @app.post("/v1/messages/count_tokens", include_in_schema=False)
    async def count_tokens(request: Request) -> Response:
        async def work() -> Response:
            req, _, key = await parse(request, CountTokensRequest)
            return JSONResponse(await serving.count_tokens(req, key))
        return await answer(work)
