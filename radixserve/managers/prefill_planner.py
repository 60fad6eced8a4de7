"""Which waiting requests the next prefill admits: the one prefix match per step, budgets, chunking.

`PrefillPlanner` is a part of `Scheduler` with one job: build the next prefill batch. It owns the
continuing chunked request, the last prefill's requests (for in-batch prefix dedup) and the
`batch_is_full` hint (nothing fits until something frees room). The policy matches every waiting
request against the tree once a step (`SchedulePolicy.calc_priority`); FCFS matches while walking.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from radixserve.managers.req import Req
from radixserve.managers.request_queue import RequestQueue
from radixserve.managers.schedule_batch import ScheduleBatch
from radixserve.managers.schedule_policy import AddReqResult, NewTokenRatio, PrefillAdder, SchedulePolicy
from radixserve.managers.scheduler_metrics import SchedulerStats, prefill_log_line
from radixserve.mem_cache.kv_manager import KVManager

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefillLimits:
    max_running_requests: int
    max_prefill_tokens: int
    chunked_prefill_size: int | None  # None: never chunk
    pool_tokens: int  # the KV pool's size, for the log line


class PrefillPlanner:
    def __init__(self, kv_manager: KVManager, queue: RequestQueue, policy: SchedulePolicy,
                 new_token_ratio: NewTokenRatio, stats: SchedulerStats, limits: PrefillLimits, device: object) -> None:
        self.kv_manager = kv_manager
        self.queue = queue
        self.policy = policy
        self.new_token_ratio = new_token_ratio
        self.stats = stats
        self.limits = limits
        self.device = device
        self.chunked_req: Req | None = None
        self.in_flight_prefill: list[Req] = []  # the last prefill's requests, for in-batch prefix dedup
        self.batch_is_full = False
        self.lora: Any = None  # the scheduler's LoraControl (--max-loras-per-batch), once composed

    def room_freed(self) -> None:
        """A request finished or was retracted: admission may succeed again."""
        self.batch_is_full = False

    def stash_chunk(self) -> Req | None:
        """At the start of a step: the continuing chunk's KV goes into the tree (locked). An aborted
        chunk is dropped and returned, for the caller to finish."""
        chunked = self.chunked_req
        if chunked is None:
            return None
        if chunked.to_abort is not None:
            self.chunked_req = None
            return chunked
        self.kv_manager.cache_unfinished_req(chunked, chunked=True)
        return None

    def take_last_prefill(self, last: ScheduleBatch | None) -> ScheduleBatch | None:
        """The previous step's prefill without the continuing chunk, to merge into the running batch."""
        self.in_flight_prefill = []
        if last is None or not last.forward_mode.is_extend():
            return None
        # NOTE: under overlap its KV reaches the tree only when its result is processed, after this step.
        self.in_flight_prefill = list(last.reqs)
        last.filter_batch(drop=self.chunked_req)
        return last

    def forget(self, involved: list[Req]) -> None:
        """After a contained failure: drop what the failed step involved."""
        if self.chunked_req is not None and any(r is self.chunked_req for r in involved):
            self.chunked_req = None
        self.in_flight_prefill = []
        self.batch_is_full = False

    def get_new_batch_prefill(self, running: list[Req]) -> ScheduleBatch | None:
        if self.chunked_req is None and (not self.queue.waiting or self.batch_is_full):
            return None
        allocatable = min(self.limits.max_running_requests - len(running),
                          self.kv_manager.req_to_token_pool.available_size())
        if allocatable <= 0 and self.chunked_req is None:
            self.batch_is_full = True
            return None
        with self.stats.timing("cache_ops_s"):  # NOTE: matching and locking: what the radix cache costs
            policy = self.policy.calc_priority(self.queue.waiting, in_flight=self.in_flight_prefill)
            adder = self._admit(running, allocatable, matched=policy != "fcfs")
        if not adder.can_run_list:
            return None
        self.queue.remove(adder.can_run_list)
        if adder.new_chunked_req is not None:
            self.chunked_req = adder.new_chunked_req
        if self.chunked_req is not None:
            self.chunked_req.begin_chunk()
        batch = ScheduleBatch(adder.can_run_list, self.kv_manager, self.device)
        batch.prepare_for_extend()
        self._count_prefill(batch, adder, len(running))
        return batch

    def _admit(self, running: list[Req], allocatable: int, matched: bool) -> PrefillAdder:
        """Walk the ordered queue into a PrefillAdder: the continuing chunk first, then until a budget stops.

        `matched`: the policy has just matched every waiting request against the tree (one match a step)."""
        adder = PrefillAdder(self.kv_manager, running, self.new_token_ratio.value,
                             self.limits.max_prefill_tokens, self.limits.chunked_prefill_size)
        reload = self.kv_manager.hicache is not None
        adapters = {r.lora.name for r in [*running, *([self.chunked_req] if self.chunked_req else [])] if r.lora}
        if self.chunked_req is not None:
            self.chunked_req.init_next_round_input()
            self.chunked_req = adder.add_chunked_req(self.chunked_req)
        for req in self.queue.waiting:
            if len(adder.can_run_list) >= allocatable:
                self.batch_is_full = True
                break
            if req.rid in self.policy.deprioritized:
                continue  # NOTE: an earlier request is computing its prefix; next round it hits the cache
            if self.lora is not None and not self.lora.admits(adapters, req):
                # NOTE: stop here rather than skip: later requests of the running adapters would keep them
                # busy forever; the batch drains and this adapter comes in next (no adapter starves)
                break
            if not matched or reload:
                # NOTE: with the hierarchical cache every request is matched again right before its admission, and
                # that match may evict to load its stored pages: the requests admitted before it are locked, and
                # each later one is matched again before its own admission, so no unlocked match in use goes stale
                req.init_next_round_input()
                self.kv_manager.match_prefix(req, evict_for_load=reload)
            result = adder.add_one_req(req)
            if req.lora is not None and req in adder.can_run_list:
                adapters.add(req.lora.name)
            if result != AddReqResult.CONTINUE:
                self.batch_is_full = result == AddReqResult.NO_TOKEN
                break
        return adder

    def _count_prefill(self, batch: ScheduleBatch, adder: PrefillAdder, num_running: int) -> None:
        for req in batch.reqs:
            if req.count_once():
                self.stats.prompt_tokens += len(req.origin_input_ids)
                self.stats.cached_tokens += req.cached_tokens
        self.stats.prefill_tokens_computed += batch.prefill_new_tokens
        self.stats.num_prefill_batches += 1
        total = self.limits.pool_tokens
        used = total - self.kv_manager.free_and_evictable()
        logger.info(prefill_log_line(len(batch.reqs), adder.log_input_tokens, adder.log_hit_tokens,
                                     used / total, num_running, len(self.queue)))
