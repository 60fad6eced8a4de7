"""Streams and events for the overlap event loop: CUDA streams, or CPU worker-thread streams.

Two implementations sit behind one small interface (`Stream`, `Event`):

* CUDA: `torch.cuda.Stream` / `torch.cuda.Event`. `launch(fn)` runs `fn` on the calling thread with the
  stream made current, so its kernels are queued on that stream and the host returns at once.
* CPU: `WorkerStream` is a thread that runs launched callables one after another, in launch order: a
  stream. Events are marks recorded into that order; another stream or the host can wait on them.
  torch releases the GIL inside its kernels, so Python on the scheduler thread runs while a forward
  computes. The CPU schedule stream is `InlineStream`: the scheduler thread itself. Its tensor writes
  happen at once, so waiting on an event "on the schedule stream" blocks the scheduler thread.

Errors: a callable that raises on a worker poisons that stream. Later callables are skipped; every
event recorded after it, or created on it and not yet recorded, carries the error; the host sees it
as `StreamError` at its next `synchronize()`, `Event.synchronize()` or `result()`, so nothing waits
forever on a point a skipped callable would have marked. A stream that waits on a failed event
fails too.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch


class StreamError(RuntimeError):
    """Work on a device stream failed; `__cause__` is the original exception."""


class Event(ABC):
    """A point in one stream's order. Waiting on an event that was never recorded returns at once."""

    stream: Stream | None = None  # the stream that created it

    def record(self) -> None:
        """Record this event on the stream that created it: inside a callable launched there, at that point."""
        if self.stream is None:
            raise RuntimeError("this event belongs to no stream")
        self.stream.record(self)

    @abstractmethod
    def synchronize(self) -> None:
        """Block the host until the stream has passed this point; raise `StreamError` if it failed."""

    @abstractmethod
    def query(self) -> bool:
        """True when the stream has passed this point."""


class Stream(ABC):
    """Work runs in launch order; `wait_event` makes later work wait for a point in another stream."""

    name: str
    # NOTE: True where `launch` runs the callable on the caller's thread before returning (inline, CUDA): a
    # launched callable must then never wait for something the caller does after launching it
    runs_on_caller: bool = True

    @abstractmethod
    def launch(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
        """Enqueue `fn(*args, **kwargs)`. The future's value may hold device tensors that are only
        complete once an event recorded after this launch has completed."""

    @abstractmethod
    def create_event(self) -> Event:
        """A fresh event for this stream, to be `record`ed later (for example inside a launched
        callable, to mark a point in the middle of a forward). Wait on it only after that launch, and
        record it in a `finally`: on the CPU a waiter blocks until it is recorded."""

    @abstractmethod
    def record(self, event: Event) -> None:
        """Record `event` at the current end of this stream; inside a launched callable, at that point."""

    def record_event(self) -> Event:
        event = self.create_event()
        self.record(event)
        return event

    @abstractmethod
    def wait_event(self, event: Event) -> None:
        """Work enqueued on this stream from now on starts only after `event` has completed."""

    def wait_stream(self, other: Stream) -> None:
        self.wait_event(other.record_event())

    @abstractmethod
    def synchronize(self) -> None:
        """Block the host until all enqueued work is done; raise `StreamError` if any of it failed."""

    def context(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def close(self) -> None:
        return None


# ---------------------------------------------------------------- CPU


class _Mark:
    """One recorded position of a CPU stream; set (with the stream's error, if any) when passed."""

    __slots__ = ("done", "error", "__weakref__")

    def __init__(self, done: bool = False) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None
        if done:
            self.done.set()

    def set(self, error: BaseException | None = None) -> None:
        self.error = error
        self.done.set()


def _stream_error(name: str, error: BaseException) -> StreamError:
    failure = StreamError(f"stream {name!r} failed: {error!r}")
    failure.__cause__ = error
    return failure


class CpuEvent(Event):
    def __init__(self, mark: _Mark | None = None, stream: Stream | None = None) -> None:
        self.mark = mark if mark is not None else _Mark(done=True)
        self.stream = stream

    def synchronize(self) -> None:
        self.mark.done.wait()
        if self.mark.error is not None:
            raise _stream_error("event", self.mark.error)

    def query(self) -> bool:
        return self.mark.done.is_set()


_STOP = object()


@dataclass(frozen=True)
class StreamStats:
    busy_s: float  # time spent running launched callables (injected delays included)
    idle_s: float  # time the worker sat with an empty queue
    tasks: int


class WorkerStream(Stream):
    """A CPU stream: one daemon thread running enqueued callables in order, under inference mode."""

    runs_on_caller = False

    def __init__(self, name: str, delay_s: float = 0.0) -> None:
        self.name = name
        self.delay_s = delay_s  # NOTE: debug only; slept before each launched callable
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        # NOTE: events created here and not yet recorded; a failure sets them all, so no waiter hangs
        # on an event whose recording callable was skipped.
        self._unrecorded: weakref.WeakSet[_Mark] = weakref.WeakSet()
        self._closed = False
        self._busy_s = 0.0
        self._idle_s = 0.0
        self._tasks = 0
        self._thread = threading.Thread(target=self._run, name=f"radixserve-{name}-stream", daemon=True)
        self._thread.start()

    @property
    def failed(self) -> BaseException | None:
        return self._error

    def stats(self) -> StreamStats:
        return StreamStats(self._busy_s, self._idle_s, self._tasks)

    def _on_worker(self) -> bool:
        return threading.current_thread() is self._thread

    def _put(self, kind: str, payload: Any) -> None:
        if self._closed:
            raise RuntimeError(f"stream {self.name!r} is closed")
        self._queue.put((kind, payload))

    def launch(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
        future: Future = Future()
        self._put("call", (fn, args, kwargs, future))
        return future

    def create_event(self) -> Event:
        mark = _Mark()
        with self._lock:
            if self._error is not None:
                mark.set(self._error)
            else:
                self._unrecorded.add(mark)
        return CpuEvent(mark, self)

    def record(self, event: Event) -> None:
        mark = _cpu_mark(event)
        if self._on_worker():
            self._pass(mark)
        else:
            self._put("mark", mark)

    def _pass(self, mark: _Mark) -> None:
        with self._lock:
            self._unrecorded.discard(mark)
        mark.set(self._error)

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            if self._error is None:
                self._error = error
            pending = list(self._unrecorded)
            self._unrecorded.clear()
        for mark in pending:
            mark.set(self._error)

    def wait_event(self, event: Event) -> None:
        mark = _cpu_mark(event)
        if mark.done.is_set() and mark.error is None:
            return  # already passed: nothing to wait for
        if self._on_worker():
            self._wait_mark(mark)
        else:
            self._put("wait", mark)

    def synchronize(self) -> None:
        if self._closed and not self._thread.is_alive():
            if self._error is not None:
                raise _stream_error(self.name, self._error)
            return
        self.record_event().synchronize()

    def close(self, timeout: float = 10.0) -> None:
        """Run what is queued, then stop the thread. Idempotent."""
        if not self._closed:
            self._queue.put((_STOP, None))
            self._closed = True
        if not self._on_worker():
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            waited = time.perf_counter()
            kind, payload = self._queue.get()
            self._idle_s += time.perf_counter() - waited
            if kind is _STOP:
                return
            if kind == "call":
                self._run_call(*payload)
            elif kind == "wait":
                self._wait_mark(payload)
            else:
                self._pass(payload)

    def _wait_mark(self, mark: _Mark) -> None:
        mark.done.wait()
        if mark.error is not None:
            self._fail(mark.error)

    def _run_call(self, fn: Callable[..., Any], args: tuple, kwargs: dict, future: Future) -> None:
        if self._error is not None:
            future.set_exception(_stream_error(self.name, self._error))
            return
        start = time.perf_counter()
        try:
            if self.delay_s > 0:
                time.sleep(self.delay_s)
            with torch.inference_mode():
                future.set_result(fn(*args, **kwargs))
        except BaseException as error:  # carried to the host, like a device fault
            self._fail(error)
            future.set_exception(error)
        finally:
            self._busy_s += time.perf_counter() - start
            self._tasks += 1


class InlineStream(Stream):
    """The scheduler thread seen as a stream: work runs at once; waiting on an event blocks the host."""

    def __init__(self, name: str = "schedule") -> None:
        self.name = name

    def launch(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
        future: Future = Future()
        future.set_result(fn(*args, **kwargs))
        return future

    def create_event(self) -> Event:
        return CpuEvent(_Mark(), self)

    def record(self, event: Event) -> None:
        _cpu_mark(event).set()

    def wait_event(self, event: Event) -> None:
        event.synchronize()

    def synchronize(self) -> None:
        return None


def _cpu_mark(event: Event) -> _Mark:
    if not isinstance(event, CpuEvent):
        raise TypeError(f"a CPU stream cannot wait on {type(event).__name__}")
    return event.mark


# ---------------------------------------------------------------- CUDA


class CudaEvent(Event):
    def __init__(self, stream: CudaStream | None = None) -> None:
        self.raw = torch.cuda.Event()
        self.stream = stream

    def synchronize(self) -> None:
        self.raw.synchronize()

    def query(self) -> bool:
        return bool(self.raw.query())


class CudaStream(Stream):
    """A `torch.cuda.Stream`. `launch` runs `fn` now, with this stream current; its kernels queue here."""

    def __init__(self, name: str, device: torch.device | str = "cuda") -> None:
        self.name = name
        self.raw = torch.cuda.Stream(device=device)

    def launch(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
        future: Future = Future()
        with torch.cuda.stream(self.raw):
            future.set_result(fn(*args, **kwargs))
        return future

    def create_event(self) -> Event:
        return CudaEvent(self)

    def record(self, event: Event) -> None:
        if not isinstance(event, CudaEvent):
            raise TypeError(f"a CUDA stream cannot record {type(event).__name__}")
        event.raw.record(self.raw)

    def wait_event(self, event: Event) -> None:
        if not isinstance(event, CudaEvent):
            raise TypeError(f"a CUDA stream cannot wait on {type(event).__name__}")
        self.raw.wait_event(event.raw)

    def synchronize(self) -> None:
        self.raw.synchronize()

    def context(self) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(self.raw)

    def close(self) -> None:
        # NOTE: what the stream has queued (the scheduler's writes of the allocator's and the request rows'
        # tensors) is done before anyone reads them from another stream: a read on the default stream would
        # otherwise see memory that a queued kernel has yet to write.
        self.raw.synchronize()
