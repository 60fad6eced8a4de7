"""One run of an async job shared by every caller that arrives while it runs (and, with a `ttl_s`, for that
long after): keyless endpoints such as /health_generate and /get_load do a bounded amount of work however
many callers flood them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Coalesced(Generic[T]):
    def __init__(self, job: Callable[[], Awaitable[T]], ttl_s: float = 0.0) -> None:
        self._job = job
        self._ttl_s = ttl_s
        self._task: asyncio.Future[T] | None = None
        self._finished_at = 0.0
        self.runs = 0  # how many times the job really ran (tests, metrics)

    async def get(self) -> T:
        task = self._task
        stale = task is not None and task.done() and (
            task.cancelled() or task.exception() is not None
            or time.monotonic() - self._finished_at > self._ttl_s)
        if task is None or stale:
            task = self._task = asyncio.ensure_future(self._run())
        # NOTE: shielded: one caller giving up (a client disconnect) does not cancel the others' answer.
        return await asyncio.shield(task)

    async def _run(self) -> T:
        self.runs += 1
        try:
            return await self._job()
        finally:
            self._finished_at = time.monotonic()
