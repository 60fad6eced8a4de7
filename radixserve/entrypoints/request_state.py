"""The Engine's per-request state: tokens arriving from the scheduler thread, waited on by the caller.

`RequestState` extends the client's (client/request_state.py, the HTTP server's base too) with every token and
logprob kept for a result or a stream."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from radixserve.client.request_state import RequestState as ClientRequestState
from radixserve.client.shaping import native_logprobs
from radixserve.client.text_stream import IncrementalDetokenizer, final_text
from radixserve.mem_cache.tiers import tier_details
from radixserve.protocol.io_struct import NO_LOGPROBS, LogprobSpec, TokenIDOut
from radixserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from radixserve.entrypoints.engine import Engine


class RequestState(ClientRequestState):
    """Written by the scheduler thread (`on_output`, `fail`), read by the caller's thread."""

    def __init__(self, rid: str, input_ids: list[int], params: SamplingParams, tokenizer: Any,
                 stream: bool, logprob: LogprobSpec = NO_LOGPROBS) -> None:
        super().__init__(rid, len(input_ids))
        self.input_ids = input_ids
        self.params = params
        self.tokenizer = tokenizer
        self.output_ids: list[int] = []
        self.logprob = logprob
        self.logprobs: list[float] = []  # with return_logprob: one per output id
        self.top_logprobs: list[list[tuple[int, float]]] = []
        self.input_logprobs: list[float | None] = []  # prompt positions logprob_start_len.. (when >= 0)
        self.input_top_logprobs: list[list[tuple[int, float]]] = []
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.increments: queue.Queue | None = queue.Queue() if stream else None

    def on_output(self, out: TokenIDOut, now: float) -> None:
        """This request's part of one scheduler message."""
        if out.input_token_logprobs is not None:  # NOTE: before the tokens, whose finish may end the request
            self.input_logprobs, self.input_top_logprobs = list(out.input_token_logprobs), list(out.input_top_logprobs)
        new_ids, finish_reason = out.new_token_ids, out.finished_reason
        self.observe(out, now)
        start = len(self.output_ids)
        self.output_ids.extend(new_ids)
        self.logprobs.extend(out.output_logprobs or ())
        self.top_logprobs.extend(out.output_top_logprobs or ())
        if self.increments is not None:
            self.increments.put((list(new_ids), finish_reason, start))
        if finish_reason is not None:
            self.done.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        if self.increments is not None:
            self.increments.put(None)
        self.done.set()

    def meta_info(self, start: int = 0, end_index: int | None = None) -> dict[str, Any]:
        """The request's figures; with return_logprob, the logprobs of output tokens [start, end_index)."""
        info = {
            "id": self.rid,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            **tier_details(self.cached_tokens_details),
            "finish_reason": self.finish_reason,
            "e2e_latency": self.elapsed(),
            "ttft": self.ttft(),
            **(self.figures or {}),
        }
        spec = self.logprob
        if spec.return_logprob:
            prompt = self.input_ids[spec.logprob_start_len:] if spec.logprob_start_len >= 0 and start == 0 else None
            # NOTE: the prompt's are empty until it was computed (a request aborted earlier never gets them).
            info |= native_logprobs(self._text, self.output_ids[start:end_index], self.logprobs[start:end_index],
                                    self.top_logprobs[start:end_index], prompt, self.input_logprobs,
                                    self.input_top_logprobs)
        return info

    def token_logprobs(self, start: int = 0, end: int | None = None) -> list[list[Any]]:
        """[logprob, token id, token text] of each output token, as SGLang's `output_token_logprobs`."""
        return native_logprobs(self._text, self.output_ids[start:end], self.logprobs[start:end],
                               self.top_logprobs[start:end])["output_token_logprobs"]

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def result(self) -> dict[str, Any]:
        return {"text": final_text(self.tokenizer, self.output_ids, self.finish_reason, self.params.skip_special_tokens),
                "output_ids": list(self.output_ids), "meta_info": self.meta_info()}


class RequestHandle:
    """What `Engine.submit` returns: wait for the result, iterate over increments, or abort."""

    def __init__(self, state: RequestState, engine: Engine) -> None:
        self._state = state
        self._engine = engine

    @property
    def rid(self) -> str:
        return self._state.rid

    def done(self) -> bool:
        return self._state.done.is_set()

    def abort(self) -> None:
        self._engine.abort(self.rid)

    def result(self, timeout: float | None = None) -> dict[str, Any]:
        """Block until the request finished; {text, output_ids, meta_info}. Raises if the engine failed."""
        if not self._state.done.wait(timeout):
            raise TimeoutError(f"request {self.rid} not finished after {timeout} s")
        self._raise_error()
        return self._state.result()

    def stream(self) -> Iterator[dict[str, Any]]:
        """Yield {text, output_ids, finished, meta_info} increments; closing the iterator early aborts."""
        state = self._state
        if state.increments is None:
            raise ValueError("this request was not submitted with stream=True")
        detok = IncrementalDetokenizer(state.tokenizer, state.params.stop, state.params.skip_special_tokens)
        finished = False
        try:
            while not finished:
                item = state.increments.get()
                if item is None:
                    self._raise_error()
                new_ids, finish_reason, start = item
                finished = finish_reason is not None
                text = detok.finish(new_ids, finish_reason) if finished else detok.feed(new_ids)
                yield {"text": text, "output_ids": new_ids, "finished": finished,
                       "meta_info": state.meta_info(start, start + len(new_ids))}
        finally:
            if not finished:
                self.abort()

    def _raise_error(self) -> None:
        if self._state.error is not None:
            raise RuntimeError(f"request {self.rid} failed: {self._state.error}") from self._state.error
