"""The front end's CPU work (frontend/fair_work.py): a bounded number of threads, turns taken by key, a bounded
queue with a share per key; the keyless routes' rate (entrypoints/coalesce.py TokenBucket); and a long
decode that leaves the GIL free (text_stream.decode_all)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from radixserve.entrypoints.coalesce import TokenBucket
from radixserve.frontend.fair_work import FairWork, FrontendBusy


def _sleeper(order: list[str], name: str, seconds: float = 0.02):
    def job() -> str:
        time.sleep(seconds)
        order.append(name)
        return name
    return job


async def _burst(work: FairWork, key: str, count: int, order: list[str], seconds: float = 0.02) -> list[asyncio.Task]:
    tasks = [asyncio.create_task(work.run(key, _sleeper(order, f"{key}{i}", seconds))) for i in range(count)]
    await asyncio.sleep(0)  # every job is queued before the caller goes on
    return tasks


def test_a_key_waits_behind_one_job_of_another_key_not_its_whole_stack() -> None:
    async def main() -> list[str]:
        work = FairWork(1, 100, "test")
        order: list[str] = []
        a = await _burst(work, "a", 10, order)
        b = await _burst(work, "b", 2, order)
        await asyncio.gather(*a, *b)
        work.shutdown()
        return order

    order = asyncio.run(main())
    # FIFO would run b0 11th; taking turns, it runs right after the job of a's already on the thread
    assert order[:5] == ["a0", "b0", "a1", "b1", "a2"], order
    assert sorted(order) == sorted([f"a{i}" for i in range(10)] + ["b0", "b1"])


def test_at_most_threads_jobs_run_at_once() -> None:
    running, peak = [0], [0]
    lock = threading.Lock()

    def job() -> None:
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.01)
        with lock:
            running[0] -= 1

    async def main() -> None:
        work = FairWork(2, 100, "test")
        await asyncio.gather(*(work.run(k, job) for k in ("a", "b", "c") for _ in range(6)))
        assert work.completed == 18 and work.num_running == 0 and work.num_waiting == 0
        work.shutdown()

    asyncio.run(main())
    assert peak[0] == 2


def test_a_full_queue_refuses_a_key_over_its_share_and_admits_one_under_it() -> None:
    async def main() -> None:
        work = FairWork(1, 4, "test")
        order: list[str] = []
        a = await _burst(work, "a", 5, order, 0.05)  # one runs, four wait: the queue is full
        assert work.num_running == 1 and work.num_waiting == 4
        with pytest.raises(FrontendBusy, match="at most 4 may wait"):
            await work.run("a", _sleeper(order, "a-over"))
        # "b" holds nothing, under its share (4 // 2 keys): admitted
        b = asyncio.create_task(work.run("b", _sleeper(order, "b0")))
        # the rest of a request already admitted is never refused
        late = asyncio.create_task(work.run("a", _sleeper(order, "a-late"), admit=False))
        await asyncio.gather(*a, b, late)
        assert "a-over" not in order and {"b0", "a-late"} <= set(order)
        work.shutdown()

    asyncio.run(main())


def test_a_cancelled_waiting_job_never_runs_and_errors_reach_the_caller() -> None:
    async def main() -> list[str]:
        work = FairWork(1, 10, "test")
        order: list[str] = []
        first = asyncio.create_task(work.run("a", _sleeper(order, "first", 0.05)))
        second = asyncio.create_task(work.run("a", _sleeper(order, "second")))
        await asyncio.sleep(0.01)
        second.cancel()
        await first

        def boom() -> None:
            raise ValueError("bad body")
        with pytest.raises(ValueError, match="bad body"):
            await work.run("a", boom)
        assert work.num_running == 0
        work.shutdown()
        return order

    assert asyncio.run(main()) == ["first"]


def test_the_token_bucket_allows_its_rate_and_burst_then_refuses() -> None:
    now = [0.0]
    bucket = TokenBucket(2.0, clock=lambda: now[0])
    assert [bucket.take() for _ in range(3)] == [True, True, False]
    assert bucket.refused == 1 and bucket.retry_after_s() == 1
    now[0] += 0.5  # one token back
    assert [bucket.take() for _ in range(2)] == [True, False]
    now[0] += 100  # never more than the burst
    assert sum(bucket.take() for _ in range(10)) == 2
    slow = TokenBucket(0.1, clock=lambda: now[0])
    assert slow.take() and not slow.take() and slow.retry_after_s() == 10
    unlimited = TokenBucket(0)
    assert all(unlimited.take() for _ in range(1000))


def test_decode_all_matches_the_tokenizer_s_decode() -> None:
    import random

    from radixserve.client.text_stream import decode_all
    from radixserve.model_loader.gguf_loader import gguf_to_hf_folder
    from radixserve.model_loader.model_folder import load_tokenizer
    from radixserve.models.loader import embedded_model_path

    tokenizer = load_tokenizer(gguf_to_hf_folder(embedded_model_path(), None))  # config and tokenizer only
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(0, 60))]
        assert decode_all(tokenizer, ids) == tokenizer.decode(ids), ids


def test_worker_processes_exit_when_the_http_process_dies_without_shutting_them_down() -> None:
    """A process pool's workers block on their call queue and never see their parent go; a server killed after its
    grace period left them running for good. Each worker now watches its parent and exits when it is gone."""
    import os
    import subprocess
    import sys
    import time

    script = (
        "import asyncio, os\n"
        "from radixserve.frontend.fair_work import FairWork\n"
        "work = FairWork(2, 8, 'test', processes=True)\n"
        "asyncio.run(work.warm('json'))\n"
        "print(' '.join(map(str, work._pool._processes)), flush=True)\n"
        "os._exit(0)  # no shutdown, as a killed server\n")
    # NOTE: not subprocess.run: workers left behind would hold its output pipe open, and run would wait for them
    with subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) as proc:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert proc.wait(120) == 0
    assert len(pids) == 2

    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        # NOTE: an exited child of another parent is reaped by init; a zombie still answers kill(0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"

    deadline = time.monotonic() + 15
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [p for p in pids if alive(p)]
    for p in left:
        os.kill(p, 9)
    assert not left
