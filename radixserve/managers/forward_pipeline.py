"""The one forward path of both event loops: launch a batch on the device streams, hand its result back.

`ForwardPipeline.launch` enqueues a batch's forward, sampling and copy to the host, and returns a
`LaunchedBatch` at once. The normal loop (lag 0, streams that run inline on the scheduler thread)
processes the batch it has just launched; the overlap loop (lag 1, a forward stream of its own)
processes the previous one while this one computes, so the CPU schedules batch k+1 while the device
runs batch k.

What the lag of one step means, and how it is handled:

* Decode input ids are not known on the host when a step is built under overlap. Each forward
  `stash`es its sampled tokens into the `FutureMap` (one entry per request row) and every decode
  `resolve`s its input ids from it, both on the forward stream: one path for both loops.
* A request that finishes in batch k is still in batch k+1 (the "overrun" step): its result there is
  dropped, so it is finished, counted and released once. Its handle's `kv_committed_len` counts
  only what processed results computed (batch k), while `kv_allocated_len` already counts the slot
  of k+1: so the tree receives the same `seqlen - 1` tokens as in the normal loop, and the overrun
  slot is freed as over-allocation. The overrun forward still writes that slot; a later owner only
  writes it in a later forward, on the same stream.
* A request retracted or aborted while its batch was in flight no longer owns the row it ran with
  (its handle names another row, or none); its in-flight token is dropped.
* Write-after-read: each forward records `read_done` (a parameter of `ModelRunner.forward`) once it
  has read the shared buffers (`req_to_token` rows, future tokens). Under overlap the scheduler's
  next writes wait for it (`DeviceStreams.fence_writes_after_reads`).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from radixserve.layers.sampler import TokenLogprobs
from radixserve.managers.overlap_utils import DeviceStreams, Event, FutureMap, OverlapDebug

if TYPE_CHECKING:
    from concurrent.futures import Future

    from radixserve.forward_batch import ForwardBatch
    from radixserve.managers.schedule_batch import ScheduleBatch
    from radixserve.managers.scheduler_runner import SchedulerRunner


class StepOutput(NamedTuple):
    """What one forward hands to the host: the sampled ids, and logprobs when some request asked."""

    next_token_ids: torch.Tensor
    logprobs: TokenLogprobs | None
    input_logprobs: TokenLogprobs | None = None  # rows per request: forward_batch.input_logprob_counts
    forward_s: float = 0.0  # the forward and sampling, timed on the forward stream (host clock)
    pooled: torch.Tensor | None = None  # embedding requests' pooled hidden states (ForwardBatch.pooled_hidden)


@dataclass
class LaunchedBatch:
    batch: ScheduleBatch  # a copy: the scheduler may filter or merge the original before this is processed
    rows: list[int]  # each request's row at launch; a request that lost it was retracted or aborted
    seq_lens: list[int]  # each request's tokens with KV once this forward has run
    host_output: Future  # StepOutput of host tensors, complete once copy_done has completed
    copy_done: Event
    read_done: Event
    # NOTE: the forward's inputs and device StepOutput are held until the result is processed: freed
    # earlier, the CUDA caching allocator could hand their memory to the next batch while the forward
    # or copy stream still reads it.
    forward_batch: ForwardBatch
    sampling_info: Any
    device_output: Future
    launched_at: float
    lag: int  # of the pipeline that launched it: 0 when it is processed right after its launch


@dataclass
class PipelineCounters:
    """Kept on the scheduler across loop restarts (tests read them after the loop has closed)."""

    launched: int = 0
    processed: int = 0
    dropped_tokens: int = 0  # results of requests finished, aborted or retracted after their launch
    corrupted_reads: int = 0  # check_reads: forwards that read rows the scheduler had overwritten


class ForwardPipeline:
    """Streams, the future-token relay and the batches in flight of one event loop."""

    def __init__(self, runner: SchedulerRunner, streams: DeviceStreams, lag: int, debug: OverlapDebug,
                 counters: PipelineCounters) -> None:
        self.runner = runner
        self.streams = streams
        self.lag = lag
        self.debug = debug
        self.counters = counters
        self.future_map = FutureMap(runner.req_to_token_pool.size + 1, runner.device, debug.check_future_map)
        self.pending: deque[LaunchedBatch] = deque()

    def launch(self, batch: ScheduleBatch, sampling_info: Any, logprob_top_k: int | None) -> LaunchedBatch:
        """Enqueue `batch`'s forward, sampling and copy to the host; returns at once under overlap."""
        fb = batch.forward_batch
        reqs = list(batch.reqs)
        rows = [r.kv.req_pool_idx for r in reqs]
        if self.future_map.check and not fb.forward_mode.is_decode():
            self.future_map.reset_rows(rows)  # NOTE: these rows may have just changed hands
        streams = self.streams
        read_done = streams.forward.create_event()
        expected = self._rows_of(fb) if self.debug.check_reads else None
        launched_at = time.perf_counter()
        streams.fence_reads_after_writes()
        forward_done = streams.forward.launch(self._forward, fb, sampling_info, logprob_top_k, read_done, expected)
        if streams.copy is not streams.forward:
            streams.copy.wait_stream(streams.forward)
        host_output = streams.copy.launch(_copy_to_host, forward_done)
        copy_done = streams.copy.record_event()
        self.counters.launched += 1
        launched = LaunchedBatch(batch.empty_copy(reqs), rows, list(fb.seq_lens_cpu), host_output, copy_done,
                                 read_done, fb, sampling_info, forward_done, launched_at, self.lag)
        if self.lag:
            # NOTE: every scheduler write from here on (processing batch k, building batch k+2) waits
            # until this forward has read the rows, input ids and future tokens it needs.
            streams.fence_writes_after_reads(read_done)
        return launched

    def _forward(self, fb: ForwardBatch, sampling_info: Any, top_k: int | None, read_done: Event,
                 expected_rows: torch.Tensor | None) -> StepOutput:
        """On the forward stream: resolve decode input ids, forward, sample, stash the sampled ids."""
        runner = self.runner
        started = time.perf_counter()
        try:
            if expected_rows is not None and self._rows_changed(fb, expected_rows):
                self.counters.corrupted_reads += 1
            if fb.forward_mode.is_decode() and fb.verify is None:  # NOTE: a verify step's inputs are all known
                fb.input_ids = self.future_map.resolve(fb.req_pool_indices)
                if fb.host_input_ids is not None:
                    fb.input_ids[fb.host_input_ids[0]] = fb.host_input_ids[1]
            logits = runner.forward(fb, read_done)
        except BaseException:
            read_done.record()  # NOTE: even on failure, or the scheduler would wait on read_done forever
            raise
        next_ids = runner.sample(logits, sampling_info)
        if fb.verify is None:
            self.future_map.stash(fb.req_pool_indices, next_ids)
        else:  # NOTE: one entry per request; the host feeds the next step's inputs after a verify
            last = fb.verify.last_rows(next_ids.device)
            self.future_map.stash(fb.req_pool_indices[last], next_ids[last])
        logprobs = None if top_k is None else runner.logprobs(logits, next_ids, sampling_info, top_k)
        return StepOutput(next_ids, logprobs, fb.input_logprobs, time.perf_counter() - started, fb.pooled_hidden)

    def take_ready(self, launched_now: bool) -> LaunchedBatch | None:
        """The oldest batch in flight once more than the lag are (all of them when nothing was launched)."""
        if len(self.pending) > (self.lag if launched_now else 0):
            return self.pending.popleft()
        return None

    def close(self) -> None:
        self.streams.close()

    # ---- check_reads (debug) --------------------------------------------------------------------
    def _rows_of(self, fb: ForwardBatch) -> torch.Tensor:
        return self.runner.req_to_token_pool.req_to_token[fb.req_pool_indices, : max(fb.seq_lens_cpu)].clone()

    def _rows_changed(self, fb: ForwardBatch, expected: torch.Tensor) -> bool:
        now = self.runner.req_to_token_pool.req_to_token[fb.req_pool_indices, : expected.shape[1]]
        live = torch.arange(expected.shape[1], device=expected.device).unsqueeze(0) < fb.seq_lens.unsqueeze(1)
        return bool(((now != expected) & live).any())


def _copy_to_host(forward_done: Future) -> StepOutput:
    output: StepOutput = forward_done.result()
    return StepOutput(*(part if part is None or isinstance(part, float) else _host_part(part) for part in output))


def _host_part(part: torch.Tensor | TokenLogprobs) -> torch.Tensor | TokenLogprobs:
    return _to_host(part) if isinstance(part, torch.Tensor) else TokenLogprobs(*map(_to_host, part))


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.device.type == "cpu" else tensor.to("cpu", non_blocking=True)
