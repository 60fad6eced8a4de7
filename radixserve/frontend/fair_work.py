"""Fair, bounded CPU work for the HTTP front end: parsing, validation, templating, tokenizing, rendering.

Work whose cost grows with a request's size never runs on the event loop (where it would stall `/health`,
`/metrics` and every other client's stream); it runs on a `FairWork`'s threads. A `FairWork` has a fixed
number of threads, so at most that many jobs run at once, and the jobs waiting for a thread take turns by
key (an API key's namespace id, or on an open server the connection): the key whose job started
longest ago goes next (a newly arrived key first), in order within a key. One key's stack of expensive requests therefore delays another
key's job by at most one job per thread, whatever the stack's depth.

The queue is bounded: once `max_pending` jobs wait, a key holding less than its share (`max_pending` /
keys waiting, this one counted) still gets in, anyone else gets `FrontendBusy` (HTTP 503 with Retry-After).
"""

from __future__ import annotations

import asyncio
import importlib
import multiprocessing
import os
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from radixserve.frontend.fair_admission import queue_share

T = TypeVar("T")


PARENT_POLL_S = 1.0  # how often a worker process looks whether the HTTP process still exists


def _exit_with_parent(parent_pid: int) -> None:
    """A worker process's initializer: exit once the HTTP process is gone. NOTE: a pool worker blocks on its call
    queue, whose pipe it holds both ends of, so it never sees the parent go; a server stopped without shutting the
    pool down (killed after its grace period) left its workers behind for good."""
    import threading
    import time

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        os._exit(0)

    threading.Thread(target=watch, name="radixserve-parent-watch", daemon=True).start()


def _import(modules: tuple[str, ...]) -> None:
    for name in modules:
        importlib.import_module(name)


class FrontendBusy(Exception):
    """Too many jobs wait for the front end's threads; the same request may succeed a moment later."""


@dataclass
class _Job:
    fn: Callable[[], Any]
    done: asyncio.Future


class FairWork:
    """`threads` workers: threads, or with `processes` worker processes (spawned; jobs and results are pickled).
    A process holds no GIL of ours: its work never delays the event loop, however long one C call takes
    (json.loads of 2 MB of numbers holds the GIL for 0.1 s)."""

    def __init__(self, threads: int, max_pending: int, name: str, processes: bool = False) -> None:
        self.threads = max(int(threads), 1)
        self.max_pending = max(int(max_pending), 1)
        self.name = name
        self.processes = processes
        self._pool = self._new_pool()
        self._waiting: dict[Any, deque[_Job]] = {}  # key -> its jobs, in arrival order
        self._turn: dict[Any, int] = {}  # key with jobs waiting or running -> when one last started; 0: never
        self._jobs: dict[Any, int] = {}  # key -> its jobs waiting or running
        self._turns = 0
        self._running = 0
        self.completed = 0  # jobs run to the end (tests, metrics)

    @property
    def num_running(self) -> int:
        return self._running

    @property
    def num_waiting(self) -> int:
        return sum(len(jobs) for jobs in self._waiting.values())

    def stats(self) -> dict[str, int]:
        """Jobs running, waiting and run to the end (the admin's /get_server_info)."""
        return {"running": self._running, "waiting": self.num_waiting, "completed": self.completed}

    async def run(self, key: Any, fn: Callable[..., T], *args: Any, admit: bool = True) -> T:
        """Runs `fn(*args)` on one of the threads when `key`'s turn comes; returns its result or raises its error.

        `admit`: the queue's bound applies (FrontendBusy); False for the later work of a request already taken
        in (rendering its answer), which is never refused half-way. Cancelling the caller drops a job that has
        not started; a started one runs to its end unobserved."""
        if admit:
            self._check_room(key)
        job = _Job(partial(fn, *args), asyncio.get_running_loop().create_future())
        if key not in self._jobs:
            self._turn[key], self._jobs[key] = 0, 0  # NOTE: a newcomer goes before the keys being served
        self._jobs[key] += 1
        self._waiting.setdefault(key, deque()).append(job)
        self._dispatch()
        return await job.done

    def _check_room(self, key: Any) -> None:
        waiting = self.num_waiting
        if waiting < self.max_pending:
            return
        share = queue_share(key, self._waiting, self.max_pending)
        mine = len(self._waiting.get(key, ()))
        if mine >= share:
            raise FrontendBusy(f"{waiting} requests wait for the front end's {self.threads} {self.name} thread(s) "
                               f"({mine} of them this key's); at most {self.max_pending} may wait, and once that "
                               f"many do each key may hold {share}")

    def _dispatch(self) -> None:
        # NOTE: runs on the event loop (here and in _finished), so _running and _waiting need no lock.
        while self._running < self.threads and self._waiting:
            key = min(self._waiting, key=self._turn.__getitem__)  # the key served longest ago (round-robin)
            jobs = self._waiting[key]
            job = jobs.popleft()
            if not jobs:
                del self._waiting[key]
            if job.done.cancelled():
                self._forget(key)
                continue
            self._turns += 1
            self._turn[key] = self._turns
            self._running += 1
            try:
                future = job.done.get_loop().run_in_executor(self._pool, job.fn)
            except BrokenProcessPool:  # a worker process died (killed, out of memory): start fresh ones
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = self._new_pool()
                future = job.done.get_loop().run_in_executor(self._pool, job.fn)
            future.add_done_callback(partial(self._finished, key, job))

    def _new_pool(self) -> Executor:
        if not self.processes:
            return ThreadPoolExecutor(self.threads, thread_name_prefix=f"radixserve-{self.name}")
        # NOTE: spawned, not forked: the HTTP process has threads (ZMQ, executors) a fork would copy mid-state.
        return ProcessPoolExecutor(self.threads, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_exit_with_parent, initargs=(os.getpid(),))

    async def warm(self, *modules: str) -> None:
        """Starts every worker now and imports `modules` in it (a spawned process takes a second or two), so the
        first request does not wait for that."""
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(loop.run_in_executor(self._pool, _import, modules) for _ in range(self.threads)))

    def _forget(self, key: Any) -> None:
        self._jobs[key] -= 1
        if not self._jobs[key]:
            del self._jobs[key], self._turn[key]

    def _finished(self, key: Any, job: _Job, future: asyncio.Future) -> None:
        self._forget(key)
        self._running -= 1
        self.completed += 1
        error = None if future.cancelled() else future.exception()  # NOTE: read even when nobody waits
        if not job.done.done():
            if future.cancelled():
                job.done.cancel()
            elif error is not None:
                job.done.set_exception(error)
            else:
                job.done.set_result(future.result())
        self._dispatch()

    def shutdown(self) -> None:
        for jobs in self._waiting.values():
            for job in jobs:
                job.done.cancel()
        self._waiting.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)
