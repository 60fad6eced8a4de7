"""The next decode step of the running batch, retracting requests when the KV pool is short.

`DecodePlanner` is a part of `Scheduler` with one job: make the running batch fit one more token
per request (with speculative decoding, also its drafts: speculative/). When it does not, requests are
retracted (their KV released, outputs kept; they go back to the front of the waiting queue) and, if even
one request alone cannot fit, aborted.
"""

from __future__ import annotations

import logging

from radixserve import envs
from radixserve.constrained.jump_forward import extends
from radixserve.managers.prefill_planner import PrefillPlanner
from radixserve.managers.req import FinishReason
from radixserve.managers.request_queue import RequestQueue
from radixserve.managers.schedule_batch import RETRACT_DECODE_STEPS, ScheduleBatch
from radixserve.managers.schedule_policy import NewTokenRatio
from radixserve.managers.scheduler_metrics import SchedulerStats
from radixserve.managers.scheduler_output_processor import OutputProcessor
from radixserve.speculative.drafter import Drafter, batch_drafts

logger = logging.getLogger(__name__)


class DecodePlanner:
    def __init__(self, queue: RequestQueue, prefill: PrefillPlanner, output: OutputProcessor,
                 new_token_ratio: NewTokenRatio, stats: SchedulerStats, pool_tokens: int,
                 drafter: Drafter | None = None) -> None:
        self.queue = queue
        self.prefill = prefill
        self.output = output
        self.new_token_ratio = new_token_ratio
        self.stats = stats
        self.pool_tokens = pool_tokens
        self.drafter = drafter  # speculative decoding (speculative/drafter.py); None when off
        # Test hook (SGLang's SGLANG_TEST_RETRACT): retract one request every N decode steps.
        self.test_retract_interval = envs.TEST_RETRACT_INTERVAL.get()
        self.decode_steps = 0

    def update_running_batch(self, batch: ScheduleBatch) -> ScheduleBatch | None:
        """Prepare a decode step of the running batch, retracting requests if the pool is short."""
        batch.filter_batch()
        self._extend_jumped(batch)
        if batch.is_empty():
            return None
        self.decode_steps += 1
        forced = self.test_retract_interval > 0 and self.decode_steps % self.test_retract_interval == 0
        if batch.check_decode_mem() and not (forced and batch.batch_size() > 1):
            self.new_token_ratio.on_decode_step()
        else:
            self._retract(batch)
            if not batch.check_decode_mem():
                self._abort_out_of_memory(batch)
                return None
        if self.drafter is not None:
            self.drafter.tick(batch.reqs)
        drafts = self._drafts(batch)
        if drafts is None:
            batch.prepare_for_decode()
        else:
            batch.prepare_for_verify(drafts)
        return batch

    def _drafts(self, batch: ScheduleBatch) -> list[list[int]] | None:
        """Each request's draft for a verify step, or None for a plain decode step (no drafter, no draft, or
        no room for the draft tokens: a plain step always fits, as checked before)."""
        # NOTE: a verify step feeds every row from the host's tokens: under overlap a request whose last sample is
        # still in flight (a re-prefill, or a batch the wait was not decided for) has none, so the step is plain
        if not self.may_draft(batch) or not batch.inputs_on_host():
            return None
        drafts = batch_drafts(self.drafter, batch.reqs)
        if not any(drafts):
            return None
        if not batch.kv_manager.can_allocate(batch.reqs, [1 + len(d) for d in drafts]):
            return None
        return drafts

    def on_idle(self) -> None:
        """Nothing runs: the drafter lets go of what it keeps per request (a draft model's KV)."""
        if self.drafter is not None:
            self.drafter.release_all()

    def may_draft(self, batch: ScheduleBatch) -> bool:
        """Whether the next decode step of `batch` could verify drafts (a row left beside its requests)."""
        return self.drafter is not None and len(batch.reqs) < self.drafter.config.max_verify_rows

    def may_verify(self, batch: ScheduleBatch) -> bool:
        """`may_draft`, and some request's drafting is not paused: only then must the step wait for the result in
        flight (drafts come from the latest tokens); a batch whose drafting is paused keeps overlapping."""
        return self.may_draft(batch) and not self.drafter.paused(batch.reqs)

    def _extend_jumped(self, batch: ScheduleBatch) -> None:
        """Requests that took jump-forward tokens (constrained/jump_forward.py) either leave for one extend
        (their computed KV to the tree, themselves to the front of the queue) or stay and are fed the forced
        tokens one per decode step, as `jump_forward.extends` decides for the batch's size."""
        jumped = [r for r in batch.reqs if r.forced_pending]
        if not jumped:
            return
        leaving = []
        for req in jumped:
            if extends(req.forced_pending, batch.batch_size()):
                self.prefill.kv_manager.release(req, insert=True)
                req.leave_for_extend()
                leaving.append(req)
            else:
                req.feed_forced()  # NOTE: clears its forced_pending; it stays in the batch
        if leaving:
            batch.reqs = [r for r in batch.reqs if not r.forced_pending]
            self.prefill.room_freed()
            self.queue.push_front(leaving)

    def _retract(self, batch: ScheduleBatch) -> None:
        old_ratio = self.new_token_ratio.value
        retracted = batch.retract_decode()
        if not retracted:
            return
        self.new_token_ratio.on_retract(batch.reqs, RETRACT_DECODE_STEPS)
        self.stats.num_retractions += len(retracted)
        self.prefill.room_freed()
        # NOTE: they keep their outputs and resume first; their prompts are still in the tree, unlocked.
        self.queue.push_front(retracted)
        logger.info("KV cache pool is full. Retract requests. #retracted_reqs: %d, #new_token_ratio: %.4f -> %.4f",
                    len(retracted), old_ratio, self.new_token_ratio.value)

    def _abort_out_of_memory(self, batch: ScheduleBatch) -> None:
        for req in list(batch.reqs):
            needed = req.kv.kv_allocated_len + 1
            message = (f"out of memory even after retracting every other request: this request needs "
                       f"{needed} KV slots, the pool has {self.pool_tokens}")
            logger.error("Abort %s: %s", req.rid, message)
            self.output.finish_now(req, FinishReason.abort(message, status_code=500))
        batch.filter_batch()

