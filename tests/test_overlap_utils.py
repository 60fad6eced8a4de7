"""Streams, events and the future-token relay of the overlap loop (radixserve/managers/overlap_utils.py)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from radixserve.managers.overlap_utils import (
    ALREADY_READ,
    NEVER_WRITTEN,
    CpuEvent,
    FutureMap,
    FutureMapError,
    InlineStream,
    OverlapDebug,
    StreamError,
    WorkerStream,
    closing_streams,
    create_device_streams,
)


@pytest.fixture
def stream():
    s = WorkerStream("test")
    yield s
    s.close()


def test_worker_runs_callables_in_launch_order_and_returns_values(stream):
    seen: list[int] = []
    futures = [stream.launch(lambda i=i: (time.sleep(0.001 * (i % 3)), seen.append(i), i * i)[2]) for i in range(50)]
    assert [f.result(timeout=10) for f in futures] == [i * i for i in range(50)]
    assert seen == list(range(50))
    assert stream.stats().tasks == 50


def test_launch_returns_before_the_work_runs(stream):
    gate = threading.Event()
    started = time.perf_counter()
    future = stream.launch(gate.wait)
    assert time.perf_counter() - started < 0.05 and not future.done()
    gate.set()
    assert future.result(timeout=10) is True


def test_event_completes_only_when_the_stream_passes_it(stream):
    gate = threading.Event()
    stream.launch(gate.wait)
    event = stream.record_event()
    assert not event.query()
    gate.set()
    event.synchronize()
    assert event.query()
    assert CpuEvent().query(), "an event never recorded is complete, as with CUDA"


def test_event_recorded_inside_a_callable_marks_that_point(stream):
    holder: dict = {}
    finish = threading.Event()

    def work() -> str:
        holder["read_done"] = stream.record_event()  # recorded from inside: marks this point
        finish.wait(10)
        return "finished"

    future = stream.launch(work)
    while "read_done" not in holder:
        time.sleep(0.001)
    holder["read_done"].synchronize()  # returns although `work` is still running
    assert not future.done()
    finish.set()
    assert future.result(timeout=10) == "finished"


def test_other_stream_waits_on_an_event_but_not_on_later_work():
    producer, consumer = WorkerStream("producer"), WorkerStream("consumer")
    try:
        box = torch.zeros(1)
        gate = threading.Event()
        producer.launch(lambda: (time.sleep(0.05), box.fill_(7)))
        written = producer.record_event()
        producer.launch(gate.wait)  # after the event: the consumer must not wait for this
        consumer.wait_event(written)
        observed = consumer.launch(lambda: float(box.item()))
        assert observed.result(timeout=10) == 7.0
        gate.set()
        producer.synchronize()
    finally:
        producer.close()
        consumer.close()


def test_wait_stream_orders_after_everything_enqueued_so_far():
    first, second = WorkerStream("first"), WorkerStream("second")
    try:
        order: list[str] = []
        first.launch(lambda: (time.sleep(0.05), order.append("first")))
        second.wait_stream(first)
        second.launch(lambda: order.append("second")).result(timeout=10)
        assert order == ["first", "second"]
    finally:
        first.close()
        second.close()


def test_exception_on_the_worker_reaches_the_host_and_poisons_the_stream(stream):
    def boom() -> None:
        raise ValueError("kernel fault")

    failed = stream.launch(boom)
    skipped = stream.launch(lambda: "never runs")
    with pytest.raises(ValueError, match="kernel fault"):
        failed.result(timeout=10)
    with pytest.raises(StreamError) as info:
        skipped.result(timeout=10)
    assert isinstance(info.value.__cause__, ValueError)
    with pytest.raises(StreamError):
        stream.synchronize()
    with pytest.raises(StreamError):
        stream.record_event().synchronize()
    assert isinstance(stream.failed, ValueError)


def test_an_event_a_skipped_callable_would_have_recorded_still_completes(stream):
    before = stream.create_event()  # created before the failure
    stream.launch(lambda: 1 / 0)
    stream.launch(stream.record, before)  # skipped: the stream has failed
    after = stream.create_event()
    with pytest.raises(StreamError):
        before.synchronize()  # returns (with the error) instead of blocking forever
    with pytest.raises(StreamError):
        after.synchronize()


def test_a_stream_waiting_on_a_failed_event_fails_too():
    bad, waiter = WorkerStream("bad"), WorkerStream("waiter")
    try:
        bad.launch(lambda: 1 / 0)
        waiter.wait_event(bad.record_event())
        with pytest.raises(StreamError) as info:
            waiter.launch(lambda: "runs after a failed producer").result(timeout=10)
        assert isinstance(info.value.__cause__, ZeroDivisionError)
    finally:
        bad.close()
        waiter.close()


def test_close_drains_queued_work_then_refuses_more():
    s = WorkerStream("closing")
    done: list[int] = []
    for i in range(5):
        s.launch(lambda i=i: (time.sleep(0.005), done.append(i)))
    s.close()
    assert done == [0, 1, 2, 3, 4]
    assert not s._thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        s.launch(lambda: None)
    s.close()  # idempotent
    s.synchronize()  # nothing pending, nothing failed


def test_inline_stream_runs_at_once_and_blocks_on_wait():
    inline, worker = InlineStream(), WorkerStream("slow")
    try:
        assert inline.launch(lambda: 3).result(timeout=0) == 3
        worker.launch(lambda: time.sleep(0.05))
        started = time.perf_counter()
        inline.wait_event(worker.record_event())
        assert time.perf_counter() - started >= 0.04
    finally:
        worker.close()


def test_cpu_stream_set_shares_the_forward_worker_for_copies():
    with closing_streams(create_device_streams("cpu")) as streams:
        assert isinstance(streams.forward, WorkerStream) and streams.copy is streams.forward
        assert isinstance(streams.schedule, InlineStream)


def test_debug_switches_from_environment(monkeypatch):
    assert OverlapDebug.from_env() == OverlapDebug()
    monkeypatch.setenv("RADIXSERVE_DISABLE_WAR_BARRIER", "1")
    monkeypatch.setenv("RADIXSERVE_FORWARD_READ_DELAY_S", "0.25")
    monkeypatch.setenv("RADIXSERVE_CHECK_FUTURE_MAP", "true")
    assert OverlapDebug.from_env() == OverlapDebug(False, 0.25, True, False)


# ---------------------------------------------------------------- future map


def test_future_map_relays_tokens_per_row():
    fmap = FutureMap(num_rows=5, device="cpu", check=True)
    fmap.stash(torch.tensor([1, 3]), torch.tensor([11, 33]))
    assert fmap.resolve(torch.tensor([3, 1])).tolist() == [33, 11]
    assert fmap.buf[[1, 3]].tolist() == [ALREADY_READ, ALREADY_READ]
    fmap.stash(torch.tensor([1]), torch.tensor([12]))  # the next step overwrites, no read needed
    fmap.stash(torch.tensor([1]), torch.tensor([13]))
    assert fmap.resolve(torch.tensor([1])).tolist() == [13]


@pytest.mark.parametrize(
    "rows, message",
    [([2], "row 2 read before it was written"), ([1], "row 1 read twice"), ([4, 4], "appears twice")],
)
def test_future_map_check_mode_catches_bad_reads(rows, message):
    fmap = FutureMap(num_rows=5, device="cpu", check=True)
    fmap.stash(torch.tensor([1, 4]), torch.tensor([5, 6]))
    fmap.resolve(torch.tensor([1]))
    with pytest.raises(FutureMapError, match=message):
        fmap.resolve(torch.tensor(rows))


def test_future_map_reset_rows_hides_the_previous_occupants_token():
    fmap = FutureMap(num_rows=3, device="cpu")
    fmap.stash(torch.tensor([2]), torch.tensor([99]))
    fmap.reset_rows([2])
    assert fmap.buf[2].item() == NEVER_WRITTEN
    assert fmap.resolve(torch.tensor([2])).tolist() == [NEVER_WRITTEN], "without check mode the read is not asserted"


def test_future_map_error_on_the_forward_stream_reaches_the_host(stream):
    fmap = FutureMap(num_rows=3, device="cpu", check=True)
    stream.launch(fmap.resolve, torch.tensor([1]))
    with pytest.raises(StreamError) as info:
        stream.synchronize()
    assert isinstance(info.value.__cause__, FutureMapError)


# ---------------------------------------------------------------- the barrier is necessary


def _slow_forward_reading_rows(streams, table: torch.Tensor, rows: torch.Tensor, read_done):
    """A forward that copies its rows of a shared table (after the injected delay), marks read_done,
    then would go on computing from its private copy."""

    def forward() -> torch.Tensor:
        snapshot = table[rows].clone()
        streams.forward.record(read_done)
        return snapshot

    return streams.forward.launch(forward)


@pytest.mark.parametrize("barrier", [True, False])
def test_war_barrier_protects_rows_a_slow_forward_still_reads(barrier):
    debug = OverlapDebug(war_barrier=barrier, forward_read_delay_s=0.05)
    with closing_streams(create_device_streams("cpu", debug)) as streams:
        req_to_token = torch.arange(4 * 6, dtype=torch.int32).reshape(4, 6)
        expected = req_to_token[[1, 2]].clone()
        streams.fence_reads_after_writes()
        read_done = streams.forward.create_event()
        pending = _slow_forward_reading_rows(streams, req_to_token, torch.tensor([1, 2]), read_done)
        streams.fence_writes_after_reads(read_done)
        req_to_token[2] = -7  # scheduling the next batch hands row 2 to a new request
        corrupted = not torch.equal(pending.result(timeout=10), expected)
        assert corrupted is (not barrier)
        assert not pending.done() or read_done.query()


@pytest.mark.parametrize("barrier", [True, False])
def test_war_barrier_protects_future_tokens_a_slow_forward_still_reads(barrier):
    debug = OverlapDebug(war_barrier=barrier, forward_read_delay_s=0.05, check_future_map=True)
    with closing_streams(create_device_streams("cpu", debug)) as streams:
        fmap = FutureMap(num_rows=4, device="cpu", check=True)
        rows = torch.tensor([1, 3])
        streams.forward.launch(fmap.stash, rows, torch.tensor([41, 43]))  # forward k samples
        copy_done_k = streams.forward.record_event()
        read_done = streams.forward.create_event()

        def next_forward() -> torch.Tensor:  # forward k+1 reads its input ids, then computes
            input_ids = fmap.resolve(rows)
            streams.forward.record(read_done)
            return input_ids

        next_step = streams.forward.launch(next_forward)
        streams.fence_writes_after_reads(read_done)
        copy_done_k.synchronize()  # the host processes batch k's result: its request on row 3 finished
        fmap.reset_rows([3])  # scheduling batch k+2 hands row 3 to a new request
        if barrier:
            assert next_step.result(timeout=10).tolist() == [41, 43]
        else:
            with pytest.raises(FutureMapError, match="row 3 read before it was written"):
                next_step.result(timeout=10)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_streams_fence_a_long_forward():
    with closing_streams(create_device_streams("cuda")) as streams:
        with streams.schedule.context():
            table = torch.arange(8, device="cuda", dtype=torch.float32)
            big = torch.randn(2048, 2048, device="cuda")
        streams.fence_reads_after_writes()

        read_done = streams.forward.create_event()

        def forward():
            acc = big
            for _ in range(20):  # long enough that the host would overtake it without fences
                acc = acc @ big / 2048
            snapshot = table.clone()
            streams.forward.record(read_done)
            return acc, snapshot

        acc, snapshot = streams.forward.launch(forward).result()
        streams.fence_writes_after_reads(read_done)
        with streams.schedule.context():
            table.fill_(-1)
        streams.copy.wait_stream(streams.forward)
        copy_done = streams.copy.launch(lambda: snapshot.to("cpu", non_blocking=True)).result()
        copied = streams.copy.record_event()
        copied.synchronize()
        assert copy_done.tolist() == list(range(8))
        streams.schedule.synchronize()
        assert table.cpu().eq(-1).all()
        assert torch.isfinite(acc).all()
