"""The compiled-grammar cache, bounded by bytes, and the worker threads that compile.

`ByteLRU` keeps futures of compiled grammars by their spec, least recently used first. A compiled grammar's
size (xgrammar's `memory_size_bytes`, its token masks) plus its key's text counts once it is done; past the
budget the least recently used done entries go. An entry still compiling is never evicted (its size is not known
yet; the requests waiting for it hold its future anyway). A failed compile is kept too (its size: the key), so
the same bad grammar fails again at once.

`CompileWorkers` runs compiles one at a time, in order. xgrammar cannot stop a compile once it started, so a
compile that runs past `overdue_s` (half the scheduler's --grammar-compile-timeout: its requests will likely end
with a 400) is left to finish on its thread while a new worker takes the queue, so one slow grammar never holds up
the ones behind it; its result is still cached. At most `max_overdue` compiles run on like that at once (CPU bound: a flood of
slow grammars waits in the queue instead, and ends at its timeout).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Any

MAX_ENTRIES = 4096  # entries of any size (failed compiles are tiny; each holds its key's text)


class ByteLRU:
    """Futures by key, evicted least recently used first once the done entries' bytes pass `budget_bytes`."""

    def __init__(self, budget_bytes: int, size_of: Callable[[Any], int]) -> None:
        self.budget_bytes = budget_bytes
        self._size_of = size_of  # the bytes of a done future's result (0 for a failure)
        self._entries: OrderedDict[Hashable, Future] = OrderedDict()
        self._sizes: dict[Hashable, int] = {}  # done entries only
        self._lock = threading.Lock()
        self.bytes = 0  # NOTE: always the sum of _sizes
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable) -> Future | None:
        """The key's future (now the most recently used), or None."""
        with self._lock:
            future = self._entries.get(key)
            if future is not None:
                self._entries.move_to_end(key)
            return future

    def put(self, key: Hashable, future: Future, key_bytes: int) -> None:
        """Caches `future` under `key`; its bytes count once it is done."""
        with self._lock:
            self._entries[key] = future
            self._entries.move_to_end(key)
        future.add_done_callback(lambda done: self._settle(key, done, key_bytes))

    def _settle(self, key: Hashable, future: Future, key_bytes: int) -> None:
        size = key_bytes
        if not future.cancelled() and future.exception() is None:
            size += self._size_of(future.result())
        with self._lock:
            if self._entries.get(key) is not future:
                return  # NOTE: dropped (flushed) while it compiled: nothing to count
            self._sizes[key] = size
            self.bytes += size
            self._evict()

    def _evict(self) -> None:
        while self.bytes > self.budget_bytes or len(self._entries) > MAX_ENTRIES:
            key = next((k for k in self._entries if k in self._sizes), None)
            if key is None:
                return
            self._drop(key)
            self.evictions += 1

    def _drop(self, key: Hashable) -> None:
        del self._entries[key]
        self.bytes -= self._sizes.pop(key)

    def clear(self) -> tuple[int, int]:
        """Drops every done entry (entries still compiling stay); (entries, bytes) dropped. A grammar a running
        request uses lives on in its matcher until the request ends."""
        with self._lock:
            done = [k for k in self._entries if k in self._sizes]
            freed = self.bytes
            for key in done:
                self._drop(key)
            return len(done), freed


class CompileWorkers:
    """Runs jobs in order on a worker thread; a job past `overdue_s` no longer holds up the queue (module
    docstring). `check_overdue` is called by the scheduler every step."""

    def __init__(self, max_overdue: int = 1, name: str = "grammar-compile") -> None:
        self.max_overdue = max_overdue
        self._name = name
        self._jobs: deque[tuple[Future, Callable[[], Any]]] = deque()
        self._cv = threading.Condition()
        self._started: dict[int, float] = {}  # worker -> when its current job started (absent: idle)
        self._overdue: set[int] = set()  # workers left to finish their job, then exit
        self._workers = 0
        self._next_id = 0
        self.num_overdue = 0  # jobs that ran past overdue_s, ever

    def submit(self, job: Callable[[], Any]) -> Future:
        future: Future = Future()
        with self._cv:
            self._jobs.append((future, job))
            if self._workers - len(self._overdue) == 0:
                self._spawn()
            self._cv.notify()
        return future

    def check_overdue(self, overdue_s: float, now: float | None = None) -> None:
        """Leaves the job running past `overdue_s` to finish alone and starts a worker for the queue (at most
        `max_overdue` such jobs at once)."""
        now = time.monotonic() if now is None else now
        with self._cv:
            for worker, started in self._started.items():
                if (now - started > overdue_s and worker not in self._overdue
                        and len(self._overdue) < self.max_overdue):
                    self._overdue.add(worker)
                    self.num_overdue += 1
                    if self._jobs:
                        self._spawn()

    def _spawn(self) -> None:
        # NOTE: called with the lock held; a daemon thread, so a compile still running never delays the exit
        self._workers += 1
        self._next_id += 1
        threading.Thread(target=self._run, args=(self._next_id,), name=f"{self._name}-{self._next_id}",
                         daemon=True).start()

    def _run(self, worker: int) -> None:
        while True:
            with self._cv:
                while not self._jobs:
                    if not self._cv.wait(timeout=60.0) and not self._jobs:
                        self._workers -= 1  # NOTE: idle for a minute: the next submit starts another
                        return
                future, job = self._jobs.popleft()
                self._started[worker] = time.monotonic()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(job())
                except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
                    future.set_exception(e)
            if self._finished(worker):
                return

    def _finished(self, worker: int) -> bool:
        """The worker's job is done: True if it was overdue (a replacement took the queue: it exits)."""
        with self._cv:
            del self._started[worker]
            if worker not in self._overdue:
                return False
            self._overdue.discard(worker)
            self._workers -= 1
            if self._jobs and self._workers - len(self._overdue) == 0:
                self._spawn()
            return True
