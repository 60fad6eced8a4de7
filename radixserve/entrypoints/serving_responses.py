"""POST /v1/responses (and GET / DELETE of stored responses) on top of the chat path.

A Responses request is translated into the server's chat request (responses_protocol.chat_body), checked and
planned by the chat path's own pieces (tool plan, history checks, chat template, grammars, sampling params), run
through the one scheduler client path (`generate_all`), and its result is translated back into Response items,
whole or as typed stream events (responses_stream.py).

`previous_response_id` continues a stored response (responses_store.py): the history is its items and its
output, and the prompt reuses the earlier turn's token ids (its prompt, then what the model generated) ahead of
the new text, so the radix cache matches the whole earlier conversation (`_prompt`).

With `--reasoning-parser` the think block is split from the answer as on chat (chat_reasoning.py): a reasoning
item before the answer's items, `usage.output_tokens_details.reasoning_tokens`; `reasoning.effort` is chat's
`reasoning_effort` (a budget that closes the block); the tool-call parser reads the answer only.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from radixserve.entrypoints import chat_reasoning as reasoning_out
from radixserve.entrypoints.chat_history import check_history
from radixserve.entrypoints.http_errors import ApiError, bad_request, check_text, validation_error
from radixserve.entrypoints.openai_protocol import ChatCompletionRequest, ChatMessage
from radixserve.entrypoints.responses_protocol import (
    ResponsesRequest,
    call_item,
    chat_body,
    chat_messages,
    check_bounds,
    message_item,
    new_id,
    output_as_items,
    parse_input,
    reasoning_item,
    response_body,
    responses_error,
    usage,
)
from radixserve.entrypoints.responses_store import ResponseStore, StoredResponse
from radixserve.entrypoints.responses_stream import ResponseEvents
from radixserve.entrypoints.serving_common import (
    CLIENT_CLOSED,
    ClientDisconnected,
    DisconnectWatcher,
    check_prompt,
    check_prompt_chars,
    collect,
    generate_all,
    guarded,
    raise_if_aborted,
    resolve_max_tokens,
    stream_response,
)
from radixserve.entrypoints.serving_openai import OpenAIServing
from radixserve.frontend.tokenizer_manager import GenerateOutput, TokenizerManager, cache_namespace
from radixserve.function_call.answer import StreamedCalls, whole_message
from radixserve.function_call.chat_tools import ToolError, ToolPlan, template_messages, template_tools
from radixserve.function_call.legacy import plan_request_tools
from radixserve.protocol.requests import per_choice_params


class ResponsesServing:
    """The Responses endpoints of one server: `create`, and `get` / `delete` / `input_items` of its store."""

    def __init__(self, tm: TokenizerManager, chat: OpenAIServing, store: ResponseStore) -> None:
        self.tm = tm
        self.chat = chat
        self.store = store

    # ------------------------------------------------------------------------------------------ create

    async def create(self, req: ResponsesRequest, tenant: str | None, extra_key: Any, request: Request,
                     key: Any = None) -> Response:
        """`tenant`: the caller's key id (whose stored responses it sees); `extra_key`: its cache namespace."""
        try:
            return await self._create(req, tenant, extra_key, request, key)
        except ApiError as e:
            raise responses_error(e) from None

    async def _create(self, req: ResponsesRequest, tenant: str | None, extra_key: Any, request: Request,
                      key: Any) -> Response:
        bounds = self.tm.config.bounds
        check_bounds(req, bounds.max_chat_messages, bounds.max_id_chars)
        self.chat.check_model(req.model)
        if req.instructions is not None:
            check_text(req.instructions, "instructions")
        items = parse_input(req.input)
        prev = None
        if req.previous_response_id is not None:
            # NOTE: another tenant's id is a 404 like an unknown one: the store is keyed by tenant
            prev = self.store.get(tenant, req.previous_response_id)
            if prev is None:
                raise _not_found(req.previous_response_id, "previous_response_id")
        history = (prev.history + output_as_items(prev.body["output"]) if prev is not None else []) + items
        if len(history) > bounds.max_chat_messages:
            raise bad_request(f"the conversation has {len(history)} items with its earlier turns; the server takes "
                              f"at most {bounds.max_chat_messages} (--max-chat-messages)",
                              param="previous_response_id" if prev is not None else "input", code="over_limit")
        try:
            chat_req = ChatCompletionRequest.model_validate(chat_body(req, chat_messages(history, req.instructions)))
        except ValidationError as e:
            raise validation_error(e) from None
        try:
            plan = plan_request_tools(self.chat.tool_format, chat_req)
        except ToolError as e:
            raise bad_request(str(e), param=e.param, code="invalid_value") from None
        lora = await self.chat.adapter_of(req.model)
        ids, text = await self.tm.run_tokenizer(key, self._prompt, chat_req.messages, plan, prev)
        max_tokens = resolve_max_tokens(self.tm, len(ids), req.max_output_tokens, "messages")
        params = self.chat.sampling(chat_req, max_tokens, plan)
        style, tokenizer = self.chat.reasoning_parser, self.tm.tokenizer
        thinking = reasoning_out.plan_reasoning(style, chat_req, plan, tokenizer, ids)
        params = reasoning_out.with_budget(per_choice_params(params, 1),
                                           reasoning_out.budget_of(style, chat_req, tokenizer, ids))
        outputs = generate_all(self.tm, [ids], [params], extra_key, lora_name=lora)
        turn = _Turn(self, req, tenant, items, history, plan, text, ids, thinking)
        if req.stream:
            events = ResponseEvents(turn.body("in_progress", [], None))
            calls = StreamedCalls(plan) if plan is not None and plan.parses_calls else None
            turn.streamed = reasoning_out.StreamedReasoning(thinking, tokenizer) if thinking is not None else None
            return await stream_response(request, outputs, partial(turn.render, events, calls), partial(
                turn.finale, events), partial(self.tm.run_cpu, key, admit=False))
        watcher = DisconnectWatcher(request.receive)
        try:
            results = await guarded(lambda: watcher.run(collect(outputs, 1)))
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED)
        finally:
            watcher.close()
        r = results[0]
        raise_if_aborted(r)
        turn.cached_details = r.cached_tokens_details
        return JSONResponse(turn.whole(r.text, r.finish_reason, r.token_ids, r.completion_tokens, r.cached_tokens))

    def _render(self, chat: list[ChatMessage], plan: ToolPlan | None, generation: bool) -> str:
        fmt = self.chat.tool_format
        try:
            return self.tm.tokenizer.apply_chat_template(template_messages(chat, fmt, plan),
                                                         tools=template_tools(fmt, plan), tokenize=False,
                                                         add_generation_prompt=generation)
        except Exception as e:  # noqa: BLE001 - template errors are the client's messages
            raise bad_request(f"cannot apply the chat template: {e}", param="input") from None

    def _prompt(self, chat: list[ChatMessage], plan: ToolPlan | None,
                prev: StoredResponse | None) -> tuple[list[int], str]:
        """The prompt's ids and its text (on the tokenizer thread).

        NOTE: continuing `prev`, the ids start with prev's prompt ids and output ids as the model ran them, when
        the new text renders that conversation first; so the radix cache matches every earlier token. Otherwise
        (other tools or instructions: another rendering) they start with prev's prompt ids where the text does,
        or are the text's own."""
        if not chat:
            raise bad_request("'input' must hold at least one item", param="input", code="empty_prompt")
        chat = check_history(chat, plan.names if plan is not None else None)
        for m in chat:
            check_text(m.text(), "input")
        text = self._render(chat, plan, True)
        check_prompt_chars(self.tm, len(text), "input")
        tokenizer = self.tm.tokenizer
        ids = None
        if prev is not None and text.startswith(prev.prompt_text):
            done = [ChatMessage.model_validate(m) for m in chat_messages(
                prev.history + output_as_items(prev.body["output"]), prev.instructions)]
            earlier = self._render(check_history(done, prev.plan.names if prev.plan is not None else None),
                                   prev.plan, False)
            answer = earlier[len(prev.prompt_text):]
            generated = self._answer_of(prev, tokenizer.decode(prev.output_ids, skip_special_tokens=False))
            if (generated is not None and earlier.startswith(prev.prompt_text) and text.startswith(earlier)
                    and answer.startswith(generated)):
                rest = answer[len(generated):] + text[len(earlier):]
                ids = prev.prompt_ids + prev.output_ids + list(tokenizer.encode(rest, add_special_tokens=False))
            else:
                rest = text[len(prev.prompt_text):]
                ids = prev.prompt_ids + list(tokenizer.encode(rest, add_special_tokens=False))
        if ids is None:
            ids = list(tokenizer.encode(text, add_special_tokens=False))
        check_prompt(self.tm, ids, "input")
        return ids, text

    def _answer_of(self, prev: StoredResponse, generated: str) -> str | None:
        """The part of prev's generated text its rendered turn holds: all of it, or with a think block (a reasoning
        item, which the rendering drops) what follows the closing tag; None for a block never closed.
        NOTE: the continued ids keep the think block as generated, so the whole earlier turn stays cached."""
        if self.chat.reasoning_parser is None or not any(o["type"] == "reasoning" for o in prev.body["output"]):
            return generated
        tag = reasoning_out.closing_tag(self.chat.reasoning_parser)
        return generated.split(tag, 1)[1].lstrip() if tag in generated else None

    # ------------------------------------------------------------------------------------------ the store

    def get(self, tenant: str | None, response_id: str) -> dict[str, Any]:
        entry = self.store.get(tenant, response_id)
        if entry is None:
            raise _not_found(response_id, "response_id")
        return entry.body

    def delete(self, tenant: str | None, response_id: str) -> dict[str, Any]:
        if not self.store.delete(tenant, response_id):
            raise _not_found(response_id, "response_id")
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    def input_items(self, tenant: str | None, response_id: str, limit: int, order: str,
                    after: str | None) -> dict[str, Any]:
        """A page of the response's input items (this turn's), OpenAI's list shape."""
        if not 1 <= limit <= 100:
            raise bad_request(f"'limit' must be in [1, 100], got {limit}", param="limit", code="invalid_value")
        if order not in ("asc", "desc"):
            raise bad_request(f"'order' must be asc or desc, got {order[:20]!r}", param="order", code="invalid_value")
        entry = self.store.get(tenant, response_id)
        if entry is None:
            raise _not_found(response_id, "response_id")
        items = entry.input_items if order == "asc" else entry.input_items[::-1]
        if after is not None:
            ids = [i["id"] for i in items]
            if after not in ids:
                raise bad_request("'after' names no item of this response", param="after", code="invalid_value")
            items = items[ids.index(after) + 1:]
        page = items[:limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}


class _Turn:
    """One request's answer: built whole or from stream events, then stored (with `store`)."""

    def __init__(self, serving: ResponsesServing, req: ResponsesRequest, tenant: str | None,
                 items: list[dict[str, Any]], history: list[dict[str, Any]], plan: ToolPlan | None, text: str,
                 ids: list[int], thinking: reasoning_out.ReasoningPlan | None = None) -> None:
        self.serving, self.req, self.tenant, self.items, self.history = serving, req, tenant, items, history
        self.plan, self.text, self.ids = plan, text, ids  # plan: as the prompt rendered it (choice none too)
        self.thinking = thinking  # the think-block split (--reasoning-parser), or None
        self.streamed: reasoning_out.StreamedReasoning | None = None
        self.id = new_id("resp")
        self.created = None
        self.output_ids: list[int] = []
        self.completion = self.cached = 0
        self.cached_details: dict[str, int] | None = None  # the cached tokens by tier (hierarchical cache)

    def body(self, status: Any, output: list[dict[str, Any]], use: dict[str, Any] | None) -> dict[str, Any]:
        body = response_body(self.id, self.req, self.serving.chat.model_name, status, output, use, self.created)
        self.created = body["created_at"]
        return body

    def whole(self, text: str, reason: str | None, token_ids: list[int], completion: int,
              cached: int) -> dict[str, Any]:
        thought, answer = reasoning_out.whole_fields(self.thinking, text)
        content, calls = answer, []
        if self.plan is not None and self.plan.parses_calls:  # NOTE: calls are read from the answer only
            message, reason = whole_message(self.plan, answer, reason)
            content, calls = message["content"], message["tool_calls"] or []
        status = "incomplete" if reason == "length" else "completed"
        output = []
        if thought is not None:
            output.append(reasoning_item(new_id("rs"), thought, "completed" if content or calls else status))
        if content or not calls:
            output.append(message_item(new_id("msg"), content or "", status))
        output += [call_item(new_id("fc"), c["id"], c["function"]["name"], c["function"]["arguments"], "completed")
                   for c in calls]
        self.output_ids = token_ids
        spent = 0 if self.thinking is None else reasoning_out.reasoning_tokens(
            self.thinking, self.serving.tm.tokenizer, token_ids, text)
        return self.finish(status, output, usage(len(self.ids), completion, cached, spent, self.cached_details))

    def finish(self, status: str, output: list[dict[str, Any]], use: dict[str, Any]) -> dict[str, Any]:
        body = self.body(status, output, use)
        if self.req.store:
            inputs = [{**_item_view(i), "id": new_id(_ID_PREFIX[i["type"]])} for i in self.items]
            self.serving.store.put(self.tenant, self.id, StoredResponse(
                body, inputs, self.history, self.req.instructions, self.plan, self.text, self.ids, self.output_ids))
        return body

    def render(self, events: ResponseEvents, calls: StreamedCalls | None, index: int,
               out: GenerateOutput) -> list[dict[str, Any]]:
        self.output_ids += out.token_ids
        self.completion, self.cached = out.completion_tokens, out.cached_tokens
        self.cached_details = out.cached_tokens_details or self.cached_details
        chunks = events.start()
        text = out.text_delta
        if self.streamed is not None:
            thought, text = self.streamed.delta(index, text, out.token_ids, out.finish_reason is not None)
            if thought:
                chunks += events.reasoning(thought)
        if calls is None:
            pieces, reason = [], out.finish_reason
        else:
            delta, reason = calls.delta(index, text, out.finish_reason)
            text, pieces = delta["content"] or "", delta["tool_calls"] or []
        if text:
            chunks += events.text(text)
        for piece in pieces:
            chunks += events.call(piece)
        if reason is not None:
            events.status = "incomplete" if reason == "length" else "completed"
        return chunks

    def finale(self, events: ResponseEvents) -> list[dict[str, Any]]:
        chunks = events.close()
        spent = self.streamed.tokens.get(0, 0) if self.streamed is not None else 0
        body = self.finish(events.status, events.output, usage(len(self.ids), self.completion, self.cached, spent,
                                                                self.cached_details))
        return chunks + [events.event(f"response.{events.status}", response=body)]


_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fc", "reasoning": "rs"}


def _item_view(item: dict[str, Any]) -> dict[str, Any]:
    """A stored input item as GET .../input_items shows it."""
    if item["type"] == "reasoning":
        return {k: v for k, v in reasoning_item("", item["content"], "completed").items() if k != "id"}
    if item["type"] != "message":
        return {**item, "status": "completed"}
    if item["role"] == "assistant":
        return {"type": "message", "role": "assistant", "status": "completed",
                "content": [{"type": "output_text", "text": item["content"], "annotations": []}]}
    return {"type": "message", "role": item["role"], "status": "completed",
            "content": [{"type": "input_text", "text": item["content"]}]}


def _not_found(response_id: str, param: str) -> ApiError:
    return ApiError(404, f"Response with id {response_id[:80]!r} not found.", param=param, code="not_found")


def register_responses_routes(app: Any, tm: TokenizerManager, auth: Any, parse: Any, chat: OpenAIServing,
                              server_args: Any) -> ResponsesServing:
    """POST /v1/responses, GET and DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items; `parse`:
    http_server's body parser (size, bounds, validation on a front-end worker)."""
    store = ResponseStore(server_args.responses_store_max_count, server_args.responses_store_max_bytes)
    serving = app.state.responses = ResponsesServing(tm, chat, store)

    # NOTE: kept out of the served OpenAPI schema (its fuzzing bounds only the chat fields' max_tokens)
    @app.post("/v1/responses", include_in_schema=False)
    async def create_response(request: Request) -> Response:
        principal = auth.principal(request)
        req, key = await parse(request, ResponsesRequest, principal)
        namespace = cache_namespace(principal.key_id, None, None)
        return await guarded(lambda: serving.create(req, principal.key_id, namespace, request, key))

    @app.get("/v1/responses/{response_id}", include_in_schema=False)
    async def get_response(request: Request, response_id: str) -> JSONResponse:
        return JSONResponse(serving.get(auth.principal(request).key_id, response_id))

    @app.delete("/v1/responses/{response_id}", include_in_schema=False)
    async def delete_response(request: Request, response_id: str) -> JSONResponse:
        return JSONResponse(serving.delete(auth.principal(request).key_id, response_id))

    @app.get("/v1/responses/{response_id}/input_items", include_in_schema=False)
    async def input_items(request: Request, response_id: str, limit: int = 20, order: str = "desc",
                          after: str | None = None) -> JSONResponse:
        return JSONResponse(serving.input_items(auth.principal(request).key_id, response_id, limit, order, after))
    return serving
