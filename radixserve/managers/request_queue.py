"""The scheduler's requests: the waiting queue and every live request by id.

A part of `Scheduler` with one job: which requests exist and which of them wait for admission. It
holds no KV: a waiting request has no row and no lock (a retracted one released them).
"""

from __future__ import annotations

import time

from radixserve.managers.req import Req, ReqPhase


class RequestQueue:
    def __init__(self) -> None:
        self.waiting: list[Req] = []  # in arrival order; the policy reorders it in place each step
        self.live: dict[str, Req] = {}  # every request not yet finished, by rid

    def __len__(self) -> int:
        return len(self.waiting)

    def add(self, req: Req) -> None:
        self.live[req.rid] = req
        self.waiting.append(req)

    def get(self, rid: str) -> Req | None:
        return self.live.get(rid)

    def forget(self, req: Req) -> None:
        """It finished: no longer live."""
        self.live.pop(req.rid, None)

    def is_waiting(self, req: Req) -> bool:
        return any(r is req for r in self.waiting)

    def remove(self, reqs: list[Req]) -> None:
        """Take `reqs` out of the waiting queue (admitted, expired or aborted)."""
        gone = {id(r) for r in reqs}
        self.waiting = [r for r in self.waiting if id(r) not in gone]

    def push_front(self, reqs: list[Req]) -> None:
        """Retracted requests resume before anything that arrived later."""
        self.waiting[:0] = reqs

    def expired(self, timeout_s: float, now: float | None = None) -> list[Req]:
        """Waiting requests older than `timeout_s`, taken out of the queue."""
        now = time.monotonic() if now is None else now
        # NOTE: a retracted (or jumped-forward) request was admitted once and holds a client's partial output:
        # never expired.
        expired = [r for r in self.waiting if not r.retraction_count and not r.output_ids
                   and now - r.wait_since > timeout_s]
        self.remove(expired)
        return expired

    def phase_problems(self) -> list[str]:
        """Live requests whose stored phase disagrees with what they hold, or queued ones not WAITING (tests and
        strict checks; a scheduler bug when not empty)."""
        problems = [p for r in self.live.values() if (p := r.phase_problem()) is not None]
        problems += [f"{r.rid}: queued while {r.phase.value}" for r in self.waiting if r.phase is not ReqPhase.WAITING]
        return problems
