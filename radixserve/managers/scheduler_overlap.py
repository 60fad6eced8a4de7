"""The overlap event loop (reference §5.3-§5.8): schedule batch k+1 while batch k computes.

One iteration, in SGLang's order: receive requests; build batch k+1 (radix matching, slot allocation,
`req_to_token` writes) while forward k may still run; launch it on the forward stream; apply the
write-after-read barrier; then process batch k's result while forward k+1 runs.

Consequences of the one-step lag (reference §5.8) and how they are handled here:

* Decode input ids are not known on the host when the step is built. Each forward `stash`es its
  sampled tokens into the `FutureMap` (one entry per request row) and the next decode `resolve`s its
  input ids from it, both on the forward stream.
* A request that finishes in batch k is still in batch k+1 (the "overrun" step). Its result in
  batch k+1 is skipped, so it is finished, counted and released exactly once. While batch k is
  processed, every request that batch k+1 already advanced is shown with the normal loop's
  `kv_committed_len` (one less), so a finished request inserts `seqlen - 1` tokens into the tree,
  exactly what the normal loop inserts, and the overrun slot is freed as over-allocation. The overrun
  forward still writes that slot; a later owner only writes it in a later forward, on the same stream.
* A request retracted or aborted while its batch was in flight no longer owns the row it ran with;
  its in-flight token is dropped (a retracted request recomputes it when it is prefilled again).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from radixserve.layers.sampler import TokenLogprobs
from radixserve.managers.overlap_utils import (
    DeviceStreams,
    Event,
    FutureMap,
    OverlapDebug,
    create_device_streams,
)
from radixserve.managers.scheduler_output_processor import (
    GenerationBatchResult,
    host_input_logprobs,
    host_logprobs,
    logprob_top_k,
)

if TYPE_CHECKING:
    from collections.abc import Callable
    from concurrent.futures import Future

    from radixserve.managers.schedule_batch import Req, ScheduleBatch
    from radixserve.managers.scheduler import Scheduler
    from radixserve.model_executor.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)


@dataclass
class DeviceJob:
    """What one forward needs on the device, kept alive until its result has been processed."""

    forward_batch: ForwardBatch
    sampling_info: Any
    is_decode: bool
    read_done: Event
    logprob_top_k: int | None  # None: no request of the batch asked for logprobs
    expected_rows: torch.Tensor | None = None  # check_reads: the rows the scheduler wrote for this forward
    read_signalled: bool = False


class StepOutput(NamedTuple):
    """What one forward hands to the host: the sampled ids, and logprobs when some request asked."""

    next_token_ids: torch.Tensor
    logprobs: TokenLogprobs | None
    input_logprobs: TokenLogprobs | None = None  # rows per request: forward_batch.input_logprob_counts


@dataclass
class LaunchedBatch:
    batch: ScheduleBatch  # a copy: the scheduler may filter or merge the original before this is processed
    rows: list[int]  # each request's row at launch; a request that lost it was retracted or aborted
    host_output: Future  # StepOutput of host tensors, complete once copy_done has completed
    copy_done: Event
    job: DeviceJob
    # NOTE: the forward's device StepOutput, held until copy_done has completed: freed earlier, the
    # CUDA caching allocator could hand its memory to the next forward on the forward stream while
    # the copy stream still reads it.
    device_output: Future | None = None


@dataclass
class OverlapCounters:
    """Kept on the scheduler across loop restarts (tests read them after the loop has closed)."""

    launched: int = 0
    processed: int = 0
    dropped_tokens: int = 0  # results of requests finished, aborted or retracted after their launch
    corrupted_reads: int = 0  # check_reads: forwards that read rows the scheduler had overwritten


@dataclass
class OverlapState:
    streams: DeviceStreams
    future_map: FutureMap
    fence: ReadFence
    pending: deque[LaunchedBatch] = field(default_factory=deque)


class ReadFence:
    """Wraps the model runner's attention backend to mark where a forward's shared reads end.

    The backend interface turns `req_to_token` rows into private index tensors in
    `init_forward_metadata`, once per forward before the first layer; after it, the forward reads no
    buffer the scheduler writes. So `read_done` is recorded right there (SGLang records it after the
    CUDA graph's `load_batch`) and the barrier holds scheduler writes back only for that long.
    """

    def __init__(self, inner: Any, stream: Any, req_to_token_pool: Any, counters: OverlapCounters) -> None:
        self.inner = inner
        self.stream = stream
        self.req_to_token_pool = req_to_token_pool
        self.counters = counters
        self.job: DeviceJob | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def arm(self, job: DeviceJob) -> None:
        self.job = job

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        job = self.job
        if job is not None and job.expected_rows is not None and self._rows_changed(forward_batch, job):
            self.counters.corrupted_reads += 1
        self.inner.init_forward_metadata(forward_batch)
        self.signal()

    def signal(self) -> None:
        """Record the armed job's read_done (once); also called after the forward, should it not get here."""
        job, self.job = self.job, None
        if job is not None and not job.read_signalled:
            job.read_signalled = True
            self.stream.record(job.read_done)

    def _rows_changed(self, fb: ForwardBatch, job: DeviceJob) -> bool:
        expected = job.expected_rows
        now = self.req_to_token_pool.req_to_token[fb.req_pool_indices, : expected.shape[1]]
        live = torch.arange(expected.shape[1], device=expected.device).unsqueeze(0) < fb.seq_lens.unsqueeze(1)
        return bool(((now != expected) & live).any())


class SchedulerOverlapMixin:
    """`event_loop_overlap` and its launch / result-processing steps, mixed into `Scheduler`."""

    overlap: OverlapState | None = None
    overlap_debug: OverlapDebug | None = None
    overlap_counters: OverlapCounters | None = None

    # ---- setup ----------------------------------------------------------------------------------
    def init_overlap(self: Scheduler, debug: OverlapDebug | None = None) -> OverlapState:
        """Create the streams, the future map and the read fence (once; `debug` only the first time)."""
        if self.overlap is not None:
            return self.overlap
        self.overlap_debug = debug or self.overlap_debug or OverlapDebug.from_env()
        self.overlap_counters = self.overlap_counters or OverlapCounters()
        streams = create_device_streams(self.device, self.overlap_debug)
        future_map = FutureMap(self.req_to_token_pool.size + 1, self.device, self.overlap_debug.check_future_map)
        runner = self.model_runner
        backend = runner.attn_backend
        inner = backend.inner if isinstance(backend, ReadFence) else backend
        fence = ReadFence(inner, streams.forward, self.req_to_token_pool, self.overlap_counters)
        runner.attn_backend = fence  # NOTE: delegates everything; only marks read_done when armed
        self.overlap = OverlapState(streams, future_map, fence)
        return self.overlap

    def close_overlap(self: Scheduler, drain: bool = True) -> None:
        """Process what is in flight (unless `drain` is False: after a failure), stop the stream
        threads, unwrap the attention backend."""
        state = self.overlap
        if state is None:
            return
        try:
            while drain and state.pending:
                self.process_launched_batch(state.pending.popleft())
        finally:
            state.streams.close()
            self.model_runner.attn_backend = state.fence.inner
            self.overlap = None

    # ---- loop -----------------------------------------------------------------------------------
    def event_loop_overlap(self: Scheduler) -> None:
        """Run overlapped steps until `stop_event` is set (reference §5.3)."""
        try:
            while not self.stop_event.is_set():
                state = self.init_overlap()
                with state.streams.schedule.context():
                    # NOTE: a failing step aborts its requests and rebuilds the overlap state
                    # (scheduler_failures.py); then the loop re-enters the new schedule stream.
                    while not self.stop_event.is_set() and self.overlap is state:
                        self.run_step_contained(self.run_step_overlap)
        except BaseException:
            self.close_overlap(drain=False)
            raise
        self.close_overlap()

    def run_step_overlap(self: Scheduler, block_when_idle: bool = True) -> ScheduleBatch | None:
        """One iteration: receive, build and launch batch k+1, barrier, process batch k."""
        state = self.init_overlap()
        idle = self.is_idle() and not state.pending
        self.process_input_requests(self.recv_requests(block=block_when_idle and idle))
        batch = self.get_next_batch_to_run()
        self.cur_batch = batch
        if batch is not None:
            self._idle_checked = False
            launched = self.launch_batch(batch)
            state.pending.append(launched)
            # NOTE: every scheduler write from here on (processing batch k, building batch k+2) waits
            # until forward k+1 has read the rows, input ids and future tokens it needs.
            state.streams.fence_writes_after_reads(launched.job.read_done)
        if len(state.pending) > (1 if batch is not None else 0):
            self.process_launched_batch(state.pending.popleft())
        elif batch is None:
            self.on_idle()
        self.last_batch = batch
        return batch

    def run_until_idle_overlap(self: Scheduler, max_steps: int = 100_000,
                               on_step: Callable[[], None] | None = None) -> int:
        """Overlapped steps (without blocking) until nothing is queued, running or in flight."""
        state = self.init_overlap()
        with state.streams.schedule.context():
            for step in range(max_steps):
                if self.is_idle() and not state.pending and self.input_queue.empty():
                    return step
                self.run_step_overlap(block_when_idle=False)
                if on_step is not None:
                    on_step()
        raise RuntimeError(f"not idle after {max_steps} steps")

    # ---- launch ---------------------------------------------------------------------------------
    def launch_batch(self: Scheduler, batch: ScheduleBatch) -> LaunchedBatch:
        """Enqueue batch's forward, sampling and result copy; returns at once (reference §5.4)."""
        state = self.overlap
        fb = batch.forward_batch
        reqs = list(batch.reqs)
        rows = [r.req_pool_idx for r in reqs]
        is_decode = batch.forward_mode.is_decode()
        if state.future_map.check and not is_decode:
            state.future_map.reset_rows(rows)  # NOTE: these rows may have just changed hands
        job = DeviceJob(fb, self._sampling_info(reqs, not is_decode), is_decode, state.streams.forward.create_event(),
                        logprob_top_k(reqs), self._expected_rows(fb) if self.overlap_debug.check_reads else None)
        streams = state.streams
        streams.fence_reads_after_writes()
        forward_done = streams.forward.launch(self._device_step, job)
        if streams.copy is not streams.forward:
            streams.copy.wait_stream(streams.forward)
        host_output = streams.copy.launch(_copy_to_host, forward_done)
        copy_done = streams.copy.record_event()
        copy = batch.empty_copy(reqs)
        copy.forward_mode = batch.forward_mode
        self.overlap_counters.launched += 1
        return LaunchedBatch(copy, rows, host_output, copy_done, job, forward_done)

    def _sampling_info(self: Scheduler, reqs: list[Req], is_extend: bool) -> Any:
        # NOTE: output_ids lag one step here; the output index of the token this step samples is
        # kv_committed_len - prompt length in both loops (0 for a non-final chunk, whose token is dropped).
        output_lens = [max(r.kv_committed_len - len(r.origin_input_ids), 0) for r in reqs]
        return self.sampling_info(reqs, output_lens, is_extend)

    def _expected_rows(self: Scheduler, fb: ForwardBatch) -> torch.Tensor:
        width = max(fb.seq_lens_cpu)
        return self.req_to_token_pool.req_to_token[fb.req_pool_indices, :width].clone()

    def _device_step(self: Scheduler, job: DeviceJob) -> StepOutput:
        """Runs on the forward stream: resolve input ids, forward, sample, stash the tokens."""
        state = self.overlap
        fb = job.forward_batch
        state.fence.arm(job)
        try:
            if job.is_decode:
                fb.input_ids = state.future_map.resolve(fb.req_pool_indices)
            logits = self.model_runner.forward(fb)
        finally:
            state.fence.signal()  # NOTE: even on failure, or the scheduler would wait on read_done forever
        next_ids = self.model_runner.sample(logits, job.sampling_info)
        state.future_map.stash(fb.req_pool_indices, next_ids)
        logprobs = self.step_logprobs(job.logprob_top_k, logits, next_ids, job.sampling_info)
        return StepOutput(next_ids, logprobs, fb.input_logprobs)

    # ---- results --------------------------------------------------------------------------------
    def process_launched_batch(self: Scheduler, launched: LaunchedBatch) -> None:
        """Wait for batch k's tokens, then process them for the requests that still own their rows."""
        launched.copy_done.synchronize()
        output: StepOutput = launched.host_output.result()
        counts = launched.job.forward_batch.input_logprob_counts
        result = GenerationBatchResult(output.next_token_ids.tolist(), *host_logprobs(output.logprobs),
                                       host_input_logprobs(output.input_logprobs, counts))
        live, keep = [], []
        for i, (req, row) in enumerate(zip(launched.batch.reqs, launched.rows, strict=True)):
            if req.finished() or req.req_pool_idx != row:
                continue  # NOTE: finished in an earlier result, aborted, or retracted: handled once
            live.append(req)
            keep.append(i)
        self.overlap_counters.processed += 1
        self.overlap_counters.dropped_tokens += len(result.next_token_ids) - len(live)
        view = launched.batch.empty_copy(live)
        view.forward_mode = launched.batch.forward_mode
        advanced = [r for r in live if id(r) in self._advanced_by_next_decode()]
        for req in advanced:
            req.kv_committed_len -= 1  # the normal loop's view: step k+1 has not been counted yet
        try:
            self.process_batch_result(view, result.select(keep))
        finally:
            for req in advanced:
                if req.req_pool_idx is not None:
                    req.kv_committed_len += 1

    def _advanced_by_next_decode(self: Scheduler) -> set[int]:
        """Requests of the decode batch launched after the one being processed (their overrun step)."""
        pending = self.overlap.pending
        if not pending or not pending[0].batch.forward_mode.is_decode():
            return set()
        return {id(r) for r in pending[0].batch.reqs}



def _copy_to_host(forward_done: Future) -> StepOutput:
    output: StepOutput = forward_done.result()
    return StepOutput(*(None if part is None else _host_part(part) for part in output))


def _host_part(part: torch.Tensor | TokenLogprobs) -> torch.Tensor | TokenLogprobs:
    return _to_host(part) if isinstance(part, torch.Tensor) else TokenLogprobs(*map(_to_host, part))


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.device.type == "cpu" else tensor.to("cpu", non_blocking=True)
