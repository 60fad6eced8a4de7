"""Agent sessions in the radix cache (SGLang's `open_session` / `close_session`).

`SessionPins` is a part of the scheduler and the one owner of every session's pin: when a request of an open
session finishes, the session locks the tree node of that request's whole context (prompt + output, as
`cache_finished_req` inserted it) through the KVManager, and releases the lock it held on its previous context.
A pinned context is tree-owned and protected: eviction never takes it while the session is open and pinned.

Bounds: a session pins at most `max_tokens` tokens of its context (the head: system prompt and tools first);
all sessions together pin at most `max_pinned_tokens` (over it, the least recently used sessions are unpinned
first: they stay open); at most `max_sessions` are open; a session idle for its timeout is unpinned and closed.
Sessions live in the scheduler process only: a scheduler restart loses them (docs/radix_cache.md).
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from radixserve.protocol.io_struct import CheckSessionReq, CloseSessionReq, OpenSessionReq, SessionOut

if TYPE_CHECKING:
    from radixserve.mem_cache.kv_manager import KVManager, TreePin

SessionKey = tuple[str | None, str]  # (owner: the API key id or None, session id)


@dataclass
class _Session:
    ttl_s: float
    last_used: float
    pin: TreePin | None = None
    turns: int = 0  # finished requests that pinned (or tried to pin) a context


class SessionPins:
    """Open sessions per owner and the tree pin each holds (at most one)."""

    def __init__(self, kv_manager: KVManager, max_sessions: int, max_tokens: int, max_pinned_tokens: int,
                 idle_timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.kv = kv_manager
        self.max_sessions = max_sessions
        self.max_pinned_tokens = max_pinned_tokens
        self.max_tokens = min(max_tokens, max_pinned_tokens)  # NOTE: one session alone always fits the total
        self.idle_timeout_s = idle_timeout_s
        self.clock = clock
        # NOTE: ordered by last use, least recent first: the order in which pins are dropped over the total bound
        self.sessions: OrderedDict[SessionKey, _Session] = OrderedDict()
        self.requests: dict[str, SessionKey] = {}  # rid -> session, for requests in flight that named one
        self.pinned_tokens = 0
        self._last_scan = 0.0
        self.unpinned_over_bound = 0  # pins dropped to keep the total bound
        self.expired = 0  # sessions closed by the idle timeout
        kv_manager.release_pins = self.unpin_namespaces

    @classmethod
    def of_args(cls, kv_manager: KVManager, args: Any, pool_tokens: int) -> SessionPins:
        """The bounds of the server arguments (defaults: half the pool in total, per session the same)."""
        total = args.session_max_pinned_tokens if args.session_max_pinned_tokens is not None else pool_tokens // 2
        per = args.session_max_tokens if args.session_max_tokens is not None else total
        return cls(kv_manager, args.max_sessions, per, total, args.session_idle_timeout_s)

    # ---- control messages -------------------------------------------------------------------------
    def handle(self, msg: OpenSessionReq | CloseSessionReq | CheckSessionReq) -> SessionOut:
        self.expire()
        if isinstance(msg, OpenSessionReq):
            return self.open(msg.owner, msg.session_id, msg.ttl_s)
        if isinstance(msg, CheckSessionReq):
            if (msg.owner, msg.session_id) in self.sessions:
                return SessionOut(True, 200, msg.session_id)
            return SessionOut(False, 404, msg.session_id, f"no open session {msg.session_id!r}")
        return self.close(msg.owner, msg.session_id)

    def open(self, owner: str | None, session_id: str | None = None, ttl_s: float | None = None) -> SessionOut:
        sid = session_id if session_id is not None else uuid.uuid4().hex
        if (owner, sid) in self.sessions:
            return SessionOut(False, 409, sid, f"session_id: session {sid!r} is already open")
        if len(self.sessions) >= self.max_sessions:
            return SessionOut(False, 429, None, f"{len(self.sessions)} sessions are open, the most allowed "
                                                "(--max-sessions); close one first")
        ttl = ttl_s if ttl_s is not None else self.idle_timeout_s
        self.sessions[(owner, sid)] = _Session(ttl, self.clock())
        return SessionOut(True, 200, sid)

    def close(self, owner: str | None, session_id: str) -> SessionOut:
        """Close a session of `owner`, releasing its pin at once; 404 for another owner's or an unknown id."""
        session = self.sessions.pop((owner, session_id), None)
        if session is None:
            return SessionOut(False, 404, session_id, f"session_id: no open session {session_id!r}")
        self._unpin(session)
        return SessionOut(True, 200, session_id)

    # ---- requests ---------------------------------------------------------------------------------
    def attach(self, rid: str, owner: str | None, session_id: str, field: str) -> str | None:
        """Bind a request to an open session of its owner: None, or the 404's message naming `field`."""
        self.expire()
        key = (owner, session_id)
        session = self.sessions.get(key)
        if session is None:
            return f"{field}: no open session {session_id!r} (unknown, closed or idle past its timeout)"
        self._touch(key, session)
        self.requests[rid] = key
        return None

    def context_of(self, req: Any) -> tuple[SessionKey, list[int], Any] | None:
        """Before a finished request's KV is released: its session and its computed context (prompt + output,
        as cache_finished_req inserts it), or None; forgets the request either way."""
        key = self.requests.pop(req.rid, None)
        if key is None:
            return None
        tokens = (list(req.origin_input_ids) + list(req.output_ids))[: req.kv.kv_committed_len]
        return key, tokens, req.extra_key

    def on_finished(self, key: SessionKey, tokens: Sequence[int], extra_key: Any) -> None:
        """A request of the session finished and its context (`tokens`) was inserted: move the pin onto it."""
        session = self.sessions.get(key)
        if session is None:  # NOTE: closed (or expired) while its request ran: nothing to pin
            return
        self._touch(key, session)
        session.turns += 1
        # NOTE: lock the new node before releasing the old one, so a shared head is never unlocked in between
        pin = self.kv.pin_prefix(tokens, extra_key, self.max_tokens)
        self._unpin(session)
        if pin is not None:
            session.pin = pin
            self.pinned_tokens += pin.tokens
        self._enforce_total(keep=key)

    def _enforce_total(self, keep: SessionKey) -> None:
        for key, session in list(self.sessions.items()):
            if self.pinned_tokens <= self.max_pinned_tokens:
                return
            if key != keep and session.pin is not None:
                self._unpin(session)
                self.unpinned_over_bound += 1

    # ---- time and flushes -------------------------------------------------------------------------
    def expire(self, now: float | None = None) -> int:
        """Close every session idle past its timeout (its pin released); returns how many."""
        now = self.clock() if now is None else now
        idle = [k for k, s in self.sessions.items() if now - s.last_used > s.ttl_s]
        for key in idle:
            self._unpin(self.sessions.pop(key))
        self.expired += len(idle)
        return len(idle)

    def maybe_expire(self) -> None:
        """`expire` at most once a second (the scheduler calls it every step)."""
        now = self.clock()
        if now - self._last_scan >= 1.0:
            self._last_scan = now
            self.expire(now)

    def unpin_all(self) -> int:
        """Release every pin (before /flush_cache empties the tree); the sessions stay open. Returns the tokens."""
        freed = self.pinned_tokens
        for session in self.sessions.values():
            self._unpin(session)
        return freed

    def unpin_namespaces(self, match: Callable[[Any], bool]) -> int:
        """Release the pins in the namespaces `match` selects (before they are dropped: an adapter unload); the
        sessions stay open. Returns the tokens unpinned."""
        unpinned = 0
        for session in self.sessions.values():
            if session.pin is not None and match(session.pin.node.key.extra_key):
                unpinned += session.pin.tokens
                self._unpin(session)
        return unpinned

    def pinned_nodes(self) -> list[Any]:
        """The tree nodes pinned, one entry per pin (check_conservation's `pinned`)."""
        return [s.pin.node for s in self.sessions.values() if s.pin is not None]

    def report(self) -> dict[str, int]:
        """The state report's figures."""
        return {"open_sessions": len(self.sessions), "session_pinned_tokens": self.pinned_tokens,
                "session_pins": sum(s.pin is not None for s in self.sessions.values()),
                "session_pins_dropped_over_bound": self.unpinned_over_bound, "sessions_expired": self.expired}

    def _touch(self, key: SessionKey, session: _Session) -> None:
        session.last_used = self.clock()
        self.sessions.move_to_end(key)

    def _unpin(self, session: _Session) -> None:
        if session.pin is not None:
            self.kv.unpin(session.pin)
            self.pinned_tokens -= session.pin.tokens
            session.pin = None
