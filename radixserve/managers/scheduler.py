"""The scheduler: continuous batching with radix prefix reuse.

One step, in both loops: receive messages, pick the next batch (a prefill if one can be admitted,
else a decode of the running batch), launch it (`run_batch`, the one forward path), and process a
result (`process_batch_result`): the batch just launched in `event_loop_normal`, the previous one in
`event_loop_overlap` (forward_pipeline.py). Outputs go to `output_sink` as io_struct messages. Every
KV operation goes through `self.kv_manager`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from radixserve import envs
from radixserve.managers.forward_pipeline import ForwardPipeline, PipelineCounters
from radixserve.managers.overlap_utils import OverlapDebug
from radixserve.managers.schedule_batch import (
    RETRACT_DECODE_STEPS,
    FinishReason,
    Req,
    ScheduleBatch,
    penalty_info,
)
from radixserve.managers.schedule_policy import AddReqResult, NewTokenRatio, PrefillAdder, SchedulePolicy
from radixserve.managers.scheduler_failures import SchedulerFailuresMixin
from radixserve.managers.scheduler_input_processor import SchedulerInputProcessorMixin
from radixserve.managers.scheduler_loop import SchedulerLoopMixin
from radixserve.managers.scheduler_metrics import DecodeThroughput, SchedulerStats, prefill_log_line
from radixserve.managers.scheduler_output_processor import SchedulerOutputProcessorMixin
from radixserve.managers.scheduler_runner import SchedulerRunner
from radixserve.mem_cache.kv_manager import KVManager
from radixserve.mem_cache.radix_cache import RadixCache
from radixserve.server_args import ServerArgs

logger = logging.getLogger(__name__)


class Scheduler(SchedulerLoopMixin, SchedulerInputProcessorMixin, SchedulerOutputProcessorMixin,
                SchedulerFailuresMixin):
    """Owns the waiting queue, the running batch, the KV manager and the model runner."""

    def __init__(self, server_args: ServerArgs, model_runner: SchedulerRunner | None = None,
                 output_sink: Callable[[Any], None] | None = None) -> None:
        if model_runner is None:
            from radixserve.model_executor.model_runner import ModelRunner

            model_runner = ModelRunner(server_args)
        self.server_args = server_args
        self.model_runner = model_runner
        self.tokenizer = model_runner.tokenizer
        self.device = model_runner.device
        self.page_size = model_runner.page_size
        self.context_len = model_runner.context_len
        self.max_total_num_tokens = model_runner.max_total_num_tokens
        self.max_running_requests = model_runner.max_running_requests
        self.vocab_size = model_runner.model_config.vocab_size
        self.eos_token_ids = tuple(model_runner.model_config.eos_token_ids)
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool_allocator = model_runner.token_to_kv_pool_allocator
        self.tree_cache = RadixCache(self.req_to_token_pool, self.token_to_kv_pool_allocator, self.page_size,
                                     disable=server_args.disable_radix_cache,
                                     eviction_policy=server_args.radix_eviction_policy)
        self.stats = SchedulerStats()
        self.kv_manager = KVManager(self.req_to_token_pool, self.token_to_kv_pool_allocator, self.tree_cache,
                                    self.stats)
        self.policy = SchedulePolicy(server_args.schedule_policy, self.kv_manager)
        self.chunked_prefill_size = server_args.chunked_prefill_size if server_args.chunked_prefill_size > 0 else None
        self.new_token_ratio = NewTokenRatio(server_args.schedule_conservativeness)

        self.waiting_queue: list[Req] = []
        self.running_batch = self._new_batch([])
        self.cur_batch: ScheduleBatch | None = None
        self.last_batch: ScheduleBatch | None = None
        self.chunked_req: Req | None = None
        self.in_flight_prefill: list[Req] = []  # the last prefill's requests, for in-batch prefix dedup
        self.batch_is_full = False
        self.reqs: dict[str, Req] = {}  # every request not yet finished, by rid
        self.cache_epoch = 0  # successful flush_cache calls

        self.input_queue: queue.Queue = queue.Queue()
        self.output_sink = output_sink or (lambda out: None)
        self.stop_event = threading.Event()
        self.decode_throughput = DecodeThroughput()
        self.strict_checks = envs.STRICT_CHECKS.get()
        # Test hook (SGLang's SGLANG_TEST_RETRACT): retract one request every N decode steps.
        self.test_retract_interval = envs.TEST_RETRACT_INTERVAL.get()
        self.decode_steps = 0
        self._idle_checked = False
        # The forward pipelines (forward_pipeline.py): the normal loop's, made on first use, and the
        # overlap loop's, from init_overlap until close_overlap.
        self.overlap: ForwardPipeline | None = None
        self._openmp_threads: int | None = None  # the scheduler thread's OpenMP count before the overlap loop
        self.overlap_debug: OverlapDebug | None = None
        self.pipeline_counters = PipelineCounters()
        self._normal_pipeline: ForwardPipeline | None = None

    def _new_batch(self, reqs: list[Req]) -> ScheduleBatch:
        return ScheduleBatch(reqs, self.kv_manager, self.device)

    def is_idle(self) -> bool:
        """Nothing queued and nothing holding KV (a prefill batch not yet merged into running counts)."""
        return not self.waiting_queue and self.chunked_req is None and not self.active_requests()

    def recv_requests(self, block: bool = False) -> list[Any]:
        msgs = []
        if block:
            try:
                msgs.append(self.input_queue.get(timeout=0.05))
            except queue.Empty:
                return msgs
        while True:
            try:
                msgs.append(self.input_queue.get_nowait())
            except queue.Empty:
                return msgs

    def on_idle(self) -> None:
        self.new_token_ratio.reset()
        self.decode_throughput.take()  # NOTE: idle time must not dilute the next decode log's throughput
        if not self._idle_checked:
            self._idle_checked = True
            self.check_memory()

    # ---- batches --------------------------------------------------------------------------------
    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        """Stash the chunk, merge the last prefill into running, then prefill if possible, else decode."""
        chunked = self.chunked_req
        if chunked is not None:
            if chunked.to_abort is not None:
                self.chunked_req = None
                self.finish_now(chunked, chunked.to_abort)
            else:
                self.kv_manager.cache_unfinished_req(chunked, chunked=True)
        last = self.last_batch
        self.in_flight_prefill = []
        if last is not None and last.forward_mode.is_extend():
            # NOTE: under overlap its KV reaches the tree only when its result is processed, after this step.
            self.in_flight_prefill = list(last.reqs)
            last.filter_batch(drop=self.chunked_req)
            self.running_batch.merge_batch(last)
            self.last_batch = None
        self._finish_marked_aborts(self.running_batch)
        self._expire_waiting()
        new_batch = self.get_new_batch_prefill()
        if new_batch is not None:
            return new_batch
        return self.update_running_batch()

    def _expire_waiting(self) -> None:
        """End requests that waited longer than --queue-timeout for admission (503: retry elsewhere)."""
        timeout = self.server_args.queue_timeout
        if timeout is None:
            return
        now = time.monotonic()
        # NOTE: a retracted request was admitted once and holds a client's partial output: never expired.
        expired = [r for r in self.waiting_queue if not r.retraction_count and now - r.wait_since > timeout]
        if not expired:
            return
        gone = {id(r) for r in expired}
        self.waiting_queue = [r for r in self.waiting_queue if id(r) not in gone]
        for req in expired:
            self.stats.num_queue_timeouts += 1
            self.finish_now(req, FinishReason.abort(
                f"waited {now - req.wait_since:.1f} s for admission, over the queue timeout of {timeout:g} s; "
                "the server is overloaded", status_code=503))

    def _finish_marked_aborts(self, batch: ScheduleBatch) -> None:
        for req in [r for r in batch.reqs if r.to_abort is not None and not r.finished()]:
            self.finish_now(req, req.to_abort)
        batch.filter_batch()

    def get_new_batch_prefill(self) -> ScheduleBatch | None:
        if self.chunked_req is None and (not self.waiting_queue or self.batch_is_full):
            return None
        running = self.running_batch.reqs
        allocatable = min(self.max_running_requests - len(running), self.req_to_token_pool.available_size())
        if allocatable <= 0 and self.chunked_req is None:
            self.batch_is_full = True
            return None
        with self.stats.timing("cache_ops_s"):  # NOTE: matching and locking: what the radix cache costs
            policy = self.policy.calc_priority(self.waiting_queue, in_flight=self.in_flight_prefill)
            adder = self._admit(running, allocatable, matched=policy != "fcfs")
        if not adder.can_run_list:
            return None
        admitted = {id(r) for r in adder.can_run_list}
        self.waiting_queue = [r for r in self.waiting_queue if id(r) not in admitted]
        if adder.new_chunked_req is not None:
            self.chunked_req = adder.new_chunked_req
        if self.chunked_req is not None:
            self.chunked_req.is_chunked += 1
        batch = self._new_batch(adder.can_run_list)
        batch.prepare_for_extend()
        self._count_prefill(batch, adder)
        return batch

    def _admit(self, running: list[Req], allocatable: int, matched: bool) -> PrefillAdder:
        """Walk the ordered queue into a PrefillAdder: the continuing chunk first, then until a budget stops.

        `matched`: the policy has just matched every waiting request against the tree (one match a step)."""
        adder = PrefillAdder(self.kv_manager, running, self.new_token_ratio.value,
                             self.server_args.max_prefill_tokens, self.chunked_prefill_size)
        if self.chunked_req is not None:
            self.chunked_req.init_next_round_input()
            self.chunked_req = adder.add_chunked_req(self.chunked_req)
        for req in self.waiting_queue:
            if len(adder.can_run_list) >= allocatable:
                self.batch_is_full = True
                break
            if req.rid in self.policy.deprioritized:
                continue  # NOTE: an earlier request is computing its prefix; next round it hits the cache
            if not matched:
                req.init_next_round_input()
                self.kv_manager.match_prefix(req)
            result = adder.add_one_req(req)
            if result != AddReqResult.CONTINUE:
                self.batch_is_full = result == AddReqResult.NO_TOKEN
                break
        return adder

    def _count_prefill(self, batch: ScheduleBatch, adder: PrefillAdder) -> None:
        for req in batch.reqs:
            if not req.stats_counted and not req.retracted_stain:
                req.stats_counted = True
                self.stats.prompt_tokens += len(req.origin_input_ids)
                self.stats.cached_tokens += req.cached_tokens
        self.stats.prefill_tokens_computed += batch.prefill_new_tokens
        self.stats.num_prefill_batches += 1
        used = self.max_total_num_tokens - self.free_and_evictable()
        logger.info(prefill_log_line(len(batch.reqs), adder.log_input_tokens, adder.log_hit_tokens,
                                     used / self.max_total_num_tokens, len(self.running_batch.reqs),
                                     len(self.waiting_queue)))

    def update_running_batch(self) -> ScheduleBatch | None:
        """Prepare a decode step of the running batch, retracting requests if the pool is short."""
        batch = self.running_batch
        batch.filter_batch()
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
        batch.prepare_for_decode()
        return batch

    def _retract(self, batch: ScheduleBatch) -> None:
        old_ratio = self.new_token_ratio.value
        retracted = batch.retract_decode()
        if not retracted:
            return
        self.new_token_ratio.on_retract(batch.reqs, RETRACT_DECODE_STEPS)
        self.stats.num_retractions += len(retracted)
        self.batch_is_full = False
        # NOTE: they keep their outputs and resume first; their prompts are still in the tree, unlocked.
        self.waiting_queue[:0] = retracted
        logger.info("KV cache pool is full. Retract requests. #retracted_reqs: %d, #new_token_ratio: %.4f -> %.4f",
                    len(retracted), old_ratio, self.new_token_ratio.value)

    def _abort_out_of_memory(self, batch: ScheduleBatch) -> None:
        for req in list(batch.reqs):
            needed = req.kv.kv_allocated_len + 1
            message = (f"out of memory even after retracting every other request: this request needs "
                       f"{needed} KV slots, the pool has {self.max_total_num_tokens}")
            logger.error("Abort %s: %s", req.rid, message)
            self.finish_now(req, FinishReason.abort(message, status_code=500))
        batch.filter_batch()

    def sampling_info(self, reqs: list[Req], output_lens: list[int], is_extend: bool) -> Any:
        """Sampling parameters and logit processing of a batch whose rows are assigned (both loops).

        `output_lens`: tokens each request generated before this step; under overlap the host's
        output_ids lag one step and the caller passes the true counts."""
        from radixserve.layers.sampler import SamplingBatchInfo

        info = SamplingBatchInfo.from_params([r.sampling_params for r in reqs], output_lens, self.device,
                                             default_generator_seed=self.server_args.random_seed)
        info.penalties = penalty_info(reqs, output_lens, self.device, is_extend)
        return info

    # ---- state and checks -----------------------------------------------------------------------
    def free_and_evictable(self) -> int:
        return self.kv_manager.free_and_evictable()

    def active_requests(self) -> list[Req]:
        """Requests holding KV or locks: running, in the batch just run, or mid-chunk."""
        seen: dict[int, Req] = {}
        batches = [self.running_batch, self.cur_batch, self.last_batch]
        for req in [r for b in batches if b is not None for r in b.reqs] + [self.chunked_req]:
            if req is not None and not req.finished() and req.kv.req_pool_idx is not None:
                seen[id(req)] = req
        return list(seen.values())

    def check_memory(self, strict: bool | None = None) -> dict[str, Any]:
        """The conservation identity over the pool: its terms, or {"error": ...} with the leaked slot ids.

        Logs a failure; raises it under strict checks (RADIXSERVE_STRICT_CHECKS=1, as in the tests).
        """
        from radixserve.mem_cache.conservation import ConservationError, check_conservation

        try:
            return check_conservation(self.token_to_kv_pool_allocator, self.tree_cache,
                                      self.req_to_token_pool, [r.kv for r in self.active_requests()])
        except ConservationError as e:
            logger.error("KV pool leak detected: %s", e)
            if self.strict_checks if strict is None else strict:
                raise
            return {"error": str(e)}

    def get_internal_state(self) -> dict[str, Any]:
        """Counters, pool sizes and, when idle, the conservation check's terms (or its error)."""
        return {
            "kv_conservation": self.check_memory(strict=False) if self.is_idle() else None,
            **self.stats.as_dict(),
            "cache_hit_rate": self.stats.cache_hit_rate,
            "num_waiting_reqs": len(self.waiting_queue),
            "num_running_reqs": len(self.active_requests()),
            "available_tokens": self.token_to_kv_pool_allocator.available_size(),
            "evictable_tokens": self.tree_cache.evictable_size(),
            "protected_tokens": self.tree_cache.protected_size(),
            "max_total_num_tokens": self.max_total_num_tokens,
            "token_usage": 1 - self.free_and_evictable() / self.max_total_num_tokens,
            "page_size": self.page_size,
            "context_len": self.context_len,
            "max_running_requests": self.max_running_requests,
            "new_token_ratio": self.new_token_ratio.value,
            "disable_radix_cache": self.tree_cache.disable,
            "schedule_policy": self.policy.policy,
            "cache_epoch": self.cache_epoch,
        }

    def shutdown(self) -> None:
        self.stop_event.set()
