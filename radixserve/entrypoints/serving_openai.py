"""/v1/completions and /v1/chat/completions on top of the tokenizer manager."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import partial
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from radixserve.client.text_stream import decode_all
from radixserve.entrypoints import chat_reasoning as reasoning_out
from radixserve.entrypoints.chat_history import check_history
from radixserve.entrypoints.gateway_api import GATEWAY_UNSET_MODEL
from radixserve.entrypoints.http_errors import ApiError, bad_request, check_text
from radixserve.entrypoints.logprobs import TokenTexts, chat_logprobs, check_top_logprobs, completion_logprobs
from radixserve.entrypoints.lora_api import adapter_of_model, check_adapter
from radixserve.entrypoints.openai_protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    CompletionChoice,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    DetokenizeRequest,
    TokenizeRequest,
    UsageInfo,
    new_id,
    now,
)
from radixserve.entrypoints.serving_common import (
    CLIENT_CLOSED,
    ChoiceResult,
    ClientDisconnected,
    DisconnectWatcher,
    Render,
    check_fanout,
    check_prompt,
    check_prompt_chars,
    check_request_items,
    collect,
    generate_all,
    guarded,
    make_sampling_params,
    raise_if_aborted,
    resolve_max_tokens,
    stream_response,
    token_id_keys,
    tokenize_text,
)
from radixserve.entrypoints.serving_native import check_session
from radixserve.frontend.tokenizer_manager import GenerateOutput, TokenizerManager
from radixserve.function_call.answer import StreamedCalls, whole_message
from radixserve.function_call.chat_tools import ToolError, ToolPlan, template_messages, template_tools
from radixserve.function_call.formats import choose_format, trigger_is_special
from radixserve.function_call.legacy import plan_request_tools
from radixserve.protocol.requests import per_choice_params

# NOTE: `function_call` is in an answer only for the legacy `functions`; it is left out (not null) otherwise,
# and a legacy answer carries no `tool_calls`
_WITHOUT_FUNCTION_CALL = {"choices": {"__all__": {"message": {"function_call"}}}}
_WITHOUT_TOOL_CALLS = {"choices": {"__all__": {"message": {"tool_calls"}}}}
_DELTA_WITHOUT_FUNCTION_CALL = {"choices": {"__all__": {"delta": {"function_call"}}}}
_DELTA_WITHOUT_CALLS = {"choices": {"__all__": {"delta": {"tool_calls", "function_call"}}}}  # a piece is put back


class _Usage:
    """Usage over all choices: prompts counted once, cached tokens the smallest hit among a prompt's choices."""

    def __init__(self, prompt_lens: list[int], n: int) -> None:
        self.prompt_lens = prompt_lens
        self.n = n
        self.completion = [0] * (len(prompt_lens) * n)
        self.cached = [0] * (len(prompt_lens) * n)
        self.details: list[dict[str, int] | None] = [None] * (len(prompt_lens) * n)  # by tier (hierarchical cache)

    def add(self, index: int, out: GenerateOutput | ChoiceResult) -> None:
        self.completion[index] = out.completion_tokens
        self.cached[index] = out.cached_tokens
        self.details[index] = out.cached_tokens_details or self.details[index]

    def info(self) -> UsageInfo:
        n = self.n
        # NOTE: each prompt's choice with the smallest hit gives its tier split too, so the split sums to `cached`
        picks = [min(range(p * n, (p + 1) * n), key=self.cached.__getitem__) for p in range(len(self.prompt_lens))]
        cached = sum(self.cached[i] for i in picks)
        split = [self.details[i] for i in picks]
        details = None if None in split else {tier: sum(d[tier] for d in split) for tier in split[0]}
        return UsageInfo.of(sum(self.prompt_lens), sum(self.completion), cached, details)


@dataclass(frozen=True)
class _Echo:
    """What completions' `echo` puts first: choice i starts with prompt i // n, as text and as ids."""

    texts: list[str]
    ids: list[list[int]]
    n: int

    def prompt(self, index: int) -> tuple[str, list[int]]:
        return self.texts[index // self.n], self.ids[index // self.n]


class OpenAIServing:
    def __init__(self, tm: TokenizerManager, texts: TokenTexts | None = None) -> None:
        self.tm = tm
        self.model_name = tm.info.model_name
        self.texts = texts or TokenTexts(tm.tokenizer)
        self.tool_format = choose_format(tm.config.tool_call_parser, getattr(tm.tokenizer, "chat_template", None))
        self.special_trigger = trigger_is_special(self.tool_format, tm.tokenizer)
        self.reasoning_parser = getattr(tm.config, "reasoning_parser", None)  # chat_reasoning.py

    def check_model(self, model: str | None) -> None:
        # NOTE: with LoRA on, another name may be an adapter's: `adapter_of` asks the scheduler
        if model is not None and model not in (self.model_name, GATEWAY_UNSET_MODEL) and not self.tm.info.lora_enabled:
            raise ApiError(404, f"The model '{model}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")

    async def adapter_of(self, model: str | None) -> str | None:
        """The LoRA adapter `model` names ("<base>:<adapter>" or "<adapter>"), None for the base; 404 if unknown."""
        if model == GATEWAY_UNSET_MODEL:
            return None
        return await check_adapter(self.tm, adapter_of_model(model, self.model_name), "model")

    def _check_common(self, req: Any) -> None:
        self.check_model(req.model)
        if req.cache_salt is not None:
            check_text(req.cache_salt, "cache_salt")

    def _check_items(self, req: Any, sequences: int) -> None:
        check_request_items(self.tm, sequences=sequences, stop=req.stop, stop_token_ids=req.stop_token_ids,
                            logit_bias=req.logit_bias)

    def sampling(self, req: ChatCompletionRequest, max_new_tokens: int, tools: ToolPlan | None = None) -> Any:
        """A chat request's sampling params (grammar of its response_format and tools included): the hook of the
        endpoints that run as a chat request (serving_responses.py)."""
        return self._sampling(req, max_new_tokens, tools)

    def _sampling(self, req: Any, max_new_tokens: int, tools: ToolPlan | None = None) -> Any:
        try:
            grammar = {} if req.response_format is None else req.response_format.grammar()
        except ValueError as e:
            raise bad_request(str(e), param="response_format", code="invalid_value") from None
        if tools is not None and tools.parses_calls:
            if grammar and "json_schema" not in grammar:
                raise bad_request("a structural_tag 'response_format' cannot be combined with 'tools'",
                                  param="response_format", code="unsupported_parameter")
            # NOTE: a forced call replaces the answer's format; under auto the answer is that JSON or calls
            answer = json.loads(grammar["json_schema"]) if grammar and tools.choice == "auto" else None
            grammar = tools.grammar(answer)
        # NOTE: a trigger that is a special token must reach the tool-call parser (formats.trigger_is_special)
        keep_special = tools is not None and tools.parses_calls and self.special_trigger
        return make_sampling_params(
            True, self.tm.info.vocab_size, **grammar, max_new_tokens=max_new_tokens,
            temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p, stop=req.stop or [], stop_token_ids=req.stop_token_ids or [],
            ignore_eos=req.ignore_eos, seed=req.seed, n=req.n, frequency_penalty=req.frequency_penalty,
            presence_penalty=req.presence_penalty, repetition_penalty=req.repetition_penalty,
            skip_special_tokens=req.skip_special_tokens and not keep_special, min_new_tokens=req.min_tokens, logit_bias=token_id_keys(req.logit_bias, self.tm.info.vocab_size))

    # -------------------------------------------------------------------------- completions

    async def completions(self, req: CompletionRequest, extra_key: Any, request: Request, key: Any = None) -> Response:
        """`key`: whose turn its CPU work takes (fair_work): the API key's id, or the connection on an open server."""
        self._check_common(req)
        if req.best_of is not None and not (isinstance(req.best_of, int) and req.n <= req.best_of):
            raise bad_request(f"'best_of' must be an integer >= n ({req.n}), got {req.best_of}", param="best_of",
                              code="invalid_value")
        if req.suffix or (req.best_of or 1) > 1:
            raise bad_request("'suffix' and 'best_of' are not supported", param="suffix" if req.suffix else "best_of",
                              code="unsupported_parameter")
        if req.logprobs is not None:
            check_top_logprobs(req.logprobs, "logprobs")
        lora = await self.adapter_of(req.model)
        if req.max_tokens == 0 and not req.echo:
            raise bad_request("'max_tokens' 0 (score the prompt, generate nothing) needs 'echo': true",
                              param="max_tokens", code="invalid_value")
        check_fanout(self.tm, _num_prompts(req.prompt), req.n, "prompt")
        self._check_items(req, _num_prompts(req.prompt) * req.n)
        prompts = await self.tm.run_tokenizer(key, self._completion_prompts, req.prompt)
        params = [self._sampling(req, resolve_max_tokens(self.tm, len(p), req.max_tokens, "prompt",
                                                         allow_zero=req.echo)) for p in prompts]
        echo = None
        if req.echo:
            echo = _Echo(await self.tm.run_tokenizer(key, self._prompt_texts, req.prompt, prompts), prompts, req.n)
        return await self._serve(req, request, prompts, params, extra_key, key, chat=False, top_logprobs=req.logprobs,
                                 echo=echo, lora=lora)

    def _completion_prompts(self, prompt: Any) -> list[list[int]]:
        if isinstance(prompt, str):
            prompts = [tokenize_text(self.tm, prompt, "prompt")]
        elif prompt and all(isinstance(p, str) for p in prompt):
            prompts = [tokenize_text(self.tm, p, "prompt") for p in prompt]
        elif prompt and all(isinstance(p, list) for p in prompt):
            prompts = [list(p) for p in prompt]
        else:
            prompts = [list(prompt)]
        for ids in prompts:
            check_prompt(self.tm, ids, "prompt")
        return prompts

    def _prompt_texts(self, prompt: Any, prompts: list[list[int]]) -> list[str]:
        """What `echo` repeats: text prompts as given, token-id prompts decoded."""
        if isinstance(prompt, str):
            return [prompt]
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        return [decode_all(self.tm.tokenizer, ids) for ids in prompts]

    # -------------------------------------------------------------------------- chat

    async def chat(self, req: ChatCompletionRequest, extra_key: Any, request: Request, key: Any = None) -> Response:
        self._check_common(req)
        try:
            tools = plan_request_tools(self.tool_format, req)
        except ToolError as e:
            raise bad_request(str(e), param=e.param, code="invalid_value") from None
        if req.echo:
            raise bad_request("'echo' is supported by /v1/completions only", param="echo",
                              code="unsupported_parameter")
        lora = await self.adapter_of(req.model)
        if req.top_logprobs is not None:
            if not req.logprobs:
                raise bad_request("'top_logprobs' needs 'logprobs': true", param="top_logprobs",
                                  code="invalid_value")
            check_top_logprobs(req.top_logprobs, "top_logprobs")
        check_fanout(self.tm, 1, req.n, "messages")
        self._check_items(req, req.n)
        ids = await self.tm.run_tokenizer(key, self.chat_prompt, req.messages, tools)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        params = [self._sampling(req, resolve_max_tokens(self.tm, len(ids), max_tokens, "messages", max_param),
                                 tools)]
        top_logprobs = (req.top_logprobs or 0) if req.logprobs else None
        thinking = reasoning_out.plan_reasoning(self.reasoning_parser, req, tools, self.tm.tokenizer, ids)
        params = reasoning_out.with_budget(params, reasoning_out.budget_of(self.reasoning_parser, req,
                                                                           self.tm.tokenizer, ids))
        return await self._serve(req, request, [ids], params, extra_key, key, chat=True, top_logprobs=top_logprobs,
                                 tools=tools if tools is not None and tools.parses_calls else None, lora=lora,
                                 thinking=thinking)

    def chat_prompt(self, chat: list[ChatMessage], tools: ToolPlan | None = None) -> list[int]:
        """The prompt's ids: the chat (its earlier tool calls and results, checked and legacy ones made tool ones:
        chat_history.py; and `tools`) through the template."""
        if not chat:
            raise bad_request("'messages' must hold at least one message", param="messages", code="empty_prompt")
        chat = check_history(chat, tools.names if tools is not None else None)
        for i, m in enumerate(chat):
            check_text(m.text(), f"messages.{i}.content")
        messages = template_messages(chat, self.tool_format, tools)
        native_tools = template_tools(self.tool_format, tools)
        tool_chars = len(json.dumps(native_tools, ensure_ascii=False)) if native_tools else 0
        check_prompt_chars(self.tm, sum(len(m["content"]) for m in messages) + tool_chars, "messages")
        try:
            text = self.tm.tokenizer.apply_chat_template(messages, tools=native_tools, tokenize=False,
                                                         add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - template errors are the client's messages
            raise bad_request(f"cannot apply the chat template: {e}", param="messages") from None
        ids = list(self.tm.tokenizer.encode(text, add_special_tokens=False))
        check_prompt(self.tm, ids, "messages")
        return ids

    # -------------------------------------------------------------------------- tokenizer endpoints

    async def tokenize(self, req: TokenizeRequest, key: Any = None) -> dict[str, Any]:
        self.check_model(req.model)
        await self.adapter_of(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of 'prompt' and 'messages'", param="prompt")
        if req.messages is not None:
            ids = await self.tm.run_tokenizer(key, self.chat_prompt, req.messages)
        else:
            ids = await self.tm.run_tokenizer(key, tokenize_text, self.tm, req.prompt, "prompt", req.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": self.tm.info.effective_max_context}

    async def detokenize(self, req: DetokenizeRequest, key: Any = None) -> dict[str, Any]:
        self.check_model(req.model)
        await self.adapter_of(req.model)
        return {"prompt": await self.tm.run_tokenizer(key, self._decode, req.tokens)}

    def _decode(self, tokens: list[int]) -> str:
        if tokens:
            check_prompt(self.tm, tokens, "tokens")  # NOTE: here, on the tokenizer thread: a list of any length
        return decode_all(self.tm.tokenizer, tokens)

    # -------------------------------------------------------------------------- shared

    async def _serve(self, req: Any, request: Request, prompts: list[list[int]], params: list[Any],
                     extra_key: Any, key: Any, chat: bool, top_logprobs: int | None, echo: _Echo | None = None,
                     tools: ToolPlan | None = None, lora: str | None = None,
                     thinking: reasoning_out.ReasoningPlan | None = None) -> Response:
        """`top_logprobs`: None without logprobs, else the alternatives per token; `tools`: parse calls; `lora`:
        the LoRA adapter (None: the base model); `thinking`: split reasoning from the answer (chat_reasoning.py)."""
        choice_params = [per_choice_params(p, req.n) for p in params]
        if req.rid is not None:
            check_text(req.rid, "rid")
        session = await check_session(self.tm, extra_key, req.session_id, "session_id")
        # NOTE: echo with logprobs scores every prompt from position 0 (recomputed, never a cache hit).
        outputs = generate_all(self.tm, prompts, choice_params, extra_key, top_logprobs, [req.rid] * len(prompts),
                               logprob_start_len=0 if echo is not None else -1, lora_name=lora, session=session)
        usage = _Usage([len(p) for p in prompts], req.n)
        rid = new_id("chatcmpl" if chat else "cmpl")
        logprobs = top_logprobs is not None
        if req.stream:
            include_usage = req.stream_options is not None and req.stream_options.include_usage
            streamed = reasoning_out.StreamedReasoning(thinking, self.tm.tokenizer) if thinking is not None else None
            render = self._chat_renderer(rid, usage, logprobs, tools, streamed) if chat else self._completion_renderer(
                rid, usage, logprobs, echo)
            chunk_type = ChatCompletionChunk if chat else CompletionChunk

            def finale() -> list[dict[str, Any]]:
                if not include_usage:
                    return []
                return [reasoning_out.add_reasoning_usage(chunk_type(id=rid, created=now(), model=self.model_name, choices=[],
                                                                     usage=usage.info()).model_dump(),
                                                          sum(streamed.tokens.values()) if streamed else None)]
            return await stream_response(request, outputs, render, finale, partial(self.tm.run_cpu, key, admit=False))
        watcher = DisconnectWatcher(request.receive)
        try:
            results = await guarded(lambda: watcher.run(collect(outputs, len(prompts) * req.n)))
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED)
        finally:
            watcher.close()
        for r in results:
            raise_if_aborted(r)
        for i, r in enumerate(results):
            usage.add(i, r)
        # NOTE: built and JSON-encoded on a front-end thread: with echo and logprobs it holds every prompt token.
        if chat:
            return await self.tm.run_cpu(key, self._chat_response, rid, results, usage.info(), logprobs, tools,
                                         thinking, admit=False)
        return await self.tm.run_cpu(key, self._completion_response, rid, results, usage.info(), logprobs, echo,
                                     admit=False)

    def _completion_response(self, rid: str, results: list[ChoiceResult], usage: UsageInfo, logprobs: bool,
                             echo: _Echo | None) -> JSONResponse:
        choices = []
        for i, r in enumerate(results):
            text, ids = echo.prompt(i) if echo is not None else ("", None)
            choices.append(CompletionChoice(
                index=i, text=text + r.text, finish_reason=r.finish_reason,
                logprobs=completion_logprobs(self.texts, r, echo=ids) if logprobs else None))
        body = CompletionResponse(id=rid, created=now(), model=self.model_name, choices=choices, usage=usage)
        return JSONResponse(body.model_dump())

    def _chat_response(self, rid: str, results: list[ChoiceResult], usage: UsageInfo,
                       logprobs: bool, tools: ToolPlan | None = None,
                       thinking: reasoning_out.ReasoningPlan | None = None) -> JSONResponse:
        choices = []
        for i, r in enumerate(results):
            reasoning, text = reasoning_out.whole_fields(thinking, r.text)  # NOTE: tool calls are read from the answer only
            message, reason = whole_message(tools, text, r.finish_reason) if tools else ({"content": text},
                                                                                        r.finish_reason)
            message["reasoning_content"] = reasoning
            choices.append(ChatChoice(index=i, message=ChatResponseMessage(**message), finish_reason=reason,
                                      logprobs=chat_logprobs(self.texts, r) if logprobs else None))
        body = ChatCompletionResponse(id=rid, created=now(), model=self.model_name, choices=choices, usage=usage)
        exclude = _WITHOUT_TOOL_CALLS if tools is not None and tools.legacy else _WITHOUT_FUNCTION_CALL
        return JSONResponse(reasoning_out.dump_chat(body, exclude, thinking, self.tm.tokenizer, results))

    def _completion_renderer(self, rid: str, usage: _Usage, logprobs: bool, echo: _Echo | None) -> Render:
        offsets: dict[int, int] = {}  # per choice: characters of token text sent so far, for text_offset

        def render(index: int, out: GenerateOutput) -> list[dict[str, Any]]:
            usage.add(index, out)
            # With echo, a choice's first chunk starts with its prompt (the first output follows the prefill).
            text, ids = echo.prompt(index) if echo is not None and index not in offsets else ("", None)
            offset = offsets.setdefault(index, 0)
            entries = None
            if logprobs:
                entries = completion_logprobs(self.texts, out, offset, echo=ids)
                offsets[index] = offset + sum(map(len, entries.tokens))
            choice = CompletionChoice(index=index, text=text + out.text_delta, logprobs=entries,
                                      finish_reason=out.finish_reason)
            return [CompletionChunk(id=rid, created=now(), model=self.model_name, choices=[choice]).model_dump()]
        return render

    def _chat_renderer(self, rid: str, usage: _Usage, logprobs: bool, tools: ToolPlan | None = None,
                       thinking: reasoning_out.StreamedReasoning | None = None) -> Render:
        started: set[int] = set()
        calls = StreamedCalls(tools) if tools is not None else None
        exclude = _DELTA_WITHOUT_CALLS if tools is not None and tools.legacy else _DELTA_WITHOUT_FUNCTION_CALL
        if thinking is None:
            exclude = reasoning_out.without_reasoning(exclude, "delta")

        def render(index: int, out: GenerateOutput) -> list[dict[str, Any]]:
            usage.add(index, out)
            choices = []
            if index not in started:
                started.add(index)
                choices.append(ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content="")))
            # NOTE: with logprobs every step's tokens get a chunk, even while their text is held back.
            thought, text = "", out.text_delta
            if thinking is not None:  # NOTE: the tool-call parser reads the answer part only
                thought, text = thinking.delta(index, out.text_delta, out.token_ids, out.finish_reason is not None)
            delta, reason, pieces = {"content": text or None}, out.finish_reason, {}
            if calls is not None:
                delta, reason = calls.delta(index, text, out.finish_reason)
                pieces = {k: delta.pop(k) for k in ("tool_calls", "function_call") if delta.get(k)}
            delta["reasoning_content"] = thought or None
            if delta["content"] or thought or pieces or reason is not None or (logprobs and out.token_ids):
                choices.append(ChatStreamChoice(index=index, delta=DeltaMessage(**delta),
                                                logprobs=chat_logprobs(self.texts, out) if logprobs else None,
                                                finish_reason=reason))
            chunks = [ChatCompletionChunk(id=rid, created=now(), model=self.model_name, choices=[c]).model_dump(
                exclude=exclude) for c in choices]
            if pieces:  # NOTE: OpenAI's call pieces carry only the fields they set (a later piece: no name, no id)
                chunks[-1]["choices"][0]["delta"].update(pieces)
            return chunks
        return render


def _num_prompts(prompt: Any) -> int:
    """A completions prompt: a string or a token-id list is one prompt; a list of either, one each."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return len(prompt)
    return 1
