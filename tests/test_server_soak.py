"""The mixed load of issue 55 against the real server (mixed_load.py): 32 streaming chat clients for 45 s, plain
chat, `json_schema` and tool calls, greedy and temperature 0.7, a quarter of them disconnecting mid-stream, with
n-gram speculation on and a /health poller beside them. Before the fixes this load failed scheduler steps
(`IndexError` in `prepare_for_verify`; a terminated grammar asked for a mask), aborted dozens of requests nobody
aborted, and leaked KV. Long: about two minutes on 2 cores."""

from __future__ import annotations

import pytest
from mixed_load import run_mixed_load
from server_harness import check_idle_conservation, start_server

pytestmark = pytest.mark.long


@pytest.mark.parametrize("pool", ["8192", "1536"])  # NOTE: the small pool retracts under this load
def test_mixed_load_with_ngram_speculation_keeps_every_request(pool: str) -> None:
    server = start_server("--dtype", "float32", "--speculative-algorithm", "ngram", "--max-total-tokens", pool)
    try:
        model = server.get("/v1/models").json()["data"][0]["id"]
        report = run_mixed_load(server.base_url, model, clients=32, seconds=45.0, disconnect_share=0.25)
        assert not report.unexpected, report.unexpected[:5]
        assert not report.invalid, report.invalid[:5]
        assert report.total >= 32 and all(report.finished[k] > 0 for k in ("plain", "json_schema", "tools")), report
        assert report.health_failures == 0, report
        state = check_idle_conservation(server)
        assert state["failed_steps"] == 0, state
    finally:
        server.stop()
