"""How the scheduler steps: the two event loops, their forward pipelines, and the one forward path.

A mixin of `Scheduler` (as SGLang splits its scheduler): it reads and writes the scheduler's state
directly. Each step: receive messages, pick the next batch, launch it (`run_batch`), then process a
launched batch (`process_batch_result`): the one just launched in the normal loop, the previous one
in the overlap loop (forward_pipeline.py says what the lag of one step changes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from radixserve.managers.forward_pipeline import ForwardPipeline, LaunchedBatch
from radixserve.managers.overlap_streams import WorkerStream
from radixserve.managers.overlap_utils import OverlapDebug, create_device_streams
from radixserve.managers.scheduler_output_processor import logprob_top_k
from radixserve.model_executor.cpu_threads import limit_openmp_threads

if TYPE_CHECKING:
    from radixserve.managers.schedule_batch import ScheduleBatch
    from radixserve.managers.scheduler import Scheduler


class SchedulerLoopMixin:
    # ---- loops ----------------------------------------------------------------------------------
    def event_loop_normal(self: Scheduler) -> None:
        """Run steps until `stop_event` is set; each processes the batch it has just launched."""
        while not self.stop_event.is_set():
            self.run_step_contained(self.run_step)  # NOTE: a failing step aborts its requests (scheduler_failures.py)

    def event_loop_overlap(self: Scheduler) -> None:
        """Run steps until `stop_event` is set; each processes the previous batch while this one runs."""
        try:
            while not self.stop_event.is_set():
                # NOTE: a failing step aborts its requests and drops the overlap pipeline
                # (scheduler_failures.py); the next step builds a new one.
                self.run_step_contained(self.run_step_overlap)
        except BaseException:
            self.close_overlap(drain=False)
            raise
        self.close_overlap()

    def run_step(self: Scheduler, block_when_idle: bool = True) -> ScheduleBatch | None:
        """One iteration of the normal loop; returns the batch it ran, or None when idle."""
        return self._run_step(self.normal_pipeline(), block_when_idle)

    def run_step_overlap(self: Scheduler, block_when_idle: bool = True) -> ScheduleBatch | None:
        """One iteration of the overlap loop: launch batch k+1, then process batch k."""
        return self._run_step(self.init_overlap(), block_when_idle)

    def _run_step(self: Scheduler, pipeline: ForwardPipeline, block_when_idle: bool) -> ScheduleBatch | None:
        with pipeline.streams.schedule.context():
            idle = self.is_idle() and not pipeline.pending
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

    def run_until_idle(self: Scheduler, max_steps: int = 100_000, on_step: Callable[[], None] | None = None) -> int:
        """Normal steps (without blocking) until nothing is queued or running; returns the steps taken."""
        return self._run_until_idle(self.run_step, self.normal_pipeline(), max_steps, on_step)

    def run_until_idle_overlap(self: Scheduler, max_steps: int = 100_000,
                               on_step: Callable[[], None] | None = None) -> int:
        """Overlapped steps (without blocking) until nothing is queued, running or in flight."""
        return self._run_until_idle(self.run_step_overlap, self.init_overlap(), max_steps, on_step)

    def _run_until_idle(self: Scheduler, step: Callable[..., Any], pipeline: ForwardPipeline, max_steps: int,
                        on_step: Callable[[], None] | None) -> int:
        for n in range(max_steps):
            if self.is_idle() and not pipeline.pending and self.input_queue.empty():
                return n
            step(block_when_idle=False)
            if on_step is not None:
                on_step()
        raise RuntimeError(f"not idle after {max_steps} steps")

    # ---- pipelines ------------------------------------------------------------------------------
    def normal_pipeline(self: Scheduler) -> ForwardPipeline:
        if self._normal_pipeline is None:
            self._normal_pipeline = self._make_pipeline(lag=0)
        return self._normal_pipeline

    def init_overlap(self: Scheduler, debug: OverlapDebug | None = None) -> ForwardPipeline:
        """Create the overlap loop's streams and future map (once; `debug` only the first time)."""
        if self.overlap is None:
            self.overlap_debug = debug or self.overlap_debug
            self.overlap = self._make_pipeline(lag=1)
            if isinstance(self.overlap.streams.forward, WorkerStream):
                # NOTE: the forward runs on the stream's thread; this thread stays serial (cpu_threads.py)
                self._openmp_threads = limit_openmp_threads(1)
        return self.overlap

    def _make_pipeline(self: Scheduler, lag: int) -> ForwardPipeline:
        self.overlap_debug = self.overlap_debug or OverlapDebug.from_env()
        streams = create_device_streams(self.device, self.overlap_debug, inline=lag == 0)
        return ForwardPipeline(self.model_runner, streams, lag, self.overlap_debug, self.pipeline_counters)

    def close_overlap(self: Scheduler, drain: bool = True) -> None:
        """Process what is in flight (unless `drain` is False: after a failure), stop the stream threads."""
        pipeline = self.overlap
        if pipeline is None:
            return
        try:
            with pipeline.streams.schedule.context():
                while drain and pipeline.pending:
                    self.process_batch_result(pipeline.pending.popleft())
        finally:
            pipeline.close()
            self.overlap = None
            if self._openmp_threads is not None:
                limit_openmp_threads(self._openmp_threads)
                self._openmp_threads = None

    def run_batch(self: Scheduler, batch: ScheduleBatch, pipeline: ForwardPipeline | None = None) -> LaunchedBatch:
        """The one forward path of both loops: launch `batch`'s forward, sampling and copy to the host."""
        reqs = batch.reqs
        # NOTE: the output index of the token this step samples; under overlap the host's output_ids lag
        # one step, the allocated length does not (0 for a non-final chunk, whose token is dropped).
        output_lens = [max(r.kv.kv_allocated_len - len(r.origin_input_ids), 0) for r in reqs]
        info = self.sampling_info(reqs, output_lens, batch.forward_mode.is_extend())
        return (pipeline or self.normal_pipeline()).launch(batch, info, logprob_top_k(reqs))
