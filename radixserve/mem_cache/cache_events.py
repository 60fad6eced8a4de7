"""A bounded log of what the radix tree did: inserts, splits, match hits, locks, evictions, resets.

`RadixCache.events` is None by default and then records nothing (one attribute test per operation).
Set it to a `CacheEventLog` and the tree appends one tuple per operation to a ring of fixed size;
readers ask for the events after a sequence number they saw (`since`), so a poller that falls
behind learns how many it missed instead of stalling the tree.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, NamedTuple

EVENT_KINDS = ("insert", "split", "match", "lock", "unlock", "evict", "reset")


class CacheEvent(NamedTuple):
    """One operation. `node` and `tokens` mean, by kind:

    insert: the new leaf (or the last matched node when nothing was new), tokens added; `detail` =
    tokens already cached. split: the new upper node, its length; `detail` = the lower node's id.
    match (hits only): the last matched node, tokens matched; `detail` = tokens asked.
    lock / unlock: the node, the change of the evictable size; `detail` = its lock_ref afterwards.
    evict: None, tokens freed; `detail` = (tokens asked, victims in eviction order as
    (node id, tokens, extra_key, parent id)). reset: None, 0, None.
    """

    seq: int
    time: float  # time.monotonic()
    kind: str
    node: int | None
    extra_key: Any
    tokens: int
    detail: Any = None


class CacheEventLog:
    """The last `capacity` events of one tree, numbered from 1."""

    def __init__(self, capacity: int = 4096) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._ring: deque[CacheEvent] = deque(maxlen=capacity)
        self.seq = 0  # events recorded so far; the newest has this number

    def record(self, kind: str, node: int | None, extra_key: Any, tokens: int, detail: Any = None) -> None:
        self.seq += 1
        self._ring.append(CacheEvent(self.seq, time.monotonic(), kind, node, extra_key, tokens, detail))

    def since(self, seq: int, limit: int | None = None) -> tuple[list[CacheEvent], int]:
        """Events numbered after `seq`, oldest first, at most the newest `limit`; and how many were lost."""
        newer = self.seq - max(seq, 0)
        if newer <= 0:
            return [], 0
        kept = min(newer, len(self._ring), limit if limit is not None else newer)
        events = list(self._ring)[len(self._ring) - kept:] if kept else []
        return events, newer - kept

    def __len__(self) -> int:
        return len(self._ring)
