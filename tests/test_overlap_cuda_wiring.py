"""The overlap loop's CUDA branch (`CudaStream`, `CudaEvent`), driven on a machine without a GPU.

`torch.cuda.Stream`, `torch.cuda.Event` and `torch.cuda.stream` are replaced by fakes that take
exactly the real signatures (each call is bound to the real method's signature), run work at once on
the host, and keep a trace. Tensors stay on the CPU. This cannot show that kernels overlap; it shows
that the CUDA branch runs end to end with the real scheduler and model, and that its fences are
wired as CUDA needs them: on CUDA a wait on an event that was never recorded is a silent no-op, so
the fake refuses it, and each launch must follow the pattern RAW wait -> read_done recorded before
the first layer -> copy stream waits on the forward -> scheduler waits on read_done.
"""

from __future__ import annotations

import inspect
import itertools
from contextlib import contextmanager

import pytest
import torch
from test_overlap_parity import PRESSURE, assert_same_outputs, mixed_requests, run_scheduler

import radixserve.managers.forward_pipeline as forward_pipeline
import radixserve.managers.step_pipelines as step_pipelines
from radixserve.managers.overlap_utils import CudaStream, create_device_streams

pytestmark = pytest.mark.slow

REAL_STREAM, REAL_EVENT, REAL_STREAM_CONTEXT = torch.cuda.Stream, torch.cuda.Event, torch.cuda.stream


class UnfencedWait(AssertionError):
    """A wait or synchronize on an event never recorded: a no-op on CUDA, so no fence at all."""


class FakeCuda:
    """Stand-ins for torch.cuda's stream API with a shared trace and a current stream."""

    def __init__(self) -> None:
        self.trace: list[tuple] = []
        self.current: FakeStream | None = None
        self.ids = itertools.count()
        self.streams: list[FakeStream] = []
        self.device_streams: list = []  # the DeviceStreams the scheduler created

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        cuda = self

        class Stream(FakeStream):
            def __init__(self, *args, **kwargs) -> None:
                inspect.signature(REAL_STREAM.__new__).bind(REAL_STREAM, *args, **kwargs)
                super().__init__(cuda)

        class Event(FakeEvent):
            def __init__(self, *args, **kwargs) -> None:
                inspect.signature(REAL_EVENT.__new__).bind(REAL_EVENT, *args, **kwargs)
                super().__init__(cuda)

        @contextmanager
        def stream(raw, *args, **kwargs):
            inspect.signature(REAL_STREAM_CONTEXT).bind(raw, *args, **kwargs)
            before, cuda.current = cuda.current, raw
            try:
                yield
            finally:
                cuda.current = before

        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "stream", stream)

    def name(self, stream: FakeStream | None) -> str:
        return "default" if stream is None else stream.name


class FakeStream:
    def __init__(self, cuda: FakeCuda) -> None:
        self.cuda = cuda
        self.name = f"s{len(cuda.streams)}"
        cuda.streams.append(self)

    def wait_event(self, *args, **kwargs) -> None:
        event = inspect.signature(REAL_STREAM.wait_event).bind(self, *args, **kwargs).arguments["event"]
        if event.recorded_on is None:
            raise UnfencedWait(f"{self.name} waits on event {event.id}, which was never recorded")
        self.cuda.trace.append(("wait", self.name, event.recorded_on.name, event.id))

    def synchronize(self, *args, **kwargs) -> None:
        inspect.signature(REAL_STREAM.synchronize).bind(self, *args, **kwargs)


class FakeEvent:
    def __init__(self, cuda: FakeCuda) -> None:
        self.cuda = cuda
        self.id = next(cuda.ids)
        self.recorded_on: FakeStream | None = None

    def record(self, *args, **kwargs) -> None:
        stream = inspect.signature(REAL_EVENT.record).bind(self, *args, **kwargs).arguments.get("stream")
        self.recorded_on = stream or self.cuda.current
        if self.recorded_on is None:
            raise AssertionError("an event recorded on the default stream: the overlap loop never uses it")
        self.cuda.trace.append(("record", self.recorded_on.name, self.id))

    def synchronize(self, *args, **kwargs) -> None:
        inspect.signature(REAL_EVENT.synchronize).bind(self, *args, **kwargs)
        if self.recorded_on is None:
            raise UnfencedWait(f"the host synchronizes on event {self.id}, which was never recorded")
        self.cuda.trace.append(("sync", self.id))

    def query(self, *args, **kwargs) -> bool:
        inspect.signature(REAL_EVENT.query).bind(self, *args, **kwargs)
        return self.recorded_on is not None


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    cuda = FakeCuda()
    cuda.install(monkeypatch)
    # NOTE: the scheduler's device stays the CPU; only the overlap loop's streams take the CUDA branch.
    def cuda_streams(device, debug=None, inline=False):
        if inline:
            return create_device_streams(device, debug, inline=True)
        streams = create_device_streams("cuda", debug)
        cuda.device_streams.append(streams)
        return streams

    monkeypatch.setattr(step_pipelines, "create_device_streams", cuda_streams)
    real_copy = forward_pipeline._copy_to_host

    def traced_copy(forward_done):
        cuda.trace.append(("copy", cuda.name(cuda.current)))
        return real_copy(forward_done)

    monkeypatch.setattr(forward_pipeline, "_copy_to_host", traced_copy)
    return cuda


def launches(trace: list[tuple], names: dict[str, str]) -> list[list[str]]:
    """The trace cut at each RAW wait (forward waits on schedule), streams named by their role."""
    steps: list[list[str]] = []
    for entry in trace:
        kind, rest = entry[0], [names.get(x, x) for x in entry[1:] if isinstance(x, str)]
        text = " ".join([kind, *rest])
        if text == "wait forward schedule":
            steps.append([])
        if steps:
            steps[-1].append(text)
    return steps


def test_cuda_branch_runs_the_overlap_loop_with_its_fences_in_order(fake_cuda, loaded):
    work = mixed_requests(32)
    normal, _ = run_scheduler(loaded, work, overlap=False, **PRESSURE)
    def before_first_layer(module, args) -> None:
        fake_cuda.trace.append(("model", fake_cuda.name(fake_cuda.current)))

    handle = loaded.model.register_forward_pre_hook(before_first_layer)
    try:
        overlapped, sched = run_scheduler(loaded, work, overlap=True, **PRESSURE)
    finally:
        handle.remove()
    assert_same_outputs(normal, overlapped, work)

    assert len(fake_cuda.device_streams) == 1 and len(fake_cuda.streams) == 3
    streams = fake_cuda.device_streams[0]
    forward, schedule, copy = streams.forward.raw, streams.schedule.raw, streams.copy.raw
    assert len({forward, schedule, copy}) == 3, "one stream each: forward, schedule, copy"
    names = {forward.name: "forward", schedule.name: "schedule", copy.name: "copy"}
    steps = launches(fake_cuda.trace, names)
    assert len(steps) == sched.pipeline_counters.launched > 0
    expected_head = ["wait forward schedule", "record forward", "model forward", "record forward",
                     "wait copy forward", "copy copy", "record copy", "wait schedule forward"]
    for step in steps:
        assert step[: len(expected_head)] == expected_head, step
        assert "wait forward schedule" not in step[1:]
    # The scheduler's WAR wait is on the very event recorded before the first layer (read_done).
    raw = [e for e in fake_cuda.trace if e[0] in ("record", "wait")]
    read_done = {e[2] for i, e in enumerate(raw) if i > 0 and e[:2] == ("record", forward.name)
                 and raw[i - 1][:3] == ("wait", forward.name, schedule.name)}
    war = {e[3] for e in raw if e[0] == "wait" and e[1] == schedule.name}
    assert war == read_done and len(war) == len(steps)
    synced = {e[1] for e in fake_cuda.trace if e[0] == "sync"}
    copy_done = {e[2] for e in raw if e[0] == "record" and e[1] == copy.name}
    assert copy_done <= synced, "the host reads every result only after its copy_done"


def test_a_wait_on_an_unrecorded_event_is_refused(fake_cuda):
    a, b = CudaStream("a"), CudaStream("b")
    event = a.create_event()
    with pytest.raises(UnfencedWait):
        b.wait_event(event)
    a.record(event)
    b.wait_event(event)
    assert fake_cuda.trace[-1] == ("wait", b.raw.name, a.raw.name, event.raw.id)
