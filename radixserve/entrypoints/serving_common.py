"""Pieces shared by the OpenAI and native endpoints: disconnect watching, SSE, fan-out, sampling params."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from radixserve.entrypoints.http_errors import ApiError, bad_request, check_text, overloaded, unavailable
from radixserve.entrypoints.logprobs import share_prompt_logprobs
from radixserve.frontend.frontend_io import FinishView
from radixserve.frontend.tokenizer_manager import (
    GenerateOutput,
    GenerateReq,
    SchedulerBusy,
    SchedulerUnavailable,
    TokenizerManager,
    TopLogprobs,
)
from radixserve.protocol.requests import check_length
from radixserve.sampling_params import SamplingParams, SamplingParamsError, check_input_ids

T = TypeVar("T")
END = object()  # sentinel: a stream has no more items


class ClientDisconnected(Exception):
    pass


class DisconnectWatcher:
    """Races request work against the client going away (Starlette does not cancel plain handlers).

    NOTE: the work runs in its own task and is cancelled on disconnect; a cancelled `generate()`
    sends AbortReq from its `finally`, so the scheduler drops the request at its next step.
    """

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self._task: asyncio.Task | None = None

    async def _wait(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass

    async def run(self, work: Awaitable[T]) -> T:
        if self._task is None:
            self._task = asyncio.ensure_future(self._wait())
        job = asyncio.ensure_future(work)
        try:
            done, _ = await asyncio.wait({job, self._task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not job.done():
                job.cancel()
                await asyncio.gather(job, return_exceptions=True)
        if job in done:
            return job.result()
        raise ClientDisconnected()

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()


class EventStreamResponse(StreamingResponse):
    """Server-sent events; stops (and so aborts the request) as soon as the client disconnects."""

    def __init__(self, events: AsyncIterator[bytes], watcher: DisconnectWatcher) -> None:
        super().__init__(events, headers={"cache-control": "no-cache", "x-accel-buffering": "no"},
                         media_type="text/event-stream")
        self._events = events
        self._watcher = watcher

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        try:
            async with aclosing(self._events) as events:
                while True:
                    event = await self._watcher.run(anext(events, END))
                    if event is END:
                        break
                    await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except (ClientDisconnected, OSError):
            pass
        finally:
            self._watcher.close()


def sse(data: Any) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


async def merge_outputs(gens: list[AsyncIterator[GenerateOutput]]) -> AsyncIterator[tuple[int, GenerateOutput]]:
    """Interleaves several requests' outputs as (choice index, output); closing it aborts them all."""
    if len(gens) == 1:
        async with aclosing(gens[0]) as gen:
            async for out in gen:
                yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, gen: AsyncIterator[GenerateOutput]) -> None:
        try:
            async with aclosing(gen):
                async for out in gen:
                    queue.put_nowait((index, out))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((index, e))
        queue.put_nowait((index, END))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is END:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@dataclass
class ChoiceResult(FinishView):
    """Everything one finished choice produced (non-streaming responses)."""

    rid: str = ""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish: dict[str, Any] | None = None  # the scheduler's finish reason, whole (FinishView)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[float] = field(default_factory=list)  # with logprobs: one per token id
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    input_logprobs: list[float | None] | None = None  # with prompt logprobs, once they arrived
    input_top_logprobs: list[TopLogprobs] | None = None
    figures: dict[str, float] | None = None  # the scheduler's (TokenIDOut.figures)
    cached_tokens_details: dict[str, int] | None = None  # by tier, with the hierarchical cache

    def add(self, out: GenerateOutput) -> None:
        self.rid = out.rid
        self.text += out.text_delta
        self.token_ids += out.token_ids
        self.finish = out.finish
        self.prompt_tokens = out.prompt_tokens
        self.completion_tokens = out.completion_tokens
        self.cached_tokens = out.cached_tokens
        self.cached_tokens_details = out.cached_tokens_details or self.cached_tokens_details
        self.figures = out.figures or self.figures
        self.logprobs += out.logprobs or []
        self.top_logprobs += out.top_logprobs or []
        if out.input_logprobs is not None:
            self.input_logprobs, self.input_top_logprobs = out.input_logprobs, out.input_top_logprobs


async def collect(outputs: AsyncIterator[tuple[int, GenerateOutput]], num_choices: int) -> list[ChoiceResult]:
    results = [ChoiceResult() for _ in range(num_choices)]
    async with aclosing(outputs) as stream:
        async for index, out in stream:
            results[index].add(out)
    return results


CLIENT_ABORT = 499  # the scheduler's status of an abort the client asked for (/abort_request, disconnect)
CLIENT_CLOSED = CLIENT_ABORT  # nginx's code; nobody reads it, the client is gone
_INLINE_EVENT_TOKENS = 256  # a stream event with more tokens is rendered off the loop


def raise_if_aborted(result: ChoiceResult | GenerateOutput) -> None:
    # NOTE: an abort the client asked for is a normal end: finish_reason "abort" and the partial output.
    if result.finish_reason == "abort" and result.finish_status != CLIENT_ABORT:
        # NOTE: 404: a LoRA adapter unloaded between the front end's check and the request's arrival
        status = result.finish_status if result.finish_status in (400, 404, 500, 503) else 500
        raise ApiError(status, f"request aborted by the scheduler: {result.finish_message or 'no reason given'}",
                       code="request_aborted")


async def guarded(work: Callable[[], Awaitable[T]]) -> T:
    try:
        return await work()
    except SchedulerUnavailable as e:
        raise unavailable(str(e)) from None
    except SchedulerBusy as e:
        raise overloaded(str(e)) from None


# ---------------------------------------------------------------------------------- requests in


_PARAM_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "json_schema": "response_format",
                "structural_tag": "response_format"}


def token_id_keys(bias: dict[str, float] | None, vocab_size: int, param: str = "logit_bias") -> dict[int, float] | None:
    """OpenAI's logit_bias has token ids as JSON object keys (strings of ASCII digits); the sampler takes ints."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        # NOTE: str.isdigit() is true for "²" (int() fails) and "٣" (int() gives 3): ASCII digits only.
        token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10 else None
        if token is None or not 0 <= token < vocab_size:
            raise bad_request(f"'{param}' keys must be token ids in [0, {vocab_size}), got {key!r}"[:200], param=param,
                              code="invalid_value")
        out[token] = value
    return out


def make_sampling_params(openai_names: bool, vocab_size: int, **values: Any) -> SamplingParams:
    """SamplingParams checked on their own and against the model's vocabulary; a 400 naming the field."""
    try:
        params = SamplingParams(**values)
        params.verify_for_model(vocab_size)
        return params
    except SamplingParamsError as e:
        param = _PARAM_NAMES.get(e.param, e.param) if openai_names else f"sampling_params.{e.param}"
        raise bad_request(f"invalid '{param}': {str(e)[len(e.param) + 1:]}", param=param,
                          code="invalid_value") from None


def check_fanout(tm: TokenizerManager, num_prompts: int, n: int, param: str) -> None:
    """One request runs prompts x n sequences; more than --max-request-fanout is refused before any work."""
    limit = tm.config.max_request_fanout
    if num_prompts * n > limit:
        raise bad_request(f"this request runs {num_prompts} prompt(s) x n={n} = {num_prompts * n} sequences; "
                          f"the server takes at most {limit} per request (--max-request-fanout)",
                          param="n" if n > 1 else param, code="too_many_sequences")


def check_request_items(tm: TokenizerManager, *, sequences: int, stop: Any, stop_token_ids: list | None,
                        logit_bias: dict | None, prefix: str = "") -> None:
    """Per-sequence items (stop ids, bias entries, stop strings) are copied into every sequence, so their
    product with the sequences is bounded (each field alone was bounded before validation: request_bounds.py)."""
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    per_sequence = {"stop_token_ids": len(stop_token_ids or ()), "logit_bias": len(logit_bias or ()),
                    "stop": len(stops)}
    items = sequences * sum(per_sequence.values())
    limit = tm.config.bounds.max_request_items
    if items > limit:
        largest = max(per_sequence, key=per_sequence.__getitem__)  # NOTE: the param names the biggest part
        raise bad_request(f"this request copies {items} per-sequence items ({sequences} sequence(s) x "
                          f"{per_sequence['stop_token_ids']} stop token ids, {per_sequence['logit_bias']} logit_bias "
                          f"entries and {per_sequence['stop']} stop strings); the server takes at most {limit} "
                          "(--max-request-items)", param=prefix + largest, code="over_limit")


def tokenize_text(tm: TokenizerManager, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
    """Encodes a prompt (on the tokenizer thread); a text too long for any tokenization is refused unread."""
    check_text(text, param)
    check_prompt_chars(tm, len(text), param)
    return list(tm.tokenizer.encode(text, add_special_tokens=add_special_tokens))


def check_prompt_chars(tm: TokenizerManager, chars: int, param: str) -> None:
    """A text longer than the context times the longest vocabulary entry cannot fit however it is tokenized:
    refused before any tokenization (a 3.9 MB chat message took 4.3 s to tokenize, then was too long)."""
    limit = tm.max_prompt_chars
    if limit is not None and chars > limit:
        raise bad_request(f"The {param} has {chars} characters, more than this model's maximum context of "
                          f"{tm.info.context_len} tokens can hold ({limit} characters at most, however it is "
                          f"tokenized). Please reduce the length of the {param}.", param=param,
                          code="context_length_exceeded")


def generate_all(tm: TokenizerManager, prompts: list[list[int]], choice_params: list[list[SamplingParams]],
                 extra_key: Any, top_logprobs: int | None = None, client_rids: list[str | None] | None = None,
                 logprob_start_len: int = -1, lora_name: str | None = None,
                 session: tuple[str, str] | None = None) -> AsyncIterator[tuple[int, GenerateOutput]]:
    """One request per (prompt, choice); choice index = prompt index * n + choice.

    `top_logprobs`: None for no logprobs, else the alternatives to return per token (0 for none).
    `client_rids`: the client's rid of each prompt (its choices share it), for /abort_request.
    `logprob_start_len`: with logprobs, also score every prompt from this position (-1: not).
    `lora_name`: the LoRA adapter every sequence runs (None: the base model).
    `session`: (the open agent session every sequence belongs to, the field that named it), or None."""
    rids = client_rids or [None] * len(prompts)
    logprobs = top_logprobs is not None
    try:
        tm.check_capacity(sum(len(p) for p in choice_params), extra_key)
    except SchedulerBusy as e:
        raise overloaded(str(e)) from None
    group = object()  # NOTE: its sequences share one turn in fair admission
    scored = logprobs and logprob_start_len >= 0
    gens = [tm.generate(GenerateReq(ids, params, extra_key, logprobs, top_logprobs or 0,
                                    logprob_start_len if scored and choice == 0 else -1, client_rid=rid, group=group,
                                    lora_name=lora_name, session_id=session[0] if session else None,
                                    session_field=session[1] if session else "session_id"))
            for ids, per_prompt, rid in zip(prompts, choice_params, rids, strict=True)
            for choice, params in enumerate(per_prompt)]
    n = len(choice_params[0]) if choice_params else 1
    # NOTE: choice 0 of each prompt scores it; its siblings get a copy (logprobs.share_prompt_logprobs)
    return share_prompt_logprobs(merge_outputs(gens), n) if scored and n > 1 else merge_outputs(gens)


def check_prompt(tm: TokenizerManager, ids: list[int], param: str) -> None:
    if not ids:
        raise bad_request(f"'{param}' is empty; give at least one token", param=param, code="empty_prompt")
    try:
        check_input_ids(ids, tm.info.vocab_size, param)
    except SamplingParamsError as e:
        raise bad_request(f"{str(e)[len(e.param) + 1:]} (in '{param}')", param=param,
                          code="invalid_token_id") from None


def resolve_max_tokens(tm: TokenizerManager, prompt_len: int, max_tokens: int | None, param: str,
                       max_param: str = "max_tokens", allow_zero: bool = False) -> int:
    """`max_tokens` unset means the rest of the effective context (model context and KV pool).

    `allow_zero`: the request scores its prompt, so 0 (generate nothing) is a valid ask."""
    least = 0 if allow_zero else 1
    if max_tokens is not None and max_tokens < least:
        raise bad_request(f"'{max_param}' must be at least {least}, got {max_tokens}", param=max_param,
                          code="invalid_value")
    limits = tm.info.limits
    asked = max_tokens if max_tokens is not None else max(limits.longest_request - prompt_len, 1)
    too_long = check_length(prompt_len, asked, limits, "messages" if param == "messages" else "prompt")
    if too_long is not None:
        raise bad_request(too_long.message, param=param if too_long.prompt_too_long else max_param, code=too_long.code)
    return asked


Render = Callable[[int, GenerateOutput], list[dict[str, Any]]]


async def stream_response(request: Request, outputs: AsyncIterator[tuple[int, GenerateOutput]], render: Render,
                          finale: Callable[[], list[dict[str, Any]]],
                          offload: Callable[..., Awaitable[Any]] | None = None) -> Response:
    """SSE whose status line waits for the first output, so a dead scheduler is still a 503.

    `offload(fn, *args)`: where a big event is rendered (one with prompt logprobs, or many tokens), off the loop."""

    def events_of(index: int, out: GenerateOutput) -> bytes:
        return b"".join(sse(chunk) for chunk in render(index, out))

    watcher = DisconnectWatcher(request.receive)
    try:
        first = await guarded(lambda: watcher.run(anext(outputs, END)))
    except ClientDisconnected:
        watcher.close()
        await outputs.aclose()
        return Response(status_code=CLIENT_CLOSED)
    except BaseException:
        watcher.close()
        await outputs.aclose()
        raise

    async def events() -> AsyncIterator[bytes]:
        item = first
        async with aclosing(outputs):
            try:
                while item is not END:
                    index, out = item
                    raise_if_aborted(out)
                    big = out.input_logprobs is not None or len(out.token_ids) > _INLINE_EVENT_TOKENS
                    yield await offload(events_of, index, out) if big and offload else events_of(index, out)
                    item = await anext(outputs, END)
                for chunk in finale():
                    yield sse(chunk)
            except SchedulerUnavailable as e:
                yield sse(unavailable(str(e)).body())
            except ApiError as e:
                yield sse(e.body())
        yield sse("[DONE]")

    return EventStreamResponse(events(), watcher)
