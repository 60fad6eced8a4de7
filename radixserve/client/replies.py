"""Control messages (flush, state, cache snapshot) answered in order, one waiter per message.

`ControlReplies` works with any future that has `done()`, `set_result()` and `set_exception()`: the
Engine's `concurrent.futures.Future`s (resolved on the scheduler thread) and the HTTP side's
`asyncio.Future`s (resolved on its event loop).
"""

from __future__ import annotations

from collections import deque
from typing import Any


class ControlReplies:
    def __init__(self) -> None:
        self._waiters: dict[type, deque[Any]] = {}

    def expect(self, reply_type: type, future: Any) -> None:
        """`future` takes the next `reply_type` answer not taken by an earlier waiter."""
        self._waiters.setdefault(reply_type, deque()).append(future)

    def withdraw(self, reply_type: type, future: Any) -> None:
        """Its message never left: a waiter left in line would take a later message's answer."""
        waiters = self._waiters.get(reply_type)
        if waiters is not None and future in waiters:
            waiters.remove(future)

    def resolve(self, reply: Any) -> bool:
        """Hand `reply` to the oldest waiter of its type; False if nobody waits for that type."""
        waiters = self._waiters.get(type(reply))
        if waiters is None:
            return False
        # NOTE: the scheduler answers control messages in the order it received them.
        while waiters:
            future = waiters.popleft()
            if not future.done():
                future.set_result(reply)
                return True
        return True

    def fail_all(self, error: BaseException) -> None:
        for waiters in self._waiters.values():
            while waiters:
                future = waiters.popleft()
                if not future.done():
                    future.set_exception(error)
