"""The HTTP process's two ZMQ sockets to the scheduler process (`SchedulerLink`), bound before it starts.

Two kinds of sends. A generate request meets backpressure: when the scheduler cannot take it now
(its socket queue is full, or control messages are still waiting to go), `send_request` raises
`SchedulerBusy` (HTTP 503 with Retry-After). A control message (abort, flush, state probe) is never
lost: `send_control` queues it in an outbox that is retried, in order, until the scheduler takes it.
One socket carries both, so an abort can never overtake the request it aborts.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections import deque
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from radixserve.protocol.scheduler_info import PortArgs

_CONNECT_TIMEOUT_S = 30.0


class SchedulerUnavailable(Exception):
    """The scheduler process is dead (or did not answer in time); HTTP 503."""


class SchedulerBusy(Exception):
    """The scheduler cannot take another request now; HTTP 503 with Retry-After."""


class SchedulerLink:
    """The HTTP process's two sockets to the scheduler process, bound at construction.

    NOTE: construct it before starting the scheduler process. The child connects before it loads the
    model; a connect to an ipc path nobody has bound yet fails and is retried only by ZMQ's reconnect
    timer (100-200 ms), so binding after the child started left the request socket without a peer for
    that long after the server went live, and every send then failed with EAGAIN (HTTP 503).
    """

    def __init__(self, port_args: PortArgs | None = None) -> None:
        self.port_args = port_args or PortArgs.new()
        self._sync_ctx = zmq.Context()
        self.requests = self._sync_ctx.socket(zmq.PUSH)
        self.requests.setsockopt(zmq.LINGER, 0)
        self._monitor = self.requests.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.requests.bind(self.port_args.request_endpoint)
        self._async_ctx = zmq.asyncio.Context()
        self.outputs = self._async_ctx.socket(zmq.PULL)
        self.outputs.setsockopt(zmq.LINGER, 0)
        self.outputs.bind(self.port_args.output_endpoint)
        self._outbox: deque[Any] = deque()
        self._closed = False

    def connected(self) -> bool:
        """Whether a request send would be accepted now: the scheduler is connected (and not HWM-full)."""
        return bool(self.requests.poll(0, zmq.POLLOUT))

    async def wait_connected(self, timeout_s: float = _CONNECT_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.connected():
            if time.monotonic() > deadline:
                raise SchedulerUnavailable(f"the scheduler did not connect within {timeout_s:.0f} s")
            await asyncio.sleep(0.01)

    @property
    def outbox_size(self) -> int:
        return len(self._outbox)

    def send_request(self, msg: Any) -> None:
        """Sends a generate request now, or raises SchedulerBusy (never blocks, never queues it)."""
        if self._closed:
            raise SchedulerUnavailable("the link to the scheduler is closed")
        if self._outbox:
            raise SchedulerBusy(f"the scheduler is behind: {len(self._outbox)} control message(s) wait to be sent")
        try:
            self.requests.send_pyobj(msg, flags=zmq.NOBLOCK)
        except zmq.Again:
            raise SchedulerBusy("the scheduler's request queue is full") from None
        except zmq.ZMQError as e:
            raise SchedulerUnavailable(f"cannot reach the scheduler: {e}") from None

    def send_control(self, msg: Any) -> None:
        """Queues a control message; it goes out now if it can, else on a later `flush_outbox`."""
        if self._closed:
            raise SchedulerUnavailable("the link to the scheduler is closed")
        self._outbox.append(msg)
        self.flush_outbox()

    def flush_outbox(self) -> int:
        """Sends queued control messages, oldest first, while the socket takes them; returns how many remain."""
        while self._outbox and not self._closed:
            try:
                self.requests.send_pyobj(self._outbox[0], flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            self._outbox.popleft()
        return len(self._outbox)

    def disconnects(self) -> int:
        """How many times the scheduler's request connection dropped since the last call."""
        count = 0
        while self._monitor.poll(0):
            count += recv_monitor_message(self._monitor)["event"] == zmq.EVENT_DISCONNECTED
        return count

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.requests.disable_monitor()
        self._sync_ctx.destroy(linger=0)
        self._async_ctx.destroy(linger=0)
        if self.port_args.folder is not None:
            shutil.rmtree(self.port_args.folder, ignore_errors=True)
