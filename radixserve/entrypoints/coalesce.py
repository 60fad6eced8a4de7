"""Bounded work for keyless endpoints such as /health_generate and /get_load, however many callers flood them.

`Coalesced`: one run of an async job shared by every caller that arrives while it runs (and, with a `ttl_s`,
for that long after). `TokenBucket`: how many keyless calls are answered per second at all.
"""

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


class TokenBucket:
    """`rate` calls per second on average, `rate` at once at most (at least one); `rate` 0 means unlimited."""

    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = float(rate)
        self.capacity = max(self.rate, 1.0)
        self._clock = clock
        self._tokens = self.capacity
        self._at = clock()
        self.refused = 0  # calls refused so far (tests, metrics)

    def take(self) -> bool:
        """True when a call may go ahead now (and uses up one token); False when the rate is spent."""
        if self.rate <= 0:
            return True
        now = self._clock()
        self._tokens = min(self.capacity, self._tokens + (now - self._at) * self.rate)
        self._at = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        self.refused += 1
        return False

    def retry_after_s(self) -> int:
        """Whole seconds until the next token (Retry-After)."""
        return max(1, int(-(-(1.0 - self._tokens) // self.rate))) if self.rate > 0 else 1
