"""The HTTP process's watch over the scheduler process: liveness, restart, and the truth in /health.

`SchedulerSupervisor` is a part of `TokenizerManager` with one job; it talks to the manager only through
the `SupervisedClient` Protocol below (its link and process, a probe, failing what is in flight, and
swapping in a fresh scheduler). A watchdog probes the scheduler whenever it has been quiet for a
heartbeat. If the process dies, every request in flight fails with `SchedulerUnavailable` (HTTP 503),
waiters included, and a fresh scheduler process (fresh pools) is started on a fresh link; requests
arriving meanwhile wait for it. Restarts are counted by a `RestartBudget`; once it is spent, `on_fatal`
tells the server to exit (non-zero). `health()` reports each state: ok, stuck, restarting, dead, fatal.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from radixserve.frontend.scheduler_link import SchedulerLink, SchedulerUnavailable

if TYPE_CHECKING:
    from radixserve.protocol.scheduler_info import SchedulerInfo

logger = logging.getLogger(__name__)

# (link, process, info) of a freshly started scheduler; blocking, called on a worker thread.
Launcher = Callable[[], "tuple[SchedulerLink, Any, SchedulerInfo]"]


class RestartBudget:
    """At most `max_restarts` scheduler restarts within any `window_s` seconds."""

    def __init__(self, max_restarts: int, window_s: float) -> None:
        self.max_restarts = max_restarts
        self.window_s = window_s
        self._times: deque[float] = deque()

    def take(self) -> bool:
        """Spend one restart if the budget allows it now."""
        now = time.monotonic()
        while self._times and now - self._times[0] > self.window_s:
            self._times.popleft()
        if len(self._times) >= self.max_restarts:
            return False
        self._times.append(now)
        return True

    def describe(self) -> str:
        return f"{len(self._times)} of {self.max_restarts} restarts used in {self.window_s:g} s"


class SupervisedClient(Protocol):
    """What the supervisor needs of the scheduler's client (TokenizerManager)."""

    @property
    def link(self) -> SchedulerLink: ...

    @property
    def process(self) -> Any: ...

    async def probe(self, timeout_s: float) -> Any:
        """A round trip to the scheduler (GetInternalStateReq); raises SchedulerUnavailable."""

    def fail_in_flight(self, error: SchedulerUnavailable) -> None:
        """Fail every request and control waiter in flight with `error`."""

    async def detach(self) -> None:
        """Stop reading the dead scheduler's outputs and close its link."""

    def attach(self, link: SchedulerLink, process: Any, info: SchedulerInfo) -> None:
        """Talk to a freshly started scheduler from now on."""


class SchedulerSupervisor:
    def __init__(self, client: SupervisedClient, config: Any, launcher: Launcher | None = None) -> None:
        self.config = config  # FrontendConfig: heartbeat, health and restart settings
        self.on_fatal: Callable[[str], None] | None = None  # the server exits when this is called
        self.fatal: str | None = None
        self.dead: str | None = None  # why the scheduler is down, while it is
        self._client = client
        self._launcher = launcher
        self._budget = RestartBudget(config.max_scheduler_restarts, config.restart_window_s)
        self._ready: asyncio.Event | None = None
        self._restart_task: asyncio.Task | None = None
        self._last_alive = time.monotonic()
        self._probe_pending = False
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        """Starts watching (on the running loop) a scheduler that is connected now."""
        self._last_alive = time.monotonic()
        self._ready = asyncio.Event()
        self._ready.set()
        self._tasks = [asyncio.create_task(self._watchdog_loop()), asyncio.create_task(self._outbox_loop())]

    async def stop(self) -> None:
        tasks = [t for t in (*self._tasks, self._restart_task) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def heard_from(self) -> None:
        """The scheduler just sent something: it is alive."""
        self._last_alive = time.monotonic()

    # ------------------------------------------------------------------------------ state

    def health(self) -> tuple[bool, str]:
        if self.fatal is not None:
            return False, self.fatal
        if self._restart_task is not None and not self._restart_task.done():
            return False, f"scheduler restarting ({self.dead})"
        if self.dead is not None:
            return False, self.dead
        silent = time.monotonic() - self._last_alive
        if silent > self.config.health_timeout_s:
            return False, f"scheduler has not answered for {silent:.1f} s (stuck?)"
        return True, "ok"

    def ensure_alive(self) -> None:
        if self.fatal is not None:
            raise SchedulerUnavailable(self.fatal)
        if self.dead is not None:
            raise SchedulerUnavailable(self.dead)

    async def wait_ready(self) -> None:
        """While the scheduler restarts, a new request waits for it (at most restart_wait_s)."""
        if self._ready is not None and not self._ready.is_set() and self.fatal is None:
            try:
                await asyncio.wait_for(self._ready.wait(), self.config.restart_wait_s)
            except asyncio.TimeoutError:
                pass
        self.ensure_alive()

    # ------------------------------------------------------------------------------ loops

    async def _outbox_loop(self) -> None:
        """Retries queued control messages until the scheduler takes them."""
        while True:
            waiting = self._client.link.flush_outbox()
            await asyncio.sleep(0.005 if waiting else 0.05)

    async def _watchdog_loop(self) -> None:
        while True:
            await asyncio.sleep(min(0.2, self.config.heartbeat_interval_s))
            if self.dead is not None or self.fatal is not None:
                continue
            process = self._client.process
            if process is not None and not process.is_alive():
                self.on_scheduler_death(f"scheduler process exited with code {process.exitcode}")
                continue
            if self._client.link.disconnects():
                logger.warning("the scheduler dropped its request connection; sends fail until it reconnects")
            quiet_for = time.monotonic() - self._last_alive
            if not self._probe_pending and quiet_for >= self.config.heartbeat_interval_s:
                asyncio.create_task(self._probe())

    async def _probe(self) -> None:
        self._probe_pending = True
        try:
            await self._client.probe(max(self.config.health_timeout_s * 4, 60.0))
        except SchedulerUnavailable:
            pass
        finally:
            self._probe_pending = False

    # ------------------------------------------------------------------------------ failure and restart

    def on_scheduler_death(self, reason: str) -> None:
        self._mark_dead(reason)
        if self._launcher is None:
            return  # nothing to restart with (an embedded manager): 503 from now on
        if not self._budget.take():
            self._fail_fatally(f"{reason}; the restart budget ({self._budget.describe()}) is spent")
            return
        self._restart_task = asyncio.create_task(self._restart())

    def _mark_dead(self, reason: str) -> None:
        self.dead = reason
        if self._ready is not None:
            self._ready.clear()
        self._client.fail_in_flight(SchedulerUnavailable(reason))

    async def _restart(self) -> None:
        """Start a fresh scheduler (fresh pools) on a fresh link; retried within the budget."""
        while True:
            await self._client.detach()
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
            self._client.attach(link, process, info)
            self._last_alive = time.monotonic()
            logger.warning("the scheduler is back (pid %d) after: %s", info.pid, self.dead)
            self.dead = None
            self._ready.set()
            return

    def _fail_fatally(self, reason: str) -> None:
        logger.critical("%s; the server exits", reason)
        self.fatal = reason
        if self._ready is not None:
            self._ready.set()  # wake the waiters: they fail with the reason
        if self.on_fatal is not None:
            self.on_fatal(reason)
