"""Shared test setup: double-free detection on for every test; the embedded model, loaded once per module."""

import pytest


@pytest.fixture(autouse=True)
def _debug_alloc(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RADIXSERVE_DEBUG_ALLOC", "1")


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
