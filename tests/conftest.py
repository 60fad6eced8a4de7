"""Shared test setup: double-free detection on for every test; the embedded model (and two Engines on it),
loaded once per module."""

import os
import time

import pytest

# NOTE: before the package is imported: every write of a request's field checks its writer (managers/req_owners.py);
# servers the tests start inherit it
os.environ.setdefault("RADIXSERVE_CHECK_REQ_WRITES", "1")


@pytest.fixture(autouse=True)
def _debug_alloc(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RADIXSERVE_DEBUG_ALLOC", "1")


@pytest.fixture(autouse=True)
def _openmp_threads_restored():
    """A test that starts an overlap pipeline on this thread and never closes it leaves the thread serial
    (cpu_threads.py); give the next test the count it had."""
    import torch

    before = torch.get_num_threads()
    yield
    if torch.get_num_threads() != before:
        from radixserve.model_executor.cpu_threads import limit_openmp_threads

        limit_openmp_threads(before)


@pytest.fixture(scope="module")
def loaded():
    """The embedded SmolLM2 in float32 on the CPU, with one intra-op thread while the module runs."""
    import torch

    from radixserve.models.loader import load_model

    # NOTE: one intra-op thread: on a shared 2-core machine, OpenMP threads of several processes
    # spinning at barriers make small forwards ~6x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_model(None, torch.float32, "cpu")
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def engines():
    """Two Engines on the embedded model in float32: (overlap loop, normal loop), one intra-op thread."""
    import torch

    from radixserve import Engine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    made = [Engine(dtype="float32", device="cpu", max_total_tokens=2048, disable_overlap_schedule=not overlap,
                   log_level="warning") for overlap in (True, False)]
    yield made
    for engine in made:
        engine.shutdown()
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _engines_conserved(request):
    """After each test that used `engines`: the conservation identity holds and nothing holds KV."""
    yield
    if "engines" in request.fixturenames:
        from test_model_support import assert_engine_conserved

        for engine in request.getfixturevalue("engines"):
            assert_engine_conserved(engine)


@pytest.fixture(scope="module")
def api_server():
    """The shared `radixserve serve` on the embedded model (server_harness.API_SERVER_ARGS)."""
    from server_harness import API_SERVER_ARGS, shared_server

    return shared_server(*API_SERVER_ARGS)


@pytest.fixture(scope="module")
def api_client(api_server):
    """The openai client on `api_server`."""
    from openai import OpenAI

    return OpenAI(base_url=api_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(autouse=True)
def _api_server_conserved(request):
    """After each test that used `api_server`: nothing in flight, and the KV conservation identity holds."""
    yield
    if "api_server" in request.fixturenames:
        from server_harness import check_idle_conservation

        check_idle_conservation(request.getfixturevalue("api_server"))


def pytest_runtest_teardown(item, nextitem):
    """At the end of each test module: give the heap back to the system, and (RADIXSERVE_TEST_RSS_LOG=path)
    record the process's resident size, so a suite that grows past the machine's memory says where."""
    if nextitem is not None and nextitem.module is item.module:
        return
    import gc

    gc.collect()
    _malloc_trim()
    log = os.environ.get("RADIXSERVE_TEST_RSS_LOG")
    if log:
        from feature_soak import rss_mb

        with open(log, "a") as out:
            out.write(f"{item.module.__name__} {rss_mb():.0f}\n")


def _malloc_trim() -> None:
    # NOTE: torch's CPU tensors below glibc's mmap threshold (which grows to 32 MiB) come from malloc's
    # arenas; freed, they stay in the process until trimmed. Without this the default run's RSS only grows.
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """RADIXSERVE_TEST_DEADLINE (seconds since the epoch), set by .ci/run for its long run: a test that would start
    after it is skipped and says so, so that a CI run ends inside its time limit with what did not run listed."""
    deadline = os.environ.get("RADIXSERVE_TEST_DEADLINE")
    if deadline and time.time() > float(deadline):
        pytest.skip("not run: CI's time budget for the long tests (RADIXSERVE_TEST_DEADLINE) was spent")
