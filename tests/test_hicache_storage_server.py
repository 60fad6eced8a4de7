"""The disk tier through the HTTP server: the CLI flags, a server restart over the same directory, the OpenAI
usage's cached tokens and the /metrics counters."""

from __future__ import annotations

import pytest
from server_harness import check_idle_conservation, start_server

PROMPT = " ".join(f"item{i}" for i in range(300))  # ~900 tokens


def complete(server) -> dict:
    r = server.post("/v1/completions", json={"model": "SmolLM2-135M-Instruct", "prompt": PROMPT, "max_tokens": 6,
                                              "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.long  # NOTE: minutes on 2 loaded cores; the long run (CI) keeps it
def test_a_server_restart_serves_the_prompt_from_disk(tmp_path):
    args = ("--dtype", "float32", "--max-total-tokens", "2048", "--enable-hierarchical-cache",
            "--hicache-storage-dir", str(tmp_path), "--hicache-storage-size", "1GiB")
    server = start_server(*args)
    try:
        cold = complete(server)
        assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert server.metrics()["radixserve:hicache_bytes_written_total"] > 0
        check_idle_conservation(server)
    finally:
        server.stop()
    server = start_server(*args)
    try:
        warm = complete(server)
        prompt = warm["usage"]["prompt_tokens"]
        cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
        assert cached == (prompt - 1) // 32 * 32 and cached > 0.9 * prompt
        metrics = server.metrics()
        assert metrics["radixserve:hicache_loaded_tokens_total"] == cached
        assert metrics["radixserve:hicache_storage_hits_total"] == cached // 32
        assert metrics["radixserve:hicache_corrupt_pages_total"] == 0
        check_idle_conservation(server)
    finally:
        server.stop()


def test_a_bad_storage_flag_fails_at_start_naming_it(tmp_path):


    with pytest.raises(RuntimeError, match="hicache_storage_size"):
        start_server("--dtype", "float32", "--max-total-tokens", "1024", "--enable-hierarchical-cache",
                     "--hicache-storage-size", "plenty")
