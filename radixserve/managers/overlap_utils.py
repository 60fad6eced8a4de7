"""The overlap loop's device-side helpers: the stream set, the future-token relay, debug switches.

Streams and events (`Stream`, `Event`; CUDA and CPU implementations) live in `overlap_streams` and
are re-exported here. `FutureMap` relays sampled tokens from one forward to the next on the device;
`OverlapDebug` holds the switches that tests use to show each fence is necessary.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from radixserve import envs
from radixserve.managers.overlap_streams import (
    CpuEvent,
    CudaEvent,
    CudaStream,
    Event,
    InlineStream,
    Stream,
    StreamError,
    StreamStats,
    WorkerStream,
)

__all__ = ["ALREADY_READ", "NEVER_WRITTEN", "CpuEvent", "CudaEvent", "CudaStream", "DeviceStreams", "Event",
           "FutureMap", "FutureMapError", "InlineStream", "OverlapDebug", "Stream", "StreamError", "StreamStats",
           "WorkerStream", "closing_streams", "create_device_streams"]

NEVER_WRITTEN = -1  # a future-token entry no forward has stashed since its row changed hands
ALREADY_READ = -2  # check mode: an entry a forward has consumed


class FutureMapError(RuntimeError):
    """A future-token entry was read before it was written, or read twice (check mode)."""


@dataclass(frozen=True)
class OverlapDebug:
    """Debug switches of the overlap loop. Defaults are the production setting.

    `war_barrier=False` removes the write-after-read barrier; `forward_read_delay_s` makes the CPU
    forward stream sleep before each task, so a forward reads shared buffers late; `check_future_map`
    poisons the future-token buffer and asserts each entry is written before it is read, and read
    once; `check_reads` compares the `req_to_token` rows a forward read with what the scheduler wrote
    for it, and counts mismatches (corrupted reads).
    """

    war_barrier: bool = True
    forward_read_delay_s: float = 0.0
    check_future_map: bool = False
    check_reads: bool = False

    @classmethod
    def from_env(cls) -> OverlapDebug:
        return cls(
            war_barrier=not envs.DISABLE_WAR_BARRIER.get(),
            forward_read_delay_s=envs.FORWARD_READ_DELAY_S.get(),
            check_future_map=envs.CHECK_FUTURE_MAP.get(),
            check_reads=envs.CHECK_READS.get(),
        )


# ---------------------------------------------------------------- the set the scheduler uses


@dataclass
class DeviceStreams:
    """forward: every forward and the future-token relay; schedule: scheduler-side writes of shared
    buffers; copy: device-to-host copies of results (on the CPU, the forward stream itself)."""

    forward: Stream
    schedule: Stream
    copy: Stream
    debug: OverlapDebug

    def fence_reads_after_writes(self) -> None:
        """RAW: forwards launched from now on see every scheduler write enqueued so far."""
        self.forward.wait_stream(self.schedule)

    def fence_writes_after_reads(self, read_done: Event) -> None:
        """WAR barrier: scheduler writes from now on wait until the forward has read shared buffers."""
        # NOTE: on the CPU this blocks the scheduler thread until `read_done`, which each forward
        # records right after it has copied its shared reads; removing it is a debug-only switch.
        if self.debug.war_barrier:
            self.schedule.wait_event(read_done)

    def close(self) -> None:
        for stream in {id(s): s for s in (self.forward, self.schedule, self.copy)}.values():
            stream.close()


def create_device_streams(device: torch.device | str, debug: OverlapDebug | None = None,
                          inline: bool = False) -> DeviceStreams:
    """CUDA: three CUDA streams. CPU: a worker-thread forward stream, or with `inline` (the normal loop,
    which waits for each result at once) the scheduler thread itself."""
    debug = debug or OverlapDebug()
    device = torch.device(device)
    if device.type == "cuda":
        schedule = CudaStream("schedule", device)
        return DeviceStreams(CudaStream("forward", device), schedule, CudaStream("copy", device), debug)
    forward = InlineStream("forward") if inline else WorkerStream("forward", delay_s=debug.forward_read_delay_s)
    return DeviceStreams(forward, InlineStream("schedule"), forward, debug)


# ---------------------------------------------------------------- future tokens


class FutureMap:
    """Relays each request's newest sampled token to its next decode step without the host.

    One int64 entry per `ReqToTokenPool` row (row 0 included), so the buffer is sized by the real
    in-flight bound: a row cannot change hands while its request is alive. Forward k `stash`es the
    token it sampled for each row; forward k+1 `resolve`s its decode input ids from the same rows.
    Both run on the forward stream, so stream order makes the read follow the write.

    When a row is handed to a new request the scheduler calls `reset_rows`, so a decode can never read
    the previous occupant's token. That is a scheduler-side write to a buffer in-flight forwards read,
    so it sits behind the write-after-read barrier, like `req_to_token` writes.
    """

    def __init__(self, num_rows: int, device: torch.device | str, check: bool = False) -> None:
        self.check = check
        self.buf = torch.full((num_rows,), NEVER_WRITTEN, dtype=torch.int64, device=device)

    @property
    def num_rows(self) -> int:
        return int(self.buf.shape[0])

    def stash(self, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        """On the forward stream: remember `token_ids[i]` as the next input of row `rows[i]`."""
        self.buf[rows] = token_ids.to(self.buf.dtype)

    def resolve(self, rows: torch.Tensor) -> torch.Tensor:
        """On the forward stream: the stashed token of each row (consumed, in check mode)."""
        ids = self.buf[rows]
        if self.check:
            self._assert_fresh(rows, ids)
            self.buf[rows] = ALREADY_READ
        return ids

    def reset_rows(self, rows: torch.Tensor | list[int]) -> None:
        """On the schedule side, when rows are handed to new requests."""
        self.buf[torch.as_tensor(rows, dtype=torch.int64, device=self.buf.device)] = NEVER_WRITTEN

    def _assert_fresh(self, rows: torch.Tensor, ids: torch.Tensor) -> None:
        # NOTE: check mode syncs with the host (.tolist()); it is meant for tests and CI only.
        problems = []
        for row, value in zip(rows.tolist(), ids.tolist(), strict=True):
            if value == NEVER_WRITTEN:
                problems.append(f"row {row} read before it was written")
            elif value == ALREADY_READ:
                problems.append(f"row {row} read twice")
        if len(set(rows.tolist())) != rows.numel():
            problems.append("a row appears twice in one batch")
        if problems:
            raise FutureMapError("; ".join(problems))


@contextlib.contextmanager
def closing_streams(streams: DeviceStreams) -> Iterator[DeviceStreams]:
    try:
        yield streams
    finally:
        streams.close()
