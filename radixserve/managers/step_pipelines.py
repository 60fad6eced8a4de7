"""The scheduler's forward pipelines: the normal loop's (lag 0) and the overlap loop's (lag 1).

`Pipelines` is a part of `Scheduler` with one job: make, hand out and close the `ForwardPipeline`s
(forward_pipeline.py), their device streams, and the OpenMP thread count the overlap loop changes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from radixserve.managers.forward_pipeline import ForwardPipeline, LaunchedBatch, PipelineCounters
from radixserve.managers.overlap_streams import WorkerStream
from radixserve.managers.overlap_utils import OverlapDebug, create_device_streams
from radixserve.model_executor.cpu_threads import limit_openmp_threads


class Pipelines:
    def __init__(self, model_runner: Any, device: Any, release: Callable[[Any], None] = lambda info: None) -> None:
        self.model_runner = model_runner
        self.release = release  # lets a dropped batch's sampling go on (grammar_manager.GrammarManager.release)
        self.device = device
        self.counters = PipelineCounters()
        self.debug: OverlapDebug | None = None
        self.normal: ForwardPipeline | None = None  # made on first use
        self.overlap: ForwardPipeline | None = None  # from init_overlap until close_overlap
        self._openmp_threads: int | None = None  # the scheduler thread's OpenMP count before the overlap loop

    def normal_pipeline(self) -> ForwardPipeline:
        if self.normal is None:
            self.normal = self._make(lag=0)
        return self.normal

    def init_overlap(self, debug: OverlapDebug | None = None) -> ForwardPipeline:
        """Create the overlap loop's streams and future map (once; `debug` only the first time)."""
        if self.overlap is None:
            self.debug = debug or self.debug
            self.overlap = self._make(lag=1)
            if isinstance(self.overlap.streams.forward, WorkerStream):
                # NOTE: the forward runs on the stream's thread; this thread stays serial (cpu_threads.py)
                self._openmp_threads = limit_openmp_threads(1)
        return self.overlap

    def _make(self, lag: int) -> ForwardPipeline:
        self.debug = self.debug or OverlapDebug.from_env()
        streams = create_device_streams(self.device, self.debug, inline=lag == 0)
        return ForwardPipeline(self.model_runner, streams, lag, self.debug, self.counters)

    def close_overlap(self, process: Callable[[LaunchedBatch], None], drain: bool = True) -> None:
        """`process` what is in flight (unless `drain` is False: after a failure), stop the stream threads."""
        pipeline = self.overlap
        if pipeline is None:
            return
        try:
            with pipeline.streams.schedule.context():
                while drain and pipeline.pending:
                    process(pipeline.pending.popleft())
        finally:
            for launched in pipeline.pending:
                self.release(launched.sampling_info)
            pipeline.close()
            self.overlap = None
            if self._openmp_threads is not None:
                limit_openmp_threads(self._openmp_threads)
                self._openmp_threads = None

    def drop_in_flight(self) -> tuple[list[Any], bool]:
        """After a failure: wait for launched batches and drop them. Returns their requests, and whether
        the overlap pipeline was dropped (rebuilt on the next step; its running requests are lost too)."""
        reqs: list[Any] = []
        dropped_overlap = False
        for name in ("overlap", "normal"):
            pipeline = getattr(self, name)
            if pipeline is None or not (pipeline.pending or _stream_failed(pipeline)):
                continue  # NOTE: nothing launched and no failed work: its streams and future map are sound
            for launched in pipeline.pending:
                reqs.extend(launched.batch.reqs)
                self.release(launched.sampling_info)
                try:
                    launched.copy_done.synchronize()  # NOTE: no forward may still write KV we are about to free
                except Exception:  # noqa: BLE001 - the failure being contained, seen again
                    pass
            pipeline.pending.clear()
            if name == "overlap":
                self.close_overlap(process=lambda launched: None, drain=False)
                dropped_overlap = True
        return reqs, dropped_overlap


def _stream_failed(pipeline: ForwardPipeline) -> bool:
    """A CPU worker stream whose work raised skips everything after it: the pipeline must be rebuilt,
    even when the failed batch was the last one in flight (already taken off `pending`)."""
    streams = pipeline.streams
    return any(getattr(s, "failed", None) is not None for s in (streams.forward, streams.copy))
