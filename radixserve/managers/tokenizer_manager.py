"""The HTTP process's side of the split: validates, assigns rids, talks to the scheduler over ZMQ, streams.

One `TokenizerManager` per server, living on the server's asyncio loop. `generate()` sends one
`TokenizedGenerateReqInput` and yields `GenerateOutput`s (text deltas from incremental
detokenization) until the request ends. Leaving the generator early (client gone, task cancelled)
sends `AbortReq`, which the scheduler handles at its next step. A watchdog probes the scheduler with
`GetInternalStateReq`; if the process dies every request in flight fails with `SchedulerUnavailable`
(HTTP 503), and if it stops answering `health()` reports it. The sockets (`SchedulerLink`, scheduler_link.py) are bound
before the scheduler process starts, and `start()` returns only once the scheduler is connected.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import zmq

from radixserve.managers.io_struct import (
    AbortReq,
    BatchTokenIDOut,
    FlushCacheOut,
    FlushCacheReq,
    GetInternalStateOut,
    GetInternalStateReq,
    TokenizedGenerateReqInput,
)
from radixserve.managers.scheduler_link import SchedulerLink, SchedulerUnavailable
from radixserve.managers.scheduler_process import SchedulerInfo
from radixserve.managers.text_stream import IncrementalDetokenizer
from radixserve.managers.tokenizer_metrics import ServerMetrics
from radixserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

def cache_namespace(api_key_id: str | None, cache_salt: str | None, extra_key: str | None) -> tuple | None:
    """The structured `extra_key` of the radix key: a tuple of (kind, value) pairs, or None (shared).

    NOTE: never concatenate strings here; ("salt", "a") and ("key", "a") differ, and no chosen string
    can reach another tenant's ("api", id) component, which the server derives from the API key and
    always puts first, so a client salt can only narrow its own namespace.
    """
    parts = []
    if api_key_id is not None:
        parts.append(("api", api_key_id))
    if cache_salt is not None:
        parts.append(("salt", cache_salt))
    if extra_key is not None:
        parts.append(("key", extra_key))
    return tuple(parts) or None


def namespace_owner(extra_key: tuple | None) -> str | None:
    """The API key id a request's namespace starts with (see cache_namespace), or None."""
    if extra_key and extra_key[0][0] == "api":
        return extra_key[0][1]
    return None


def api_key_id(key: str) -> str:
    return hashlib.sha256(b"radixserve-namespace\0" + key.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class FrontendConfig:
    """HTTP-side knobs that are not engine arguments."""

    max_body_bytes: int = 4 * 1024 * 1024
    health_timeout_s: float = 30.0  # /health fails when the scheduler has been silent this long
    heartbeat_interval_s: float = 1.0
    control_timeout_s: float = 30.0  # flush_cache, get_server_info, health_generate


TopLogprobs = list[tuple[int, float]]  # (token id, logprob) of one position's alternatives, most likely first


@dataclass
class GenerateReq:
    input_ids: list[int]
    sampling_params: SamplingParams
    extra_key: Any = None
    return_logprob: bool = False
    top_logprobs_num: int = 0  # with return_logprob: alternatives per token, at most MAX_TOP_LOGPROBS
    logprob_start_len: int = -1  # with return_logprob: also score the prompt from this position (-1: no)
    client_rid: str | None = None  # the client's name for it (SGLang's rid), for /abort_request


@dataclass
class GenerateOutput:
    rid: str
    text_delta: str
    token_ids: list[int]  # new token ids of this step
    finish_reason: str | None  # "stop" | "length" | "abort" once finished
    finish_message: str | None
    finish_status: int | None  # an abort's HTTP-like status from the scheduler (400, 499, 500)
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    # With return_logprob: one entry per token of `token_ids` (a matched stop token included).
    logprobs: list[float] | None = None
    top_logprobs: list[TopLogprobs] | None = None
    # With logprob_start_len >= 0, in one output only (the first after the prompt was computed): one
    # entry per prompt position from logprob_start_len on (None and [] at position 0); else None.
    input_logprobs: list[float | None] | None = None
    input_top_logprobs: list[TopLogprobs] | None = None


@dataclass
class _Step:
    new_ids: list[int]
    finished: dict[str, Any] | None
    completion_tokens: int
    cached_tokens: int
    logprobs: list[float] | None = None
    top_logprobs: list[TopLogprobs] | None = None
    input_logprobs: list[float | None] | None = None
    input_top_logprobs: list[TopLogprobs] | None = None


@dataclass
class _ReqState:
    rid: str
    prompt_len: int
    created: float = field(default_factory=time.monotonic)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    last_token_at: float | None = None
    cached_tokens: int = 0
    done: bool = False
    client_rid: str | None = None
    owner: str | None = None


class TokenizerManager:
    def __init__(self, info: SchedulerInfo, link: SchedulerLink, process: Any = None,
                 config: FrontendConfig | None = None) -> None:
        self.info = info
        self.tokenizer = info.tokenizer
        self.config = config or FrontendConfig()
        self.process = process
        self.metrics = ServerMetrics(lambda: self.scheduler_state, lambda: self.health()[0])
        self.scheduler_state: dict[str, Any] = {}
        self._link = link
        self._send_sock = link.requests
        self._recv_sock = link.outputs
        self._states: dict[str, _ReqState] = {}
        self._flush_waiters: deque[asyncio.Future] = deque()
        self._state_waiters: deque[asyncio.Future] = deque()
        self._reply_waiters: dict[type, deque[asyncio.Future]] = {}  # request_reply, by reply type
        self._dead: str | None = None
        self._last_alive = time.monotonic()
        self._probe_pending = False
        self._tasks: list[asyncio.Task] = []

    # ------------------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Returns once the scheduler is connected, so the first request can be sent at once."""
        # NOTE: sends never block the event loop (NOBLOCK); with the scheduler connected, EAGAIN means
        # it is gone or 1000 messages behind, and a 503 at once is the right answer to both.
        await self._link.wait_connected()
        self._last_alive = time.monotonic()
        self._tasks = [asyncio.create_task(self._handle_loop()), asyncio.create_task(self._watchdog_loop())]

    async def shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._link.close()

    @property
    def num_in_flight(self) -> int:
        return len(self._states)

    def in_flight_rids(self) -> list[str]:
        return list(self._states)

    # ------------------------------------------------------------------------------ requests

    async def generate(self, req: GenerateReq) -> AsyncIterator[GenerateOutput]:
        """Yields the outputs of one request. Close it (aclosing) to abort the request early."""
        self._ensure_alive()
        rid = uuid.uuid4().hex
        state = _ReqState(rid, len(req.input_ids), client_rid=req.client_rid, owner=namespace_owner(req.extra_key))
        # NOTE: the scheduler matches stop strings; the detokenizer only holds back their possible prefixes.
        detok = IncrementalDetokenizer(self.tokenizer, req.sampling_params.stop)
        self._states[rid] = state
        try:
            self._send(TokenizedGenerateReqInput(
                rid, list(req.input_ids), req.sampling_params, req.extra_key, stream=True,
                return_logprob=req.return_logprob, top_logprobs_num=req.top_logprobs_num,
                logprob_start_len=req.logprob_start_len))
            while True:
                step = await state.queue.get()
                if isinstance(step, Exception):
                    raise step
                finished = step.finished
                delta = detok.feed(step.new_ids) if finished is None else detok.finish(step.new_ids, finished)
                yield GenerateOutput(
                    rid=rid, text_delta=delta, token_ids=step.new_ids,
                    finish_reason=None if finished is None else str(finished.get("type", "stop")),
                    finish_message=None if finished is None else finished.get("message"),
                    finish_status=None if finished is None else finished.get("status_code"),
                    prompt_tokens=state.prompt_len, completion_tokens=step.completion_tokens,
                    cached_tokens=step.cached_tokens, logprobs=step.logprobs, top_logprobs=step.top_logprobs,
                    input_logprobs=step.input_logprobs, input_top_logprobs=step.input_top_logprobs)
                if finished is not None:
                    return
        finally:
            self._states.pop(rid, None)
            if not state.done:
                self._abort_state(state, count=True)

    def abort_request(self, client_rid: str | None, owner: str | None, abort_all: bool = False) -> int:
        """Ask the scheduler to abort `owner`'s requests named `client_rid` (all of them with `abort_all`).

        They end as usual, with finish reason abort (status 499), and their partial output; returns how many."""
        hits = [s for s in self._states.values()
                if not s.done and s.owner == owner and (abort_all or s.client_rid == client_rid)]
        for state in hits:
            self._send(AbortReq(state.rid), quiet=True)
        return len(hits)

    def _abort_state(self, state: _ReqState, count: bool) -> None:
        state.done = True
        if self._dead is None:
            self._send(AbortReq(state.rid), quiet=True)
        if count:
            self._observe_finished(state, aborted=True)

    # ------------------------------------------------------------------------------ control

    async def flush_cache(self) -> FlushCacheOut:
        return await self._control(FlushCacheReq(), self._flush_waiters)

    async def get_internal_state(self, timeout_s: float | None = None) -> dict[str, Any]:
        return await self._control(GetInternalStateReq(), self._state_waiters, timeout_s)

    async def request_reply(self, msg: Any, reply_type: type, timeout_s: float | None = None) -> Any:
        """Send a control message that the scheduler answers with one `reply_type` message (in order)."""
        return await self._control(msg, self._reply_waiters.setdefault(reply_type, deque()), timeout_s)

    async def _control(self, msg: Any, waiters: deque, timeout_s: float | None = None) -> Any:
        self._ensure_alive()
        future = asyncio.get_running_loop().create_future()
        waiters.append(future)
        self._send(msg)
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout_s or self.config.control_timeout_s)
        except asyncio.TimeoutError:
            raise SchedulerUnavailable(f"scheduler did not answer {type(msg).__name__} in time") from None

    def health(self) -> tuple[bool, str]:
        if self._dead is not None:
            return False, self._dead
        silent = time.monotonic() - self._last_alive
        if silent > self.config.health_timeout_s:
            return False, f"scheduler has not answered for {silent:.1f} s (stuck?)"
        return True, "ok"

    def _ensure_alive(self) -> None:
        if self._dead is not None:
            raise SchedulerUnavailable(self._dead)

    def _send(self, msg: Any, quiet: bool = False) -> None:
        try:
            self._send_sock.send_pyobj(msg, flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:
            if not quiet:
                raise SchedulerUnavailable(f"cannot reach the scheduler: {e}") from None

    # ------------------------------------------------------------------------------ loops

    async def _handle_loop(self) -> None:
        while True:
            out = await self._recv_sock.recv_pyobj()
            self._last_alive = time.monotonic()
            if isinstance(out, BatchTokenIDOut):
                self._dispatch(out)
            elif isinstance(out, GetInternalStateOut):
                self.scheduler_state = out.state
                _resolve_oldest(self._state_waiters, out.state)
            elif isinstance(out, FlushCacheOut):
                _resolve_oldest(self._flush_waiters, out)
            elif type(out) in self._reply_waiters:
                _resolve_oldest(self._reply_waiters[type(out)], out)
            else:
                logger.warning("unexpected message from the scheduler: %r", type(out).__name__)

    def _dispatch(self, out: BatchTokenIDOut) -> None:
        now = time.monotonic()
        for i, rid in enumerate(out.rids):
            state = self._states.get(rid)
            if state is None or state.done:
                continue  # aborted here already; late outputs are dropped
            new_ids = list(out.new_token_ids[i])
            self._observe_step(state, len(new_ids), now)
            state.cached_tokens = out.cached_tokens[i]
            finished = out.finished_reasons[i]
            state.queue.put_nowait(_Step(new_ids, finished, out.completion_tokens[i], out.cached_tokens[i],
                                         out.output_logprobs[i], out.output_top_logprobs[i],
                                         out.input_token_logprobs[i], out.input_top_logprobs[i]))
            if finished is not None:
                state.done = True
                self._observe_finished(state, aborted=finished.get("type") == "abort")

    def _observe_step(self, state: _ReqState, num_new: int, now: float) -> None:
        if num_new == 0:
            return
        if state.last_token_at is None:
            self.metrics.observe_first_token(now - state.created)
            self.metrics.observe_tokens(num_new, None)
        else:
            self.metrics.observe_tokens(num_new, now - state.last_token_at)
        state.last_token_at = now

    def _observe_finished(self, state: _ReqState, aborted: bool) -> None:
        self.metrics.observe_finished(state.prompt_len, state.cached_tokens, time.monotonic() - state.created,
                                      aborted)

    async def _watchdog_loop(self) -> None:
        while self._dead is None:
            await asyncio.sleep(min(0.2, self.config.heartbeat_interval_s))
            if self.process is not None and not self.process.is_alive():
                self._mark_dead(f"scheduler process exited with code {self.process.exitcode}")
                return
            if self._link.disconnects():
                logger.warning("the scheduler dropped its request connection; sends fail until it reconnects")
            quiet_for = time.monotonic() - self._last_alive
            if not self._probe_pending and quiet_for >= self.config.heartbeat_interval_s:
                asyncio.create_task(self._probe())

    async def _probe(self) -> None:
        self._probe_pending = True
        try:
            await self.get_internal_state(timeout_s=max(self.config.health_timeout_s * 4, 60.0))
        except SchedulerUnavailable:
            pass
        finally:
            self._probe_pending = False

    def _mark_dead(self, reason: str) -> None:
        logger.error("%s; failing %d request(s) in flight", reason, len(self._states))
        self._dead = reason
        error = SchedulerUnavailable(reason)
        for state in list(self._states.values()):
            if not state.done:
                state.done = True
                self._observe_finished(state, aborted=True)
            state.queue.put_nowait(error)
        for waiters in (self._flush_waiters, self._state_waiters, *self._reply_waiters.values()):
            while waiters:
                future = waiters.popleft()
                if not future.done():
                    future.set_exception(error)


def _resolve_oldest(waiters: deque, value: Any) -> None:
    # NOTE: the scheduler answers control messages in the order it received them.
    while waiters:
        future = waiters.popleft()
        if not future.done():
            future.set_result(value)
            return
