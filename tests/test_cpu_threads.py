"""One OpenMP pool per process: building on a short-lived thread, and the overlap loop's scheduler
thread kept serial while the forward stream's thread runs the model (cpu_threads.py)."""

from __future__ import annotations

import threading

import pytest
import torch

from radixserve.model_executor.cpu_threads import build_on_short_lived_thread, limit_openmp_threads


def on_thread(fn):
    box = {}
    thread = threading.Thread(target=lambda: box.setdefault("value", fn()))
    thread.start()
    thread.join()
    return box["value"]


def test_build_runs_on_another_thread_that_is_gone_afterwards():
    seen = {}

    def build(x, y=0):
        seen["thread"] = threading.current_thread()
        return x + y

    assert build_on_short_lived_thread(build, 2, y=3) == 5
    assert seen["thread"] is not threading.current_thread() and not seen["thread"].is_alive()


def test_build_failure_is_raised_on_the_caller():
    def fail():
        raise ValueError("bad checkpoint")

    with pytest.raises(ValueError, match="bad checkpoint"):
        build_on_short_lived_thread(fail)


def test_limit_applies_to_the_calling_thread_only_and_restores():
    if limit_openmp_threads(torch.get_num_threads()) is None:
        pytest.skip("no OpenMP runtime loaded by torch")
    before = torch.get_num_threads()

    def limited():
        previous = limit_openmp_threads(1)
        inside = torch.get_num_threads()
        x = torch.arange(1 << 20, dtype=torch.float32)  # large enough for a parallel region
        total = float(x.sum())
        limit_openmp_threads(previous)
        return previous, inside, total, torch.get_num_threads()

    previous, inside, total, restored = on_thread(limited)
    assert inside == 1 and total == float((1 << 20) * ((1 << 20) - 1) // 2)
    assert previous == restored == before
    assert torch.get_num_threads() == before  # the caller's count never moved


def test_overlap_loop_keeps_its_scheduler_thread_serial_until_closed():
    from tests.test_overlap_scheduler import make_scheduler

    if limit_openmp_threads(torch.get_num_threads()) is None:
        pytest.skip("no OpenMP runtime loaded by torch")

    def overlap_then_close():
        before = torch.get_num_threads()
        sched, _ = make_scheduler()  # NOTE: starts the overlap loop's pipeline on this thread
        during = torch.get_num_threads()
        forward_threads = sched.overlap.streams.forward.launch(torch.get_num_threads).result(timeout=10)
        sched.close_overlap()
        return before, during, forward_threads, torch.get_num_threads()

    before, during, forward_threads, after = on_thread(overlap_then_close)
    assert during == 1
    assert forward_threads == before == after == torch.get_num_threads()
