"""The disk tier over a real `redis-server` (started here on a free port, in a temp dir; skipped without one):
the backend's protocol, checksums, two clients sharing pages, the server's byte cap, a dead or hung server
turning the tier off with one warning, and the embedded model end to end (engine B loads what engine A stored)."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

redis = pytest.importorskip("redis", reason="the redis client is not installed (pip install -e '.[test]')")
if shutil.which("redis-server") is None:
    pytest.skip("redis-server is not on PATH (Debian: apt-get install redis-server)", allow_module_level=True)

from radixserve.mem_cache.storage.page_format import HEADER_BYTES  # noqa: E402
from radixserve.mem_cache.storage.redis_backend import (  # noqa: E402
    DEFAULT_PREFIX,
    RedisStorageBackend,
    check_redis_url,
)
from radixserve.server_args import ServerArgs  # noqa: E402

PAGE = bytes(range(256)) * 800  # 200 KiB
LOGGER = "radixserve.mem_cache.storage.redis_backend"
GREEDY = {"max_new_tokens": 12, "temperature": 0.0}
PROMPT_IDS = [(i * 7919) % 40000 + 100 for i in range(600)]  # ~600 tokens, no repeats within a page


class RedisServer:
    """One `redis-server` child on 127.0.0.1:`port`, persistence off, its files in `folder`."""

    def __init__(self, folder: Path, *options: str, port: int = 0) -> None:
        self.port = port
        with socket.socket() as s:
            if not port:
                s.bind(("127.0.0.1", 0))
                self.port = s.getsockname()[1]
        folder.mkdir(parents=True, exist_ok=True)
        self.log = open(folder / "redis.log", "wb")
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(folder), "--save", "",
             "--appendonly", "no", "--daemonize", "no", *options], stdout=self.log, stderr=subprocess.STDOUT)
        self.url = f"redis://127.0.0.1:{self.port}/0"
        client = redis.Redis.from_url(self.url, socket_timeout=1)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server did not start: {(folder / 'redis.log').read_text()}") from None
                time.sleep(0.05)
        client.close()

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=2)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)  # NOTE: a test may have stopped it
            self.kill()
        self.log.close()


@pytest.fixture
def server(tmp_path):
    srv = RedisServer(tmp_path / "redis", "--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru")
    yield srv
    srv.stop()


class Warnings(logging.Handler):
    """The backend logger's WARNING records while installed."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def __enter__(self) -> Warnings:
        logging.getLogger(LOGGER).addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger(LOGGER).removeHandler(self)

    def turned_off(self) -> int:
        return sum("turned off" in r.getMessage() for r in self.records)


# ---- the backend ----------------------------------------------------------------------------------------------
def test_get_set_exists_delete_and_usage(server):
    store = RedisStorageBackend(server.url)
    assert store.enabled and store.capacity_bytes == 64 << 20 and store.eviction_policy == "allkeys-lru"
    before = store.usage()
    assert not store.exists("a1") and store.get("a1") is None and store.stats.misses == 1
    assert store.set("a1", PAGE) and store.exists("a1")
    assert store.get("a1") == PAGE and store.stats.hits == 1 and store.stats.bytes_read == len(PAGE)
    assert store.stats.pages_written == 1 and store.stats.bytes_written == len(PAGE)
    assert store.usage() >= before + len(PAGE)  # NOTE: the server's used_memory, what maxmemory caps
    raw = server.client().get(DEFAULT_PREFIX + "a1")  # NOTE: the file backend's page format, prefixed key
    assert len(raw) == HEADER_BYTES + len(PAGE) and raw[:8] == b"RSKVPG02"
    assert store.set("a1", PAGE[::-1]) and store.get("a1") == PAGE[::-1]  # replaced
    holding = store.usage()
    store.delete("a1")
    assert not store.exists("a1") and store.usage() < holding - len(PAGE) // 2  # NOTE: allocator granularity
    with pytest.raises(ValueError, match="storage key"):
        store.exists("../etc")
    other = RedisStorageBackend(server.url, prefix="tenant-b:")
    assert other.set("a1", b"x") and not store.exists("a1")  # NOTE: another prefix is another store
    store.close()


def test_a_corrupt_value_is_detected_counted_and_deleted(server):
    store, raw = RedisStorageBackend(server.url), server.client()
    assert store.set("c1", PAGE) and store.set("c2", PAGE)
    flipped = bytearray(raw.get(DEFAULT_PREFIX + "c1"))
    flipped[HEADER_BYTES + 1234] ^= 0x01
    raw.set(DEFAULT_PREFIX + "c1", bytes(flipped))
    raw.set(DEFAULT_PREFIX + "c2", b"not a page")  # NOTE: another program wrote under our prefix
    with Warnings() as seen:
        assert store.get("c1") is None and store.get("c2") is None
    assert store.stats.corrupt == 2 and store.stats.misses == 2 and store.stats.hits == 0
    assert sum("failed its checksum" in r.getMessage() for r in seen.records) == 2
    assert raw.exists(DEFAULT_PREFIX + "c1") == 0 and raw.exists(DEFAULT_PREFIX + "c2") == 0
    assert store.enabled  # NOTE: a bad page is a miss, not a failing store


def test_two_backends_share_pages(server):
    """Two clients (two serving processes, or two machines) over one server see each other's pages."""
    writer, reader = RedisStorageBackend(server.url), RedisStorageBackend(server.url)
    for i in range(5):
        assert writer.set(f"p{i}", bytes([i]) * 50_000)
    assert all(reader.exists(f"p{i}") for i in range(5))
    assert [reader.get(f"p{i}") for i in range(5)] == [bytes([i]) * 50_000 for i in range(5)]
    reader.delete("p0")
    assert not writer.exists("p0") and writer.get("p0") is None
    assert reader.stats.hits == 5 and writer.stats.misses == 1


def test_the_servers_maxmemory_caps_the_store(tmp_path):
    """The cap is the server's (maxmemory + allkeys-lru): writing three times the cap keeps usage under it, the
    oldest pages are gone and the newest are there; a page larger than the cap is not sent."""
    srv = RedisServer(tmp_path / "redis", "--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru")
    try:
        store = RedisStorageBackend(srv.url)
        assert store.capacity_bytes == 4 << 20
        for i in range(60):
            assert store.set(f"k{i}", bytes([i]) * 200_000)
        # NOTE: Redis evicts before each command, so one value may sit over the cap until the next command; its
        # LRU clock ticks once a second, so which same-second pages went is not asserted
        assert store.usage() <= (4 << 20) + 200_000
        kept = [i for i in range(60) if store.exists(f"k{i}")]
        assert 5 <= len(kept) and len(kept) * 200_000 <= 4 << 20, kept
        assert all(store.get(f"k{i}") == bytes([i]) * 200_000 for i in kept) and store.stats.corrupt == 0
        assert not store.set("huge", b"x" * (5 << 20)) and not store.exists("huge") and store.enabled
    finally:
        srv.stop()


def test_a_server_without_a_cap_is_used_with_one_warning(tmp_path):
    srv = RedisServer(tmp_path / "redis")  # NOTE: redis-server's defaults: maxmemory 0, noeviction
    try:
        with Warnings() as seen:
            store = RedisStorageBackend(srv.url)
        assert store.enabled and store.capacity_bytes == 0
        assert len(seen.records) == 1 and "no byte cap" in seen.records[0].getMessage()
        assert store.set("u1", PAGE) and store.get("u1") == PAGE
    finally:
        srv.stop()


def test_a_killed_server_turns_the_store_off_with_one_warning(server):
    store = RedisStorageBackend(server.url)
    assert store.set("k1", PAGE)
    server.kill()
    with Warnings() as seen:
        started = time.monotonic()
        assert store.get("k1") is None and not store.enabled
        assert not store.exists("k1") and not store.set("k2", PAGE) and store.usage() == 0
        store.delete("k1")
        assert time.monotonic() - started < 2.0
    assert seen.turned_off() == 1 and len(seen.records) == 1
    assert server.url.split("//")[1] in seen.records[0].getMessage()


def test_a_server_that_comes_back_is_used_again(server, tmp_path):
    """Off when the server dies; tried again at most every `reconnect_s` (no try before it is due); once a server
    listens there again, the next use finds it, says so once, and pages are written and read again."""
    store = RedisStorageBackend(server.url, reconnect_s=0.3)
    assert store.set("r1", PAGE)
    server.kill()
    with Warnings() as seen:
        assert store.get("r1") is None and not store.enabled
        time.sleep(0.35)
        assert not store.enabled  # NOTE: due, tried, nobody there: off for another interval
        back = RedisServer(tmp_path / "again", "--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru",
                           port=server.port)
        try:
            assert not store.enabled  # NOTE: the last try was under 0.3 s ago: not yet tried again
            time.sleep(0.35)
            assert store.enabled and store.reconnects == 1
            assert store.get("r1") is None  # NOTE: a fresh server: the old page is gone, a miss
            assert store.set("r2", PAGE) and store.get("r2") == PAGE
            assert back.client().exists(store.prefix + "r2") == 1
        finally:
            back.stop()
    messages = [r.getMessage() for r in seen.records]
    assert seen.turned_off() == 1 and sum("is back" in m for m in messages) == 1, messages


def test_a_hung_server_costs_one_socket_timeout_then_the_store_is_off(server):
    store = RedisStorageBackend(server.url, socket_timeout=0.3)
    assert store.set("h1", PAGE)
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        with Warnings() as seen:
            started = time.monotonic()
            assert store.get("h1") is None
            first = time.monotonic() - started
            assert not store.exists("h1") and store.get("h1") is None
            total = time.monotonic() - started
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    assert 0.2 < first < 1.5 and total - first < 0.2, (first, total)  # NOTE: no retries, then no more calls
    assert not store.enabled and seen.turned_off() == 1


def test_an_unreachable_server_at_open_leaves_the_store_off(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # NOTE: closed again: nothing listens there
    with Warnings() as seen:
        store = RedisStorageBackend(f"redis://user:secret@127.0.0.1:{port}/0")
    assert not store.enabled and seen.turned_off() == 1
    assert "secret" not in seen.records[0].getMessage() and store.location == f"redis://127.0.0.1:{port}/0"
    assert store.get("x1") is None and not store.set("x1", PAGE)


def test_server_args_accept_redis_and_name_the_url_field():
    args = ServerArgs(enable_hierarchical_cache=True, hicache_storage_backend="redis",
                      hicache_storage_url="redis://127.0.0.1:6379/0")
    assert args.hicache_storage_backend == "redis"
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    cli = ServerArgs.from_cli_args(parser.parse_args(["--enable-hierarchical-cache", "--hicache-storage-backend",
                                                      "redis", "--hicache-storage-url", "rediss://h:6380/1"]))
    assert cli.hicache_storage_backend == "redis" and cli.hicache_storage_url == "rediss://h:6380/1"
    with pytest.raises(ValueError, match="hicache_storage_url"):
        ServerArgs(hicache_storage_backend="redis")
    for bad in ("http://127.0.0.1:6379", "redis://", "redis://host:port/0", "redis://host:6379/zero", "unix://"):
        with pytest.raises(ValueError, match="hicache_storage_url"):
            check_redis_url(bad)
    with pytest.raises(ValueError) as info:
        check_redis_url("redis://:hunter2@host:99999/0")
    assert "hicache_storage_url" in str(info.value) and "hunter2" not in str(info.value)
    for good in ("redis://127.0.0.1:6379/0", "rediss://cache.internal:6380", "unix:///run/redis.sock"):
        check_redis_url(good)


# ---- the embedded model end to end ----------------------------------------------------------------------------
def test_engine_b_loads_what_engine_a_stored_and_survives_redis_dying(loaded, server):
    """Engine A computes a 600-token prompt and stores its pages in Redis; a fresh engine B over the same server
    loads them: identical greedy tokens, cached tokens covering every whole page of the prompt. Then Redis is
    killed: B's next requests turn the tier off with one warning and still generate."""
    from test_model_support import assert_engine_conserved

    from radixserve import Engine

    args = dict(loaded_model=loaded, dtype="float32", device="cpu", max_total_tokens=1024, log_level="warning",
                enable_hierarchical_cache=True, hicache_storage_backend="redis", hicache_storage_url=server.url)
    with Engine(**args) as a:
        cold = a.generate(input_ids=PROMPT_IDS, sampling_params=GREEDY)
        assert_engine_conserved(a)
        written = a.scheduler.kv_manager.hicache.stats["pages_written"]
    # NOTE: the finished request's whole pages, its output's included
    assert cold["meta_info"]["cached_tokens"] == 0 and len(PROMPT_IDS) // 32 <= written <= (600 + 12) // 32
    with Engine(**args) as b:
        warm = b.generate(input_ids=PROMPT_IDS, sampling_params=GREEDY)
        tier = b.scheduler.kv_manager.hicache
        assert warm["output_ids"] == cold["output_ids"]
        # NOTE: every whole 32-token page but the last token's: 576 of 600
        assert warm["meta_info"]["cached_tokens"] == tier.stats["loaded_tokens"] == (len(PROMPT_IDS) - 1) // 32 * 32
        assert tier.stats["hits"] == (len(PROMPT_IDS) - 1) // 32 and tier.stats["corrupt"] == 0
        assert_engine_conserved(b)
        server.kill()
        with Warnings() as seen:
            outs = [b.generate(input_ids=[(i * 104729 + n) % 40000 + 100 for i in range(100)], sampling_params=GREEDY)
                    for n in range(2)]
        assert [len(o["output_ids"]) for o in outs] == [GREEDY["max_new_tokens"]] * 2
        assert not tier.backend.enabled and seen.turned_off() == 1 and len(seen.records) == 1
        assert b.get_internal_state()["hicache_loaded_tokens"] == tier.stats["loaded_tokens"]
        assert_engine_conserved(b)
