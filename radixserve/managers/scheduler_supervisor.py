"""The tokenizer manager's watch over the scheduler process: liveness, restart, and the truth in /health.

A mixin of `TokenizerManager` (as the scheduler's mixins): it reads and writes the manager's state.
A watchdog probes the scheduler with `GetInternalStateReq` whenever it has been quiet for a heartbeat.
If the process dies, every request in flight fails with `SchedulerUnavailable` (HTTP 503), waiters
included, and a fresh scheduler process (fresh pools) is started on a fresh link; requests arriving
meanwhile wait for it. Restarts are counted by a `RestartBudget`; once it is spent, `on_fatal` tells
the server to exit (non-zero). `health()` reports each state: ok, stuck, restarting, dead, fatal.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from radixserve.managers.scheduler_link import SchedulerLink, SchedulerUnavailable

if TYPE_CHECKING:
    from radixserve.managers.scheduler_process import SchedulerInfo
    from radixserve.managers.tokenizer_manager import TokenizerManager

logger = logging.getLogger(__name__)

# (link, process, info) of a freshly started scheduler; blocking, called on a worker thread.
Launcher = Callable[[], "tuple[SchedulerLink, Any, SchedulerInfo]"]


class SchedulerSupervisorMixin:
    def health(self: TokenizerManager) -> tuple[bool, str]:
        if self.fatal is not None:
            return False, self.fatal
        if self._restart_task is not None and not self._restart_task.done():
            return False, f"scheduler restarting ({self._dead})"
        if self._dead is not None:
            return False, self._dead
        silent = time.monotonic() - self._last_alive
        if silent > self.config.health_timeout_s:
            return False, f"scheduler has not answered for {silent:.1f} s (stuck?)"
        return True, "ok"

    def _ensure_alive(self: TokenizerManager) -> None:
        if self.fatal is not None:
            raise SchedulerUnavailable(self.fatal)
        if self._dead is not None:
            raise SchedulerUnavailable(self._dead)

    async def _wait_ready(self: TokenizerManager) -> None:
        """While the scheduler restarts, a new request waits for it (at most restart_wait_s)."""
        if self._ready is not None and not self._ready.is_set() and self.fatal is None:
            try:
                await asyncio.wait_for(self._ready.wait(), self.config.restart_wait_s)
            except asyncio.TimeoutError:
                pass
        self._ensure_alive()

    async def _outbox_loop(self: TokenizerManager) -> None:
        """Retries queued control messages until the scheduler takes them."""
        while True:
            waiting = self._link.flush_outbox()
            await asyncio.sleep(0.005 if waiting else 0.05)

    async def _watchdog_loop(self: TokenizerManager) -> None:
        while True:
            await asyncio.sleep(min(0.2, self.config.heartbeat_interval_s))
            if self._dead is not None or self.fatal is not None:
                continue
            if self.process is not None and not self.process.is_alive():
                self._on_scheduler_death(f"scheduler process exited with code {self.process.exitcode}")
                continue
            if self._link.disconnects():
                logger.warning("the scheduler dropped its request connection; sends fail until it reconnects")
            quiet_for = time.monotonic() - self._last_alive
            if not self._probe_pending and quiet_for >= self.config.heartbeat_interval_s:
                asyncio.create_task(self._probe())

    async def _probe(self: TokenizerManager) -> None:
        self._probe_pending = True
        try:
            await self.get_internal_state(timeout_s=max(self.config.health_timeout_s * 4, 60.0))
        except SchedulerUnavailable:
            pass
        finally:
            self._probe_pending = False

    # ------------------------------------------------------------------------------ failure and restart

    def _on_scheduler_death(self: TokenizerManager, reason: str) -> None:
        self._mark_dead(reason)
        if self._launcher is None:
            return  # nothing to restart with (an embedded manager): 503 from now on
        if not self._budget.take():
            self._fail_fatally(f"{reason}; the restart budget ({self._budget.describe()}) is spent")
            return
        self._restart_task = asyncio.create_task(self._restart())

    def _mark_dead(self: TokenizerManager, reason: str) -> None:
        logger.error("%s; failing %d request(s) in flight", reason, len(self._states))
        self._dead = reason
        if self._ready is not None:
            self._ready.clear()
        error = SchedulerUnavailable(reason)
        for state in list(self._states.values()):
            if state.held is not None and not state.held.done():
                state.held.set_exception(error)
                continue
            if not state.done:
                state.done = True
                self._observe_finished(state, aborted=True)
            state.queue.put_nowait(error)
        for waiters in (self._flush_waiters, self._state_waiters, *self._reply_waiters.values()):
            while waiters:
                future = waiters.popleft()
                if not future.done():
                    future.set_exception(error)

    async def _restart(self: TokenizerManager) -> None:
        """Start a fresh scheduler (fresh pools) on a fresh link; retried within the budget."""
        while True:
            if self._handle_task is not None:
                self._handle_task.cancel()
                await asyncio.gather(self._handle_task, return_exceptions=True)
            self._link.close()
            logger.warning("restarting the scheduler process (%s)", self._budget.describe())
            try:
                link, process, info = await asyncio.to_thread(self._launcher)
                await link.wait_connected()
            except Exception as e:  # noqa: BLE001 - a failed start counts against the budget
                logger.exception("scheduler restart failed")
                if not self._budget.take():
                    self._fail_fatally(f"scheduler restart failed: {e}; the restart budget "
                                       f"({self._budget.describe()}) is spent")
                    return
                continue
            self._link, self.process, self.info = link, process, info
            self._last_alive = time.monotonic()
            self._handle_task = asyncio.create_task(self._handle_loop(link))
            logger.warning("the scheduler is back (pid %d) after: %s", info.pid, self._dead)
            self._dead = None
            self._ready.set()
            return

    def _fail_fatally(self: TokenizerManager, reason: str) -> None:
        logger.critical("%s; the server exits", reason)
        self.fatal = reason
        if self._ready is not None:
            self._ready.set()  # wake the waiters: they fail with the reason
        if self.on_fatal is not None:
            self.on_fatal(reason)
