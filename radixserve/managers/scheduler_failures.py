"""A failure stays with its requests: one scheduler step that raises aborts the requests it involved.

A mixin of `Scheduler`. Both event loops run each step through `run_step_contained(step)`. When a
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
from typing import TYPE_CHECKING, Any

from radixserve.managers.schedule_batch import FinishReason

if TYPE_CHECKING:
    from radixserve.managers.schedule_batch import Req
    from radixserve.managers.scheduler import Scheduler

logger = logging.getLogger(__name__)

MAX_CONSECUTIVE_FAILURES = 8
FAILURE_STATUS = 500


class SchedulerFailuresMixin:
    failed_steps: int = 0  # steps whose failure was contained, since start
    _consecutive_failures: int = 0

    def run_step_contained(self: Scheduler, step: Callable[[], Any]) -> Any:
        """Runs one step; a failure aborts the requests it involved and the loop goes on (see module doc)."""
        # NOTE: set by the step once it has chosen its batch; None after a failure means "before".
        self.cur_batch = None
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

    def contain_failure(self: Scheduler, error: Exception) -> list[Req]:
        """Aborts the requests the failed step involved, checks conservation; returns them."""
        logger.error("a scheduler step failed; aborting the requests it involved", exc_info=error)
        in_flight = self._drain_in_flight()
        involved = self._involved_requests(in_flight)
        message = f"internal error while running this request's batch: {type(error).__name__}: {error}"
        for req in involved:
            self.finish_now(req, FinishReason.abort(message[:500], status_code=FAILURE_STATUS))
        self._forget_batches(involved)
        self.failed_steps += 1
        self._check_state_after_failure()
        logger.error("aborted %d request(s) after the failure; the scheduler goes on", len(involved))
        return involved

    # ---- internals ------------------------------------------------------------------------------
    def _drain_in_flight(self: Scheduler) -> list[Req]:
        """Waits for launched batches and drops them; returns their requests. Under the overlap loop the
        stream state is dropped too (rebuilt on the next step) and every running request is returned."""
        reqs: list[Req] = []
        for name in ("overlap", "_normal_pipeline"):  # NOTE: the latter where the normal loop has a pipeline
            state = getattr(self, name, None)
            if state is None or not (state.pending or _stream_failed(state)):
                continue  # NOTE: nothing launched and no failed work: its streams and future map are sound
            for launched in state.pending:
                reqs.extend(launched.batch.reqs)
                try:
                    launched.copy_done.synchronize()  # NOTE: no forward may still write KV we are about to free
                except Exception:  # noqa: BLE001 - the failure being contained, seen again
                    pass
            state.pending.clear()
            if name == "overlap":
                self.close_overlap(drain=False)
                reqs.extend(self.running_batch.reqs)
        return reqs

    def _involved_requests(self: Scheduler, in_flight: list[Req]) -> list[Req]:
        chosen = self.cur_batch
        if chosen is not None:
            candidates = [*chosen.reqs, *in_flight]
            if self.chunked_req is not None and any(r is self.chunked_req for r in chosen.reqs):
                candidates.append(self.chunked_req)
        else:
            candidates = [*self._unplaced_requests(), *self.running_batch.reqs, *in_flight]
            if self.chunked_req is not None:
                candidates.append(self.chunked_req)
        seen: dict[int, Req] = {}
        for req in candidates:
            if not req.finished():
                seen.setdefault(id(req), req)
        return list(seen.values())

    def _unplaced_requests(self: Scheduler) -> list[Req]:
        """Live requests in no queue and no batch: taken out of the waiting queue by an interrupted build."""
        placed = {id(r) for r in self.waiting_queue}
        for batch in (self.running_batch, self.last_batch):
            if batch is not None:
                placed.update(id(r) for r in batch.reqs)
        if self.chunked_req is not None:
            placed.add(id(self.chunked_req))
        return [r for r in self.reqs.values() if id(r) not in placed and not r.finished()]

    def _forget_batches(self: Scheduler, involved: list[Req]) -> None:
        gone = {id(r) for r in involved}
        if self.chunked_req is not None and id(self.chunked_req) in gone:
            self.chunked_req = None
        self.running_batch.filter_batch()
        self.cur_batch = None
        self.last_batch = None
        self.in_flight_prefill = []
        self.batch_is_full = False

    def _check_state_after_failure(self: Scheduler) -> None:
        """The scheduler's own state must still add up; if not, the failure is not contained."""
        from radixserve.mem_cache.conservation import check_conservation

        check_conservation(self.token_to_kv_pool_allocator, self.tree_cache, self.req_to_token_pool,
                           [r.kv for r in self.active_requests()])


def _stream_failed(pipeline: Any) -> bool:
    """A CPU worker stream whose work raised skips everything after it: the pipeline must be rebuilt,
    even when the failed batch was the last one in flight (already taken off `pending`)."""
    streams = pipeline.streams
    return any(getattr(s, "failed", None) is not None for s in (streams.forward, streams.copy))
