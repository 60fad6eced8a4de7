"""The scheduler: continuous batching with radix prefix reuse, composed of parts with one job each.

One step, in both loops (`_run_step`): receive messages, pick the next batch (a prefill if one can be
admitted, else a decode of the running batch), launch it (`run_batch`, the one forward path), and
process a result: the batch just launched in `event_loop_normal`, the previous one in
`event_loop_overlap` (forward_pipeline.py). The parts, each given its dependencies explicitly:

- `RequestQueue` (request_queue.py): the waiting queue and every live request by id;
- `InputProcessor` (scheduler_input_processor.py): admit or reject a request, abort one;
- `GrammarManager` (grammar_manager.py): requests whose grammar compiles, and each batch's token bitmask;
- `PrefillPlanner` (prefill_planner.py): the next prefill; owns the chunked request;
- `DecodePlanner` (decode_planner.py): the next decode step, with retraction;
- `OutputProcessor` (scheduler_output_processor.py): results -> request progress, finishes, outputs;
- `Pipelines` (step_pipelines.py): the forward pipelines of the two loops;
- `FailureContainment` (scheduler_failures.py): a failing step aborts only the requests it involved;
- `KVManager` (mem_cache/kv_manager.py): every KV operation.

The scheduler itself owns the batches (`running_batch`, and the step's `cur_batch`/`last_batch`).
A request's lifecycle transitions are `Req`'s methods (req.py).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from radixserve import envs
from radixserve.configs.speculative import SpecConfig
from radixserve.constrained.jump_forward import JumpForward
from radixserve.managers.cache_observer import cache_tree_snapshot
from radixserve.managers.decode_planner import DecodePlanner
from radixserve.managers.forward_pipeline import ForwardPipeline, LaunchedBatch
from radixserve.managers.grammar_manager import GrammarManager
from radixserve.managers.overlap_utils import OverlapDebug
from radixserve.managers.prefill_planner import PrefillLimits, PrefillPlanner
from radixserve.managers.req import FinishReason, Req
from radixserve.managers.request_queue import RequestQueue
from radixserve.managers.schedule_batch import ScheduleBatch, penalty_info
from radixserve.managers.schedule_policy import NewTokenRatio, SchedulePolicy
from radixserve.managers.scheduler_failures import FailureContainment
from radixserve.managers.scheduler_input_processor import InputProcessor
from radixserve.managers.scheduler_lora import LORA_MESSAGES, LoraControl
from radixserve.managers.scheduler_metrics import SchedulerStats
from radixserve.managers.scheduler_output_processor import OutputProcessor, logprob_top_k
from radixserve.managers.scheduler_runner import SchedulerRunner
from radixserve.managers.scheduler_state import StateReport
from radixserve.managers.session_cache import SessionPins
from radixserve.managers.step_pipelines import Pipelines
from radixserve.mem_cache.hicache import make_hicache
from radixserve.mem_cache.kv_manager import KVManager
from radixserve.mem_cache.swa_radix_cache import make_tree_cache
from radixserve.protocol.io_struct import (
    AbortReq,
    CacheTreeReq,
    CheckSessionReq,
    CloseSessionReq,
    FlushCacheOut,
    FlushCacheReq,
    GetInternalStateOut,
    GetInternalStateReq,
    OpenSessionReq,
    TokenizedGenerateReqInput,
)
from radixserve.protocol.requests import RequestLimits
from radixserve.server_args import ServerArgs
from radixserve.speculative.drafter import make_drafter
from radixserve.speculative.verify import attach_drafts

logger = logging.getLogger(__name__)


class Scheduler:
    """Owns the batches and composes the parts; the step's whole data path is on this screen."""

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
        # NOTE: the allocator says whether the pool is hybrid (tiers.py); only then has the runner a window W
        window = model_runner.swa_window if self.token_to_kv_pool_allocator.is_hybrid else None
        self.tree_cache = make_tree_cache(self.req_to_token_pool, self.token_to_kv_pool_allocator, self.page_size,
                                          server_args, window)
        self.stats = SchedulerStats()
        self.kv_manager = KVManager(self.req_to_token_pool, self.token_to_kv_pool_allocator, self.tree_cache,
                                    self.stats, make_hicache(server_args, model_runner, self.tree_cache,
                                                             self.token_to_kv_pool_allocator, self.stats))
        self.policy = SchedulePolicy(server_args.schedule_policy, self.kv_manager)
        self.new_token_ratio = NewTokenRatio(server_args.schedule_conservativeness)
        self.output_sink = output_sink or (lambda out: None)
        self._compose_parts(server_args)
        if self.kv_manager.hicache is not None:
            self.kv_manager.hicache.before_pool_write = self._finish_forwards

        self.running_batch = ScheduleBatch([], self.kv_manager, self.device)
        self.cur_batch: ScheduleBatch | None = None
        self.last_batch: ScheduleBatch | None = None
        self.cache_epoch = 0  # successful flush_cache calls
        self.input_queue: queue.Queue = queue.Queue()
        self.stop_event = threading.Event()
        self.strict_checks = envs.STRICT_CHECKS.get()
        self._idle_checked = False

    def _finish_forwards(self) -> None:
        """Block until every launched forward has run (the disk tier then loads KV into freed slots)."""
        for pipeline in (self.pipelines.overlap, self.pipelines.normal):
            if pipeline is not None:
                pipeline.streams.forward.synchronize()

    def _compose_parts(self, args: ServerArgs) -> None:
        pool = self.max_total_num_tokens
        chunk = args.chunked_prefill_size if args.chunked_prefill_size > 0 else None
        self.queue = RequestQueue()
        self.prefill = PrefillPlanner(self.kv_manager, self.queue, self.policy, self.new_token_ratio, self.stats,
                                      PrefillLimits(self.max_running_requests, args.max_prefill_tokens, chunk, pool),
                                      self.device)
        # NOTE: without the radix cache a jump's extend would recompute the whole sequence
        jump = JumpForward(self.tokenizer, enabled=not (args.disable_jump_forward or args.disable_radix_cache))
        spec = SpecConfig.of(args)
        # NOTE: optional in SchedulerRunner (the tests' fakes have no fast path)
        fast_rows = getattr(self.model_runner, "fast_decode_rows", None)
        drafter = make_drafter(spec, self.context_len, self.tree_cache, fast_rows, args, self.model_runner)
        self.output = OutputProcessor(self.kv_manager, self.queue, self.prefill, self.stats, self.tokenizer,
                                      lambda out: self.output_sink(out), args.log_interval, pool, jump,
                                      drafter.cost if drafter is not None else None)
        self.decode = DecodePlanner(self.queue, self.prefill, self.output, self.new_token_ratio, self.stats, pool,
                                    drafter)
        self.grammars = GrammarManager(self.model_runner, self.queue, self.output, self.eos_token_ids,
                                       args.grammar_compile_timeout, args.grammar_cache_bytes)
        self.lora = LoraControl(getattr(self.model_runner, "lora", None), self.queue, self.grammars, self.kv_manager,
                                args.max_loras_per_batch)
        self.prefill.lora = self.lora
        self.inputs = InputProcessor(self.queue, self.output, self.stats, RequestLimits.of_runner(self.model_runner),
                                     self.grammars, lambda: self.pipelines.counters.launched, self.lora)
        self.pipelines = Pipelines(self.model_runner, self.device, release=self.grammars.release)
        self.failures = FailureContainment(self, self.pipelines, self.queue, self.prefill, self.output)
        self.state_report = StateReport(self)
        self.sessions = SessionPins.of_args(self.kv_manager, args, self.max_total_num_tokens)
        self.inputs.sessions = self.output.sessions = self.sessions

    # ---- loops ----------------------------------------------------------------------------------
    def event_loop(self) -> None:
        """The loop the server arguments choose: overlap unless --disable-overlap-schedule (both front ends)."""
        if self.server_args.disable_overlap_schedule:
            self.event_loop_normal()
        else:
            self.event_loop_overlap()

    def event_loop_normal(self) -> None:
        """Run steps until `stop_event` is set; each processes the batch it has just launched."""
        while not self.stop_event.is_set():
            self.run_step_contained(self.run_step)  # NOTE: a failing step aborts its requests (scheduler_failures.py)

    def event_loop_overlap(self) -> None:
        """Run steps until `stop_event` is set; each processes the previous batch while this one runs."""
        try:
            while not self.stop_event.is_set():
                # NOTE: a failing step aborts its requests and drops the overlap pipeline; the next builds a new one.
                self.run_step_contained(self.run_step_overlap)
        except BaseException:
            self.close_overlap(drain=False)
            raise
        self.close_overlap()

    def run_step(self, block_when_idle: bool = True) -> ScheduleBatch | None:
        """One iteration of the normal loop; returns the batch it ran, or None when idle."""
        return self._run_step(self.normal_pipeline(), block_when_idle)

    def run_step_overlap(self, block_when_idle: bool = True) -> ScheduleBatch | None:
        """One iteration of the overlap loop: launch batch k+1, then process batch k."""
        return self._run_step(self.init_overlap(), block_when_idle)

    def _run_step(self, pipeline: ForwardPipeline, block_when_idle: bool) -> ScheduleBatch | None:
        with pipeline.streams.schedule.context():
            # NOTE: requests whose grammar compiles leave nothing to run: block (briefly) on the queue, not spin
            idle = self._nothing_to_run() and not pipeline.pending
            self.process_input_requests(self.recv_requests(block=block_when_idle and idle))
            batch = self.get_next_batch_to_run()
            self.cur_batch = batch
            if batch is not None:
                self._idle_checked = False
                pipeline.pending.append(self.run_batch(batch, pipeline))
            ready = pipeline.take_ready(launched_now=batch is not None)
            if ready is not None:
                self.process_batch_result(ready)
            elif batch is None:
                self.on_idle()
            self.last_batch = batch
            return batch

    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        """Stash the chunk, merge the last prefill into running, then prefill if possible, else decode."""
        aborted_chunk = self.prefill.stash_chunk()
        if aborted_chunk is not None:
            self.output.finish_now(aborted_chunk, aborted_chunk.to_abort)
        last = self.prefill.take_last_prefill(self.last_batch)
        if last is not None:
            self.running_batch.merge_batch(last)
            self.last_batch = None
        self._finish_marked_aborts(self.running_batch)
        self.grammars.move_ready()
        self._expire_waiting()
        new_batch = self.get_new_batch_prefill()
        if new_batch is not None:
            return new_batch
        if self.decode.may_verify(self.running_batch):
            # NOTE: drafts are taken from the host's tokens: a decode step that may verify drafts waits for the
            # results in flight (prefills still overlap; docs/speculative.md).
            self._process_in_flight()
        return self.update_running_batch()

    def run_batch(self, batch: ScheduleBatch, pipeline: ForwardPipeline | None = None) -> LaunchedBatch:
        """The one forward path of both loops: launch `batch`'s forward, sampling and copy to the host."""
        reqs, output_lens = batch.sampled_rows()
        info = self.sampling_info(reqs, output_lens, batch.forward_mode.is_extend())
        verify = batch.forward_batch.verify
        if verify is not None and info is not None:
            attach_drafts(info, verify, self.device)
        pipeline = pipeline or self.normal_pipeline()
        self.grammars.attach(info, reqs)
        if pipeline.pending and pipeline.streams.forward.runs_on_caller and getattr(info, "grammar_mask", None):
            # NOTE: a forward launched on this thread (CUDA streams) samples before `launch` returns, so its mask
            # cannot wait for a result processed after it: process the results in flight first
            self._process_in_flight()
        if not pipeline.pending:
            self.grammars.fill(info)  # NOTE: every earlier result is processed: the rows' grammars are current
        return pipeline.launch(batch, info, logprob_top_k(reqs))

    def _process_in_flight(self) -> None:
        for pipeline in (self.pipelines.overlap, self.pipelines.normal):
            while pipeline is not None and pipeline.pending:
                self.process_batch_result(pipeline.pending.popleft())

    # ---- the parts' entry points, under SGLang's names ----------------------------------------------
    def get_new_batch_prefill(self) -> ScheduleBatch | None:
        return self.prefill.get_new_batch_prefill(self.running_batch.reqs)

    def update_running_batch(self) -> ScheduleBatch | None:
        batch = self.decode.update_running_batch(self.running_batch)
        if batch is not None:
            self.stats.peak_running_reqs = max(self.stats.peak_running_reqs, batch.batch_size())
        return batch

    def process_batch_result(self, launched: LaunchedBatch) -> None:
        self.output.process_batch_result(launched, self.pipelines.counters)
        for pipeline in (self.pipelines.overlap, self.pipelines.normal):
            if pipeline is not None and pipeline.pending:  # NOTE: the next batch's rows are current now
                self.grammars.fill(pipeline.pending[0].sampling_info)

    def run_step_contained(self, step: Callable[[], Any]) -> Any:
        return self.failures.run_step_contained(step)

    def release_finished_req(self, req: Req) -> None:
        self.output.release_finished_req(req)

    def finish_now(self, req: Req, reason: FinishReason) -> None:
        self.output.finish_now(req, reason)

    def handle_generate_request(self, msg: TokenizedGenerateReqInput) -> None:
        self.inputs.handle_generate_request(msg)

    def validate_request(self, req: Req) -> str | None:
        return self.inputs.validate_request(req)

    def abort_request(self, rid: str) -> None:
        self.inputs.abort_request(rid)

    # ---- messages -------------------------------------------------------------------------------
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

    def process_input_requests(self, msgs: list[Any]) -> None:
        self.sessions.maybe_expire()
        for msg in msgs:
            if isinstance(msg, TokenizedGenerateReqInput):
                self.handle_generate_request(msg)
            elif isinstance(msg, AbortReq):
                self.abort_request(msg.rid)
            elif isinstance(msg, FlushCacheReq):
                self.output_sink(self.flush_cache())
            elif isinstance(msg, GetInternalStateReq):
                self.output_sink(GetInternalStateOut(self.get_internal_state()))
            elif isinstance(msg, CacheTreeReq):
                self.output_sink(cache_tree_snapshot(self, msg))
            elif isinstance(msg, LORA_MESSAGES):
                self.output_sink(self.lora.handle(msg))
            elif isinstance(msg, (OpenSessionReq, CloseSessionReq, CheckSessionReq)):
                self.output_sink(self.sessions.handle(msg))
            else:
                logger.error("unknown message %r ignored", type(msg).__name__)

    def flush_cache(self) -> FlushCacheOut:
        """Empty the tree, only when no request holds KV (no lock, no row)."""
        busy = self.active_requests()
        if busy:
            return FlushCacheOut(False, 0, f"{len(busy)} request(s) hold KV: {', '.join(r.rid for r in busy[:8])}",
                                 self.cache_epoch)
        unpinned = self.sessions.unpin_all()  # NOTE: sessions stay open, unpinned: the tree is about to be emptied
        freed = self.kv_manager.flush()
        for req in self.queue.waiting:  # NOTE: their unlocked matches point into the old tree
            self.kv_manager.forget_match(req)
        self.cache_epoch += 1
        grammars = self.grammars.flush()  # NOTE: a grammar still compiling stays (its requests wait for it)
        return FlushCacheOut(True, freed, f"flushed {freed} cached tokens ({unpinned} of them unpinned from "
                                          f"{len(self.sessions.sessions)} open sessions); {grammars}", self.cache_epoch)

    # ---- step helpers -----------------------------------------------------------------------------
    def _expire_waiting(self) -> None:
        """End requests that waited longer than --queue-timeout for admission (503: retry elsewhere)."""
        timeout = self.server_args.queue_timeout
        if timeout is None:
            return
        now = time.monotonic()
        for req in self.queue.expired(timeout, now):
            self.stats.num_queue_timeouts += 1
            self.output.finish_now(req, FinishReason.abort(
                f"waited {now - req.wait_since:.1f} s for admission, over the queue timeout of {timeout:g} s; "
                "the server is overloaded", status_code=503))

    def _finish_marked_aborts(self, batch: ScheduleBatch) -> None:
        for req in [r for r in batch.reqs if r.to_abort is not None and not r.finished()]:
            self.output.finish_now(req, req.to_abort)
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

    def on_idle(self) -> None:
        self.new_token_ratio.reset()
        self.output.decode_throughput.take()  # NOTE: idle time must not dilute the next decode log's throughput
        self.decode.on_idle()
        if not self._idle_checked:
            self._idle_checked = True
            self.check_memory()

    # ---- pipelines ------------------------------------------------------------------------------
    def normal_pipeline(self) -> ForwardPipeline:
        return self.pipelines.normal_pipeline()

    def init_overlap(self, debug: OverlapDebug | None = None) -> ForwardPipeline:
        return self.pipelines.init_overlap(debug)

    def close_overlap(self, drain: bool = True) -> None:
        """Process what is in flight (unless `drain` is False: after a failure), stop the stream threads."""
        self.pipelines.close_overlap(self.process_batch_result, drain)

    def run_until_idle(self, max_steps: int = 100_000, on_step: Callable[[], None] | None = None) -> int:
        """Normal steps (without blocking) until nothing is queued or running; returns the steps taken."""
        return self._run_until_idle(self.run_step, self.normal_pipeline(), max_steps, on_step)

    def run_until_idle_overlap(self, max_steps: int = 100_000, on_step: Callable[[], None] | None = None) -> int:
        """Overlapped steps (without blocking) until nothing is queued, running or in flight."""
        return self._run_until_idle(self.run_step_overlap, self.init_overlap(), max_steps, on_step)

    def _run_until_idle(self, step: Callable[..., Any], pipeline: ForwardPipeline, max_steps: int,
                        on_step: Callable[[], None] | None) -> int:
        for n in range(max_steps):
            if self.is_idle() and not pipeline.pending and self.input_queue.empty():
                return n
            step(block_when_idle=False)
            if on_step is not None:
                # NOTE: on the schedule stream, where the scheduler's device writes are queued: a check that reads
                # the pools from another CUDA stream would race them
                with pipeline.streams.schedule.context():
                    on_step()
        raise RuntimeError(f"not idle after {max_steps} steps")

    # ---- state and checks -----------------------------------------------------------------------
    def is_idle(self) -> bool:
        """Nothing queued, compiling or holding KV (a prefill batch not yet merged into running counts)."""
        return self._nothing_to_run() and not self.grammars.compiling

    def _nothing_to_run(self) -> bool:
        return not self.queue.waiting and self.prefill.chunked_req is None and not self.active_requests()

    def active_requests(self) -> list[Req]:
        """Requests holding KV or locks: running, in the batch just run, or mid-chunk."""
        seen: dict[int, Req] = {}
        batches = [self.running_batch, self.cur_batch, self.last_batch]
        for req in [r for b in batches if b is not None for r in b.reqs] + [self.prefill.chunked_req]:
            if req is not None and not req.finished() and req.kv.req_pool_idx is not None:
                seen[id(req)] = req
        return list(seen.values())

    def free_and_evictable(self) -> int:
        return self.kv_manager.free_and_evictable()

    def check_conservation(self) -> dict[str, Any]:
        """The conservation identity over the pool; raises ConservationError with the leaked slot ids."""
        from radixserve.mem_cache.conservation import check_conservation

        overlap = self.pipelines.overlap
        with overlap.streams.schedule.context() if overlap is not None else contextlib.nullcontext():
            return check_conservation(self.token_to_kv_pool_allocator, self.tree_cache, self.req_to_token_pool,
                                      [r.kv for r in self.active_requests()], self.sessions.pinned_nodes())

    def check_memory(self, strict: bool | None = None) -> dict[str, Any]:
        """The conservation identity's terms, or {"error": ...}; logs a failure, raises it under strict
        checks (RADIXSERVE_STRICT_CHECKS=1, as in the tests)."""
        from radixserve.mem_cache.conservation import ConservationError

        try:
            return self.check_conservation()
        except ConservationError as e:
            logger.error("KV pool leak detected: %s", e)
            if self.strict_checks if strict is None else strict:
                raise
            return {"error": str(e)}

    def get_internal_state(self) -> dict[str, Any]:
        """Counters, pool sizes and, when idle, the conservation check's terms (or its error)."""
        return self.state_report()

    def shutdown(self) -> None:
        self.stop_event.set()

    # ---- read-only views of the parts' state (tests, observers) -------------------------------------
    @property
    def waiting_queue(self) -> list[Req]:
        return self.queue.waiting

    @property
    def reqs(self) -> dict[str, Req]:
        return self.queue.live

    @property
    def chunked_req(self) -> Req | None:
        return self.prefill.chunked_req

    @property
    def failed_steps(self) -> int:
        return self.failures.failed_steps

    @property
    def overlap(self) -> ForwardPipeline | None:
        return self.pipelines.overlap

    @property
    def pipeline_counters(self) -> Any:
        return self.pipelines.counters

