"""A failure stays with its requests: one scheduler step that raises aborts the requests it involved.

`FailureContainment` is a part of `Scheduler` with that one job. Both event loops run each step
through `run_step_contained(step)`. When a
step raises an `Exception` (building a batch, running its forward and sampling, or processing its
result), `contain_failure`:

1. waits for the forward stream (under the overlap loop) so no forward still writes the KV it frees;
2. aborts the requests involved with status 500 and the error (their KV released, not cached):
   * the batch chosen in this step, when the failure came after it was chosen (running it, or
     processing a result); under the overlap loop with batches in flight, also those batches and
     every running request: a failed forward poisons the stream and the future-token map they all
     share, so the overlap state is rebuilt and nothing it held can continue;
   * otherwise (receiving or building failed) the requests being scheduled: every live request that
     is neither waiting nor in any batch, plus the running batch and a chunked request, whose KV
     bookkeeping the interrupted build may have half advanced;
   waiting requests hold no KV and stay queued;
3. checks the KV conservation identity, and goes on with the next step.

Only a failure of the scheduler's own state ends the loop (the exception propagates, the process
exits and the HTTP server restarts it): the identity no longer holds after the aborts, the
containment itself fails, or `MAX_CONSECUTIVE_FAILURES` steps fail in a row (a fault no request
causes, such as a lost device). `BaseException`s (KeyboardInterrupt, SystemExit) are never contained.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from radixserve.managers.req import FinishReason

if TYPE_CHECKING:
    from radixserve.managers.prefill_planner import PrefillPlanner
    from radixserve.managers.req import Req
    from radixserve.managers.request_queue import RequestQueue
    from radixserve.managers.schedule_batch import ScheduleBatch
    from radixserve.managers.scheduler_output_processor import OutputProcessor
    from radixserve.managers.step_pipelines import Pipelines

logger = logging.getLogger(__name__)

MAX_CONSECUTIVE_FAILURES = 8
FAILURE_STATUS = 500


class StepState(Protocol):
    """What containment reads and resets of the scheduler's step: its batches and its KV check."""

    cur_batch: ScheduleBatch | None  # chosen by the step that failed (None: it failed before choosing)
    last_batch: ScheduleBatch | None
    running_batch: ScheduleBatch

    def check_conservation(self) -> dict[str, Any]:
        """Raises ConservationError when the pool no longer adds up."""


class FailureContainment:
    def __init__(self, step: StepState, pipelines: Pipelines, queue: RequestQueue, prefill: PrefillPlanner,
                 output: OutputProcessor) -> None:
        self.step = step
        self.pipelines = pipelines
        self.queue = queue
        self.prefill = prefill
        self.output = output
        self.failed_steps = 0  # steps whose failure was contained, since start
        self._consecutive_failures = 0

    def run_step_contained(self, step: Callable[[], Any]) -> Any:
        """Runs one step; a failure aborts the requests it involved and the loop goes on (see module doc)."""
        # NOTE: set by the step once it has chosen its batch; None after a failure means "before".
        self.step.cur_batch = None
        try:
            result = step()
        except Exception as error:  # noqa: BLE001 - contained here, or re-raised as the scheduler's own failure
            self._consecutive_failures += 1
            if self._consecutive_failures >= MAX_CONSECUTIVE_FAILURES:
                logger.critical("%d scheduler steps failed in a row; the scheduler stops", self._consecutive_failures)
                raise
            self.contain_failure(error)
            return None
        self._consecutive_failures = 0
        return result

    def contain_failure(self, error: Exception) -> list[Req]:
        """Aborts the requests the failed step involved, checks conservation; returns them."""
        logger.error("a scheduler step failed; aborting the requests it involved", exc_info=error)
        in_flight, dropped_overlap = self.pipelines.drop_in_flight()
        if dropped_overlap:
            in_flight.extend(self.step.running_batch.reqs)
        involved = self._involved_requests(in_flight)
        message = f"internal error while running this request's batch: {type(error).__name__}: {error}"
        for req in involved:
            self.output.finish_now(req, FinishReason.abort(message[:500], status_code=FAILURE_STATUS))
        self._forget_batches(involved)
        self.failed_steps += 1
        # NOTE: the scheduler's own state must still add up; if not, the failure is not contained.
        self.step.check_conservation()
        logger.error("aborted %d request(s) after the failure; the scheduler goes on", len(involved))
        return involved

    # ---- internals ------------------------------------------------------------------------------
    def _involved_requests(self, in_flight: list[Req]) -> list[Req]:
        chosen, chunked = self.step.cur_batch, self.prefill.chunked_req
        if chosen is not None:
            candidates = [*chosen.reqs, *in_flight]
            if chunked is not None and any(r is chunked for r in chosen.reqs):
                candidates.append(chunked)
        else:
            candidates = [*self._unplaced_requests(), *self.step.running_batch.reqs, *in_flight]
            if chunked is not None:
                candidates.append(chunked)
        seen: dict[int, Req] = {}
        for req in candidates:
            if not req.finished():
                seen.setdefault(id(req), req)
        return list(seen.values())

    def _unplaced_requests(self) -> list[Req]:
        """Live requests in no queue and no batch: taken out of the waiting queue by an interrupted build."""
        placed = {id(r) for r in self.queue.waiting}
        for batch in (self.step.running_batch, self.step.last_batch):
            if batch is not None:
                placed.update(id(r) for r in batch.reqs)
        if self.prefill.chunked_req is not None:
            placed.add(id(self.prefill.chunked_req))
        return [r for r in self.queue.live.values() if id(r) not in placed and not r.finished()]

    def _forget_batches(self, involved: list[Req]) -> None:
        self.prefill.forget(involved)
        self.step.running_batch.filter_batch()
        self.step.cur_batch = None
        self.step.last_batch = None
