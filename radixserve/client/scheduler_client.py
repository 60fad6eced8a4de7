"""`SchedulerClient`: what a front end does with the scheduler, written once, over a transport.

Both front ends hold one: the offline `Engine` over `InProcessTransport` (the scheduler's queue in this process,
outputs called back on the scheduler thread) and the HTTP server's `TokenizerManager` over its `SchedulerLink`
(two ZMQ sockets to the scheduler process). The client owns the requests in flight (`requests`, each front end's
`RequestState`), the waiters of control replies (`replies`) and the transport; a front end adds only its
concurrency (threads or asyncio) and what it does with a request's tokens (a result, a stream of text).

A transport has two sends. `send_request` carries a generate request and may refuse it when the scheduler cannot
take it now (the ZMQ link raises `SchedulerBusy`); `send_control` carries aborts and control messages and never
loses one. Both go down one channel in order, so an abort never overtakes its request. A disaggregated or routed
deployment adds a transport, not a client.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any, Generic, Protocol, TypeVar

from radixserve.client.replies import ControlReplies
from radixserve.client.tracker import RequestTracker
from radixserve.protocol.io_struct import AbortReq, BatchTokenIDOut, TokenIDOut

logger = logging.getLogger(__name__)
S = TypeVar("S")


class Transport(Protocol):
    def send_request(self, msg: Any) -> None:
        """Send a generate request now, or raise (the scheduler cannot take it now)."""

    def send_control(self, msg: Any) -> None:
        """Send an abort or a control message; never lost (queued until the scheduler takes it)."""


class InProcessTransport:
    """The Engine's transport: the scheduler's input queue in this process (unbounded: never refuses)."""

    def __init__(self, put: Callable[[Any], None]) -> None:
        self._put = put

    def send_request(self, msg: Any) -> None:
        self._put(msg)

    def send_control(self, msg: Any) -> None:
        self._put(msg)


class SchedulerClient(Generic[S]):
    """Requests in flight by rid (`S`: the front end's state), control replies in order, one transport."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self.requests: RequestTracker[S] = RequestTracker()
        self.replies = ControlReplies()

    # ---- out -------------------------------------------------------------------------------------
    def track(self, rid: str, state: S) -> None:
        """A request the front end will send: its outputs are routed to `state` (a rid in use raises)."""
        self.requests.add(rid, state)

    def send_generate(self, msg: Any) -> None:
        self.transport.send_request(msg)

    def abort(self, rid: str) -> None:
        """The scheduler ends the request at any stage (its KV released within a step); it answers with a final
        record whose finish reason is abort."""
        self.transport.send_control(AbortReq(rid))

    def ask(self, msg: Any, reply_type: type, future: Any) -> None:
        """Send a control message that the scheduler answers with one `reply_type` message, in order; `future` (a
        concurrent or an asyncio one) takes that answer."""
        self.replies.expect(reply_type, future)
        try:
            self.transport.send_control(msg)
        except BaseException:
            self.replies.withdraw(reply_type, future)  # NOTE: never sent: a waiter left would take a later answer
            raise

    # ---- in -------------------------------------------------------------------------------------
    def receive(self, out: Any) -> BatchTokenIDOut | None:
        """One message from the scheduler: a control reply goes to its waiter (None back); a batch of token
        records comes back for the front end to deliver."""
        if isinstance(out, BatchTokenIDOut):
            return out
        if not self.replies.resolve(out):
            logger.warning("unexpected message from the scheduler: %r", type(out).__name__)
        return None

    def route(self, out: BatchTokenIDOut) -> Iterator[tuple[S, TokenIDOut]]:
        """Each record with its request's state; a request leaves once its final record is routed."""
        return self.requests.route(out)

    def fail_all(self, error: BaseException) -> list[S]:
        """The scheduler is gone: every control waiter fails with `error`; returns the requests in flight (no longer
        tracked) for the front end to fail."""
        states = self.requests.take_all()
        self.replies.fail_all(error)
        return states
