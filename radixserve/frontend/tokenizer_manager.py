"""The HTTP process's side of the split: assigns rids, talks to the scheduler over ZMQ, streams.

One `TokenizerManager` per server, living on the server's asyncio loop. `generate()` waits for its
ticket from `FairAdmission` (fair_admission.py), sends one `TokenizedGenerateReqInput` and yields
`GenerateOutput`s (text deltas from incremental detokenization, done on a worker thread) until the
request ends. Leaving the generator early (client gone, task cancelled) sends `AbortReq`. Control
messages go through the link's outbox and are never lost (scheduler_link.py); generate requests meet
backpressure instead (`SchedulerBusy`, HTTP 503 with Retry-After).

Liveness: a watchdog probes the scheduler with `GetInternalStateReq`. If the process dies, every
request in flight fails with `SchedulerUnavailable` (HTTP 503) and the scheduler is restarted with
fresh pools (requests arriving meanwhile wait for it), within a restart budget; once it is spent the
server is told to exit (`supervisor.on_fatal`). `health()` says which of these states it is in. That
watch is a part of its own (scheduler_supervisor.py); the request and output types are frontend_io.py's.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from radixserve.client.request_state import RequestState
from radixserve.client.scheduler_client import SchedulerClient
from radixserve.client.text_stream import IncrementalDetokenizer, max_prompt_chars
from radixserve.frontend.fair_admission import FairAdmission, Ticket
from radixserve.frontend.fair_work import FairWork, FrontendBusy
from radixserve.frontend.frontend_io import FrontendConfig, GenerateOutput, GenerateReq, TopLogprobs
from radixserve.frontend.scheduler_link import SchedulerBusy, SchedulerLink, SchedulerUnavailable
from radixserve.frontend.scheduler_supervisor import Launcher, SchedulerSupervisor
from radixserve.frontend.tenant_namespace import api_key_id, cache_namespace, namespace_owner
from radixserve.frontend.tokenizer_metrics import ServerMetrics
from radixserve.protocol.io_struct import (
    BatchTokenIDOut,
    CheckSessionReq,
    CloseSessionReq,
    FlushCacheOut,
    FlushCacheReq,
    GetInternalStateOut,
    GetInternalStateReq,
    LogprobSpec,
    OpenSessionReq,
    SessionOut,
)
from radixserve.protocol.requests import generate_message
from radixserve.protocol.scheduler_info import SchedulerInfo

logger = logging.getLogger(__name__)

__all__ = ["FrontendBusy", "FrontendConfig", "GenerateOutput", "GenerateReq", "SchedulerBusy", "SchedulerUnavailable",
           "TokenizerManager", "TopLogprobs", "api_key_id", "cache_namespace", "namespace_owner"]


# NOTE: what the parser processes need (http_errors.decode_body and the request models), imported at start.
_PARSER_MODULES = ("radixserve.entrypoints.http_errors", "radixserve.entrypoints.openai_protocol")


class _ReqState(RequestState):
    """The client's request state (client/request_state.py, the Engine's base too) with the HTTP side's delivery:
    its admission ticket, its detokenizer and the asyncio queue its generator reads."""

    def __init__(self, rid: str, prompt_len: int, detok: IncrementalDetokenizer, client_rid: str | None = None,
                 owner: str | None = None) -> None:
        super().__init__(rid, prompt_len)
        self.prompt_len = prompt_len  # NOTE: the prompt as sent (the records' prompt_tokens are the scheduler's)
        self.detok = detok
        self.ticket: Ticket | None = None  # from fair admission, once granted
        self.held: asyncio.Future | None = None  # while waiting for the ticket: resolved to end it before it is sent
        self.link: SchedulerLink | None = None  # the link it was sent on
        self.sent = False
        self.queue: asyncio.Queue = asyncio.Queue()
        self.done = False  # finished, or aborted here: later records are dropped
        self.client_rid = client_rid
        self.owner = owner


class TokenizerManager:
    """The scheduler's client on the HTTP side: requests in (fair admission), outputs out (detokenized),
    control messages and their replies; its `supervisor` watches the scheduler process."""

    def __init__(self, info: SchedulerInfo, link: SchedulerLink, process: Any = None,
                 config: FrontendConfig | None = None, launcher: Launcher | None = None) -> None:
        self.info = info
        self.tokenizer = info.tokenizer
        self.config = config or FrontendConfig()
        self.process = process
        self.metrics = ServerMetrics(lambda: self.scheduler_state, lambda: self.health()[0])
        self.scheduler_state: dict[str, Any] = {}
        self.admission = FairAdmission(info.max_running_requests, self.config.fair_share_slice)
        self.supervisor = SchedulerSupervisor(self, self.config, launcher)
        self._link = link
        # NOTE: the scheduler's client (radixserve/client/), the Engine's too: requests in flight, control replies,
        # over the link as its transport; this class adds fair admission, detokenizing and asyncio.
        self.client: SchedulerClient[_ReqState] = SchedulerClient(link)
        self._handle_task: asyncio.Task | None = None
        # NOTE: tokenizing, detokenizing and the other CPU work have threads of their own, so requests in are
        # never queued behind outputs out; the tokenizer and detokenizer threads have one tokenizer copy each
        # (a fast tokenizer is not meant to be shared across threads). Work in takes turns by key (fair_work).
        self.parse_work = FairWork(self.config.frontend_workers, self.config.max_frontend_queue, "parse", True)
        self.cpu_work = FairWork(self.config.frontend_workers, self.config.max_frontend_queue, "frontend")
        self.tokenize_work = FairWork(1, self.config.max_frontend_queue, "tokenize")
        self._detokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="radixserve-detokenize")
        self._detok_tokenizer = _private_copy(self.tokenizer)
        self.max_prompt_chars = max_prompt_chars(self.tokenizer, info.context_len)

    # ------------------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Returns once the scheduler is connected, so the first request can be sent at once."""
        await asyncio.gather(self._link.wait_connected(), self.parse_work.warm(*_PARSER_MODULES))
        self._handle_task = asyncio.create_task(self._handle_loop(self._link))
        self.supervisor.start()

    async def shutdown(self) -> None:
        await self.supervisor.stop()
        await self.detach()
        self.parse_work.shutdown()
        self.cpu_work.shutdown()
        self.tokenize_work.shutdown()
        self._detokenize_pool.shutdown(wait=False, cancel_futures=True)

    async def run_tokenizer(self, key: Any, fn: Callable[..., Any], *args: Any) -> Any:
        """Runs tokenizer work (encode, chat template) on the tokenizer thread, off the event loop, when `key`'s
        turn comes (fair_work). Raises FrontendBusy when too many wait."""
        return await self.tokenize_work.run(key, fn, *args)

    async def run_parse(self, key: Any, fn: Callable[..., Any], *args: Any) -> Any:
        """Runs `fn(*args)` (a module-level function; arguments and result are pickled) in a parser process when
        `key`'s turn comes: body parsing and validation. Raises FrontendBusy when too many wait."""
        return await self.parse_work.run(key, fn, *args)

    async def run_cpu(self, key: Any, fn: Callable[..., Any], *args: Any, admit: bool = True) -> Any:
        """Runs other CPU work of a request (parsing, validation, rendering a big response) on a front-end thread,
        off the event loop, when `key`'s turn comes. Raises FrontendBusy when too many wait (unless `admit` is
        False: the rest of a request already taken in)."""
        return await self.cpu_work.run(key, fn, *args, admit=admit)

    @property
    def link(self) -> SchedulerLink:
        return self._link

    def health(self) -> tuple[bool, str]:
        """(ok, why): the scheduler is serving, or stuck, restarting, dead, or the server is exiting."""
        return self.supervisor.health()

    @property
    def fatal(self) -> str | None:
        """Why the server must exit (the scheduler's restart budget is spent), else None."""
        return self.supervisor.fatal

    # ------------------------------------------------------------------------------ supervised (SupervisedClient)

    async def probe(self, timeout_s: float) -> Any:
        return await self.get_internal_state(timeout_s=timeout_s)

    def fail_in_flight(self, error: SchedulerUnavailable) -> None:
        logger.error("%s; failing %d request(s) in flight", error, len(self.client.requests))
        for _, state in self.client.requests.items():
            if state.held is not None and not state.held.done():
                state.held.set_exception(error)
                continue
            if not state.done:
                state.done = True
                self._observe_finished(state, aborted=True)
            state.queue.put_nowait(error)
        self.client.replies.fail_all(error)

    async def detach(self) -> None:
        if self._handle_task is not None:
            self._handle_task.cancel()
            await asyncio.gather(self._handle_task, return_exceptions=True)
            self._handle_task = None
        self._link.close()

    def attach(self, link: SchedulerLink, process: Any, info: SchedulerInfo) -> None:
        self._link, self.process, self.info = link, process, info
        self.client.transport = link
        self._handle_task = asyncio.create_task(self._handle_loop(link))

    @property
    def num_in_flight(self) -> int:
        return len(self.client.requests)

    def in_flight_rids(self, owner: Any = ...) -> list[str]:
        """Every request id in flight, or only `owner`'s."""
        return [rid for rid, s in self.client.requests.items() if owner is ... or s.owner == owner]

    # ------------------------------------------------------------------------------ requests

    def check_capacity(self, num_tickets: int, extra_key: Any = None) -> None:
        """Backpressure: refuse a request whose tickets would overfill the queue (SchedulerBusy, 503).

        NOTE: a full queue still takes a key's request while that key holds less than its share
        (`--max-queued-requests` / keys with queued tickets), so the total stays under twice the flag and
        one tenant's backlog never locks another out."""
        capacity = self.config.max_queued_requests
        waiting = self.admission.num_waiting + self.admission.num_queued
        if waiting + num_tickets > capacity:
            owner = namespace_owner(extra_key)
            mine, share = self.admission.num_pending(owner), self.admission.queue_share(owner, capacity)
            if mine + num_tickets > share:
                raise SchedulerBusy(f"{waiting} requests are queued ({mine} of them this key's) and this one adds "
                                    f"{num_tickets}; the queue holds {capacity} (--max-queued-requests), and "
                                    f"once it is full each key may hold {share}")
        if self._link.outbox_size:
            raise SchedulerBusy(f"the scheduler is behind: {self._link.outbox_size} control message(s) wait")

    async def generate(self, req: GenerateReq) -> AsyncIterator[GenerateOutput]:
        """Yields the outputs of one request. Close it (aclosing) to abort the request early."""
        await self.supervisor.wait_ready()
        rid = uuid.uuid4().hex
        owner = namespace_owner(req.extra_key)
        # NOTE: the scheduler matches stop strings; the detokenizer only holds back their possible prefixes.
        detok = IncrementalDetokenizer(self._detok_tokenizer, req.sampling_params.stop,
                                       req.sampling_params.skip_special_tokens)
        state = _ReqState(rid, len(req.input_ids), detok, client_rid=req.client_rid, owner=owner)
        self.client.track(rid, state)
        try:
            state.ticket = await self._admit(state, rid if req.group is None else req.group)
            if state.ticket is None:  # aborted while it waited: it never reaches the scheduler
                state.done = True
                self._observe_finished(state, aborted=True)
                aborted = {"type": "abort", "message": "aborted by the client", "status_code": 499}
                yield GenerateOutput(rid, "", [], aborted, state.prompt_len, 0, 0)
                return
            self.supervisor.ensure_alive()
            state.link = self._link
            self.client.send_generate(generate_message(
                rid, req.input_ids, req.sampling_params, req.extra_key,
                LogprobSpec(req.return_logprob, req.top_logprobs_num, req.logprob_start_len), req.lora_name,
                req.embed, req.session_id, req.session_field))
            state.sent = True
            while True:
                item = await state.queue.get()
                if isinstance(item, Exception):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            self.client.requests.pop(rid)
            if state.held is not None and not state.held.done():
                state.held.cancel()
            if state.sent and not state.done:
                self._abort_state(state, count=True)
            if state.ticket is not None:
                self.admission.release(state.ticket)

    async def _admit(self, state: _ReqState, group: Any) -> Ticket | None:
        """The request's ticket, or None when it was aborted first; raises if the scheduler failed first."""
        acquire = asyncio.ensure_future(self.admission.acquire(state.owner, group))
        state.held = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait({acquire, state.held}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not acquire.done():
                acquire.cancel()  # NOTE: withdraws it; a grant racing the cancel is given back by acquire
            await asyncio.gather(acquire, return_exceptions=True)
        held, state.held = state.held, None
        granted = acquire.done() and not acquire.cancelled() and acquire.exception() is None
        if held.done():
            if granted:
                self.admission.release(acquire.result())
            held.result()  # a scheduler failure raises here
            return None
        held.cancel()
        return acquire.result()

    def abort_request(self, client_rid: str | None, owner: str | None, abort_all: bool = False,
                      admin: bool = False) -> int:
        """Ask the scheduler to abort `owner`'s requests named `client_rid` (all of them with `abort_all`);
        `admin` reaches every owner's. They end as usual, with finish reason abort (status 499), and
        their partial output; returns how many."""
        hits = [s for _, s in self.client.requests.items()
                if not s.done and (admin or s.owner == owner) and (abort_all or s.client_rid == client_rid)]
        for state in hits:
            if state.held is not None and not state.held.done():
                state.held.set_result(None)  # still waiting for admission: it ends without being sent
            else:
                self._send_abort(state)
        return len(hits)

    def _abort_state(self, state: _ReqState, count: bool) -> None:
        state.done = True
        self._send_abort(state)
        if count:
            self._observe_finished(state, aborted=True)

    def _send_abort(self, state: _ReqState) -> None:
        # NOTE: only to the scheduler that got the request; a restarted one never heard of it.
        if state.sent and state.link is self._link and self.supervisor.dead is None:
            try:
                self.client.abort(state.rid)
            except SchedulerUnavailable:
                pass

    # ------------------------------------------------------------------------------ control

    async def flush_cache(self) -> FlushCacheOut:
        return await self.request_reply(FlushCacheReq(), FlushCacheOut)

    async def session_control(self, msg: OpenSessionReq | CloseSessionReq | CheckSessionReq) -> SessionOut:
        """Open, close or look up an agent session (the scheduler's SessionPins answers)."""
        return await self.request_reply(msg, SessionOut)

    async def get_internal_state(self, timeout_s: float | None = None) -> dict[str, Any]:
        out: GetInternalStateOut = await self.request_reply(GetInternalStateReq(), GetInternalStateOut, timeout_s)
        return out.state

    async def request_reply(self, msg: Any, reply_type: type, timeout_s: float | None = None) -> Any:
        """Send a control message that the scheduler answers with one `reply_type` message (in order)."""
        self.supervisor.ensure_alive()
        future = asyncio.get_running_loop().create_future()
        self.client.ask(msg, reply_type, future)
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout_s or self.config.control_timeout_s)
        except asyncio.TimeoutError:
            # NOTE: the message was delivered (or waits in the outbox) and will be answered; the waiter
            # stays in line to take that answer, so later answers still meet their own waiters.
            raise SchedulerUnavailable(f"scheduler did not answer {type(msg).__name__} in time") from None

    # ------------------------------------------------------------------------------ loops

    async def _handle_loop(self, link: SchedulerLink) -> None:
        loop = asyncio.get_running_loop()
        while True:
            out = await link.outputs.recv_pyobj()
            self.supervisor.heard_from()
            if isinstance(out, BatchTokenIDOut):
                deltas = await loop.run_in_executor(self._detokenize_pool, self._detokenize, out)
                self._dispatch(out, deltas)
            else:
                if isinstance(out, GetInternalStateOut):
                    self.scheduler_state = out.state
                self.client.receive(out)

    def _detokenize(self, out: BatchTokenIDOut) -> dict[str, str]:
        """On the detokenizer thread: each request's text delta, by rid (none for requests no longer here)."""
        deltas: dict[str, str] = {}
        for record in out.outputs:
            state = self.client.requests.get(record.rid)
            if state is None or state.done:
                continue
            ids, finished = list(record.new_token_ids), record.finished_reason
            deltas[record.rid] = state.detok.feed(ids) if finished is None else state.detok.finish(ids, finished)
        return deltas

    def _dispatch(self, out: BatchTokenIDOut, deltas: dict[str, str]) -> None:
        """On the event loop: each record to its request's generator, routed by the client (the Engine's routing)."""
        now = time.perf_counter()
        for state, record in self.client.route(out):
            delta = deltas.get(record.rid)
            if state.done or delta is None:
                continue  # aborted here already; late outputs are dropped
            new_ids = list(record.new_token_ids)
            self.admission.started(state.ticket)
            self._observe_step(state, len(new_ids), now)
            state.observe(record, now)
            finished = record.finished_reason
            state.queue.put_nowait(GenerateOutput(
                rid=record.rid, text_delta=delta, token_ids=new_ids, finish=finished, prompt_tokens=state.prompt_len, completion_tokens=record.completion_tokens,
                cached_tokens=record.cached_tokens, logprobs=record.output_logprobs,
                top_logprobs=record.output_top_logprobs, input_logprobs=record.input_token_logprobs,
                input_top_logprobs=record.input_top_logprobs, figures=record.figures, embedding=record.embedding,
                cached_tokens_details=record.cached_tokens_details))
            if finished is not None:
                state.done = True
                self._observe_finished(state, aborted=finished.get("type") == "abort")

    def _observe_step(self, state: _ReqState, num_new: int, now: float) -> None:
        if num_new == 0:
            return
        if state.last_token_at is None:
            self.metrics.observe_first_token(now - state.submitted_at)
            self.metrics.observe_tokens(num_new, None)
        else:
            self.metrics.observe_tokens(num_new, now - state.last_token_at)

    def _observe_finished(self, state: _ReqState, aborted: bool) -> None:
        self.metrics.observe_finished(state.prompt_len, state.cached_tokens, state.elapsed(),
                                      aborted)

def _private_copy(tokenizer: Any) -> Any:
    if tokenizer is None:
        return None
    try:
        return copy.deepcopy(tokenizer)
    except Exception:  # noqa: BLE001 - a tokenizer that cannot be copied is shared instead
        return tokenizer
