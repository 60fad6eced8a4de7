"""Fair admission: which generate tickets the HTTP process releases to the scheduler, and when.

A *ticket* is one (prompt, choice) of an HTTP request: a request with 100 prompts and n=4 holds 400.
A released ticket is *queued* until its first output arrives (the scheduler holds it in its waiting
queue or is prefilling it), then *running* until it ends. The rules, applied whenever a ticket
arrives, starts or ends:

* a request's first ticket is released at once;
* after that, a request has at most `slice_size` tickets queued at a time (its prompts reach the
  scheduler in bounded slices, so a later request never finds thousands of prompts ahead of it), and
  at most its share of the running batch outstanding (queued + running): `(max_running - 1) //
  active keys // active requests of that key`, at least 1;
* and all requests together keep one row of the running batch free (at most `max_running - 1`
  outstanding beyond first tickets), for the next newcomer's first ticket;
* releases go round-robin over API keys, then over the requests of a key; within a request, in order.
  A request over its share (shares shrink as others arrive) gets nothing until it is back under it.

A single-prompt request is released the moment it arrives. Consequence (the
bound, measured in tests/test_server_tenants.py): a request arriving while one large request runs finds at most `slice_size` of its tickets queued in the scheduler and a free row in
the running batch, so (when the KV pool can hold it) it is prefilled within
ceil((slice_size * longest prompt + its prompt) / chunked_prefill_size) prefill steps, which the
scheduler runs before any decode step, and its first token arrives with that prefill's result.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any


def queue_share(key: Any, holders: Any, capacity: int) -> int:
    """A key's share of a full queue of `capacity`: an equal part among the keys that hold something in it
    (`holders`, this key counted), so one key's backlog cannot lock the others out. The one rule of both
    fair queues: tickets to the scheduler (FairAdmission) and the front end's CPU work (FairWork)."""
    return capacity // (len(holders) + (key not in holders))

@dataclass
class _Group:
    """One HTTP request's tickets."""

    key: Any
    waiting: deque[asyncio.Future] = field(default_factory=deque)
    queued: int = 0
    outstanding: int = 0  # queued + running

    def idle(self) -> bool:
        return not self.waiting and self.outstanding == 0


@dataclass
class Ticket:
    group_id: Any
    started: bool = False
    ended: bool = False


class FairAdmission:
    def __init__(self, max_running: int, slice_size: int) -> None:
        self.max_running = max(int(max_running), 1)
        self.slice_size = max(int(slice_size), 1)
        self._groups: dict[Any, _Group] = {}
        self._outstanding = 0
        self._keys: OrderedDict[Any, OrderedDict[Any, None]] = OrderedDict()  # key -> its groups, in turn order

    # ---------------------------------------------------------------------------------- counts
    @property
    def num_waiting(self) -> int:
        """Tickets held back here, not yet released."""
        return sum(len(g.waiting) for g in self._groups.values())

    @property
    def num_queued(self) -> int:
        """Released tickets without a first output yet."""
        return sum(g.queued for g in self._groups.values())

    def num_pending(self, key: Any) -> int:
        """One key's tickets waiting here or queued in the scheduler."""
        return sum(len(self._groups[g].waiting) + self._groups[g].queued for g in self._keys.get(key, ()))

    def queue_share(self, key: Any, capacity: int) -> int:
        """A key's share of `capacity` queued tickets (see `queue_share`)."""
        return queue_share(key, self._keys, capacity)

    @property
    def num_outstanding(self) -> int:
        return self._outstanding

    def share(self, group_id: Any) -> int:
        """How many of the group's tickets may be outstanding now."""
        key = self._groups[group_id].key
        return max(1, (self.max_running - 1) // len(self._keys) // len(self._keys[key]))

    # ---------------------------------------------------------------------------------- tickets
    async def acquire(self, key: Any, group_id: Any) -> Ticket:
        """Waits until the ticket may go to the scheduler. Cancelling the wait withdraws it."""
        group = self._group(key, group_id)
        future = asyncio.get_running_loop().create_future()
        group.waiting.append(future)
        self._pump()
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release(Ticket(group_id))  # granted just before the cancel: give the slot back
            else:
                future.cancel()
                self._forget_if_idle(group_id)
                self._pump()
            raise
        return Ticket(group_id)

    def started(self, ticket: Ticket) -> None:
        """Its first output arrived: it is running, no longer queued."""
        if ticket.started or ticket.ended:
            return
        ticket.started = True
        self._groups[ticket.group_id].queued -= 1
        self._pump()

    def release(self, ticket: Ticket) -> None:
        """It ended (finished, aborted, failed); idempotent."""
        if ticket.ended:
            return
        ticket.ended = True
        group = self._groups[ticket.group_id]
        group.outstanding -= 1
        self._outstanding -= 1
        if not ticket.started:
            group.queued -= 1
        self._forget_if_idle(ticket.group_id)
        self._pump()

    # ---------------------------------------------------------------------------------- internals
    def _group(self, key: Any, group_id: Any) -> _Group:
        group = self._groups.get(group_id)
        if group is None:
            group = self._groups[group_id] = _Group(key)
            self._keys.setdefault(key, OrderedDict())[group_id] = None
        return group

    def _forget_if_idle(self, group_id: Any) -> None:
        group = self._groups.get(group_id)
        if group is None:
            return
        while group.waiting and group.waiting[0].done():
            group.waiting.popleft()  # withdrawn (cancelled) tickets
        if group.idle():
            del self._groups[group_id]
            groups = self._keys[group.key]
            del groups[group_id]
            if not groups:
                del self._keys[group.key]

    def _may_release(self, group_id: Any) -> bool:
        group = self._groups[group_id]
        if group.outstanding == 0:
            return True  # NOTE: every request's first ticket goes at once, into the row kept free for it
        return (group.queued < self.slice_size and group.outstanding < self.share(group_id)
                and self._outstanding < self.max_running - 1)

    def _pump(self) -> None:
        """Release tickets round-robin (one per key per round, a key's requests in turn) while any may go."""
        released = True
        while released:
            released = False
            for key in list(self._keys):
                for group_id in list(self._keys.get(key, ())):
                    if self._release_one(group_id):
                        self._keys[key].move_to_end(group_id)
                        self._keys.move_to_end(key)
                        released = True
                        break

    def _release_one(self, group_id: Any) -> bool:
        group = self._groups[group_id]
        while group.waiting and group.waiting[0].done():
            group.waiting.popleft()
        if not group.waiting or not self._may_release(group_id):
            return False
        group.waiting.popleft().set_result(None)
        group.queued += 1
        group.outstanding += 1
        self._outstanding += 1
        return True
