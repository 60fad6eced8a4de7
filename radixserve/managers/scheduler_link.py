"""The HTTP process's two ZMQ sockets to the scheduler process (`SchedulerLink`), bound before it starts."""

from __future__ import annotations

import asyncio
import shutil
import time

import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from radixserve.managers.scheduler_process import PortArgs

_CONNECT_TIMEOUT_S = 30.0


class SchedulerUnavailable(Exception):
    """The scheduler process is dead (or did not answer in time); HTTP 503."""


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
