"""glibc keeps large freed blocks (model_executor/cpu_memory.py): a prefill of the embedded model that
repeats a batch shape faults no pages in once warm, and the switch leaves malloc alone."""

from __future__ import annotations

import resource
import sys

import pytest
import torch

from radixserve.model_executor import cpu_memory
from radixserve.model_executor.direct_driver import DirectDriver
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.server_args import ServerArgs

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def test_warm_prefill_faults_no_pages_in():
    """4 x 500 tokens: ~53,000 minor faults per forward without the thresholds (measured), none with them."""
    runner = ModelRunner(ServerArgs(dtype="float32", device="cpu", max_total_tokens=4096))
    assert runner.malloc_tuned and runner.platform_info()["malloc_tuned"]
    driver = DirectDriver(runner)
    faults = []
    for _ in range(3):
        reqs = [driver.new_request() for _ in range(4)]
        before = _faults()
        with torch.inference_mode():
            driver.extend(reqs, [[100 + (7 * j + i) % 5000 for j in range(500)] for i in range(4)])
        faults.append(_faults() - before)
        driver.release_all()
    assert max(faults[1:]) < 500, faults  # NOTE: the first forward maps the heap in once


def test_switch_off(monkeypatch):
    monkeypatch.setenv("RADIXSERVE_CPU_MALLOC_TUNING", "0")
    cpu_memory.keep_freed_memory.cache_clear()
    try:
        assert cpu_memory.keep_freed_memory() is False
    finally:
        cpu_memory.keep_freed_memory.cache_clear()
