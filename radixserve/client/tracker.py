"""Requests in flight, by rid, and the routing of the scheduler's output records to them."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Generic, TypeVar

from radixserve.protocol.io_struct import BatchTokenIDOut, TokenIDOut

S = TypeVar("S")


class RequestTracker(Generic[S]):
    """A front end's state per request in flight (`S`: its own type). Thread-safe: the Engine adds from the
    caller's thread and routes on the scheduler's."""

    def __init__(self) -> None:
        self._states: dict[str, S] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._states)

    def add(self, rid: str, state: S) -> None:
        with self._lock:
            if rid in self._states:
                raise ValueError(f"request id {rid!r} is already in use")
            self._states[rid] = state

    def get(self, rid: str) -> S | None:
        return self._states.get(rid)

    def pop(self, rid: str) -> S | None:
        with self._lock:
            return self._states.pop(rid, None)

    def items(self) -> list[tuple[str, S]]:
        with self._lock:
            return list(self._states.items())

    def take_all(self) -> list[S]:
        with self._lock:
            states, self._states = list(self._states.values()), {}
        return states

    def route(self, out: BatchTokenIDOut) -> Iterator[tuple[S, TokenIDOut]]:
        """Each record with the state of its request; records of requests no longer here are dropped. A
        request is no longer tracked once its last record is routed."""
        for record in out.outputs:
            with self._lock:
                state = self._states.get(record.rid)
                if state is not None and record.finished_reason is not None:
                    del self._states[record.rid]
            if state is not None:
                yield state, record
