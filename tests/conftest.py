"""Shared test setup: every test runs with the allocators' double-free detection switched on."""

import pytest


@pytest.fixture(autouse=True)
def _debug_alloc(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RADIXSERVE_DEBUG_ALLOC", "1")
