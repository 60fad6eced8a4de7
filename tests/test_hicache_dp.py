"""The disk tier shared by several processes (the workers of `serve --dp N` over one --hicache-storage-dir).

Fast tests (default run): two `FileStorageBackend`s over one directory, as two workers see it (one writes, the
other reads; deletes and the size cap seen across them; a start-up cleanup never removes a live writer's temp file),
and two real processes writing and reading the same pages at once. The long test starts `radixserve serve --dp 2
--enable-hierarchical-cache` over a temp directory: a prompt computed on worker 0 is loaded from disk on worker 1.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import httpx
import pytest
from server_harness import REPO, START_TIMEOUT_S, ServerHandle, assert_conservation, free_port, wait_idle

from radixserve.mem_cache.storage import file_backend
from radixserve.mem_cache.storage.file_backend import HEADER_BYTES, SUFFIX, TMP_PREFIX, FileStorageBackend

PAGE = b"p" * 1000
ONE = HEADER_BYTES + len(PAGE)


def _pages_on_disk(folder: Path) -> set[str]:
    return {p.name[: -len(SUFFIX)] for p in folder.iterdir() if p.name.endswith(SUFFIX)}


def _age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_one_writes_the_other_reads_and_adopts_it(tmp_path):
    a, b = FileStorageBackend(tmp_path, 1 << 20), FileStorageBackend(tmp_path, 1 << 20)
    assert a.set("k", PAGE)
    assert b.usage() == 0  # b opened before the write: its index does not know the page yet
    assert b.exists("k") and b.usage() == ONE  # adopted
    assert b.get("k") == PAGE and b.stats.hits == 1 and b.stats.corrupt == 0


def test_a_page_deleted_by_the_other_is_a_miss_and_leaves_the_index(tmp_path):
    a, b = FileStorageBackend(tmp_path, 1 << 20), FileStorageBackend(tmp_path, 1 << 20)
    a.set("k", PAGE)
    assert b.get("k") == PAGE and b.usage() == ONE
    a.delete("k")
    assert not b.exists("k") and b.usage() == 0
    assert b.get("k") is None and b.stats.misses == 1 and b.stats.corrupt == 0
    # and the page is written again by b (its index no longer claims it)
    assert b.set("k", PAGE) and a.get("k") == PAGE


def test_the_size_cap_holds_for_the_directory_as_a_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(file_backend, "RESCAN_S", 0.0)  # every write rebuilds the index (here: no waiting)
    a, b = FileStorageBackend(tmp_path, 3 * ONE), FileStorageBackend(tmp_path, 3 * ONE)
    a.set("a1", PAGE)
    a.set("a2", PAGE)
    _age(tmp_path / ("a1" + SUFFIX), 30)  # a1 is the least recently used page of the directory
    b.set("b1", PAGE)
    assert _pages_on_disk(tmp_path) == {"a1", "a2", "b1"} and b.usage() == 3 * ONE
    b.set("b2", PAGE)  # over the cap: b evicts a's least recently used page
    assert _pages_on_disk(tmp_path) == {"a2", "b1", "b2"} and b.stats.evicted == 1
    a.set("a3", PAGE)
    assert len(_pages_on_disk(tmp_path)) == 3 and a.usage() == 3 * ONE
    assert a.get("a1") is None  # gone: a miss, never an error


def test_without_a_rescan_the_other_writers_pages_are_counted_before_evicting(tmp_path):
    a = FileStorageBackend(tmp_path, 2 * ONE)
    b = FileStorageBackend(tmp_path, 2 * ONE)
    b.set("b1", PAGE)
    b.set("b2", PAGE)  # b's index is full; a's is empty
    a._scanned_at = 0.0  # NOTE: as if a's last rebuild was long ago
    a.set("a1", PAGE)  # a rebuilds (RESCAN_S), sees b's two pages and evicts one to stay under the cap
    assert len(_pages_on_disk(tmp_path)) == 2 and "a1" in _pages_on_disk(tmp_path)
    assert _pages_on_disk(tmp_path) == {"b2", "a1"}  # b1 was the least recently used
    assert not b.exists("b1") and b.exists("b2") and b.usage() == ONE  # b's index follows the directory


def test_start_up_cleanup_keeps_a_live_writers_temp_file(tmp_path):
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        FileStorageBackend(tmp_path, 1 << 20)
        in_progress = tmp_path / f"{TMP_PREFIX}page-a_b-{live.pid}-0a1b2c3d"  # keys may hold - and _
        in_progress.write_bytes(b"RSKVPG01")
        _age(in_progress, 300)  # a slow writer: older than DEAD_WRITER_TMP_S, younger than STALE_TMP_S
        mine = tmp_path / f"{TMP_PREFIX}k-{os.getpid()}-00ff00ff"
        mine.write_bytes(b"RSKVPG01")
        crashed_old = tmp_path / f"{TMP_PREFIX}k-{dead.pid}-deadbeef"
        crashed_old.write_bytes(b"RSKVPG01")
        _age(crashed_old, 120)
        crashed_new = tmp_path / f"{TMP_PREFIX}k2-{dead.pid}-deadbeef"
        crashed_new.write_bytes(b"RSKVPG01")  # just written: left for a later start (another host's pid?)
        ancient = tmp_path / f"{TMP_PREFIX}k3-{live.pid}-cafef00d"
        ancient.write_bytes(b"RSKVPG01")
        _age(ancient, 3600)
        second = FileStorageBackend(tmp_path, 1 << 20)  # another worker starting over the same directory
        assert in_progress.exists() and mine.exists() and crashed_new.exists()
        assert not crashed_old.exists() and not ancient.exists()
        assert second.usage() == 0  # temp files never count as pages
    finally:
        live.kill()
        live.wait()


_HAMMER = textwrap.dedent("""
    import sys
    from radixserve.mem_cache.storage import file_backend
    from radixserve.mem_cache.storage.file_backend import FileStorageBackend, HEADER_BYTES
    file_backend.RESCAN_S = 0.0  # every write counts the other process's pages first
    folder, seed = sys.argv[1], int(sys.argv[2])
    store = FileStorageBackend(folder, 8 * (HEADER_BYTES + 4096))
    payload = lambda k: bytes([k]) * 4096
    found = 0
    for i in range(150):
        k = (i * 7 + seed) % 16
        if i % 2:
            assert store.set(f"key{k}", payload(k))
        else:
            got = store.get(f"key{k}")
            assert got is None or got == payload(k), (k, got[:8])
            found += got is not None
    assert store.stats.corrupt == 0 and store.enabled, store.stats
    print("ok", found)
""")


def test_two_processes_write_and_read_the_same_pages_at_once(tmp_path):
    """Two processes over one directory, writing and reading 16 keys under an 8-page cap: every read is the
    page written or a miss, never a corrupt page or an error; the cap holds for the directory."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    procs = [subprocess.Popen([sys.executable, "-c", _HAMMER, str(tmp_path), str(seed)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for seed in (0, 3)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0 and out.startswith("ok"), err[-2000:]
    # NOTE: each writer counts the directory before its write, so only the two last writes can race past the cap
    assert len(_pages_on_disk(tmp_path)) <= 8 + 1
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(TMP_PREFIX)]


def test_the_launcher_gives_every_worker_one_absolute_storage_directory(tmp_path, monkeypatch):
    from radixserve.entrypoints.dp_launcher import shared_storage_args
    from radixserve.entrypoints.dp_processes import worker_flags
    from radixserve.server_args import ServerArgs

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    given = shared_storage_args(ServerArgs(enable_hierarchical_cache=True, hicache_storage_dir="rel/dir"))
    default = shared_storage_args(ServerArgs(enable_hierarchical_cache=True))
    assert given.hicache_storage_dir == str(tmp_path / "rel" / "dir")
    assert default.hicache_storage_dir == str(tmp_path / "cache" / "hicache")
    flags = [worker_flags(default, port, 1) for port in (1001, 1002)]
    for f in flags:
        assert f[f.index("--hicache-storage-dir") + 1] == str(tmp_path / "cache" / "hicache")
    assert shared_storage_args(ServerArgs()).hicache_storage_dir is None  # the tier off: nothing changes


# ---- serve --dp 2 over one directory (long) ---------------------------------------------------------------------

MODEL = "SmolLM2-135M-Instruct"
WORKER_URL = re.compile(r"worker (\d+): (http://127\.0\.0\.1:\d+)")
PROMPT = "Inventory ledger. " + " ".join(f"shelf{i} holds {i * 7 % 100} crates;" for i in range(97))


def _start_dp(storage: Path) -> tuple[subprocess.Popen, str, list[ServerHandle]]:
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="radixserve-hicache-dp-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "radixserve.cli", "serve", "--dp", "2", "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "float32", "--max-total-tokens", "2048", "--log-level", "warning",
           "--enable-hierarchical-cache", "--hicache-storage-dir", str(storage), "--hicache-storage-size", "1GiB"]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               RADIXSERVE_DEBUG_ALLOC="1", RADIXSERVE_STRICT_CHECKS="1")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        text = Path(log.name).read_text(errors="replace")
        if proc.poll() is not None:
            raise RuntimeError(f"serve --dp 2 exited with {proc.returncode}:\n{text[-6000:]}")
        try:
            ready = httpx.get(url + "/readiness", timeout=2).json().get("healthy_workers") == 2
        except (httpx.HTTPError, ValueError):
            ready = False
        if ready:
            urls = dict(WORKER_URL.findall(text))  # the launcher logs "worker <rank>: <url>, CPUs ..."
            workers = [ServerHandle(proc, urls[rank], log.name) for rank in ("0", "1")]
            return proc, text, workers
        time.sleep(0.2)
    proc.kill()
    raise TimeoutError(f"serve --dp 2 not ready after {START_TIMEOUT_S} s")


def _complete(worker: ServerHandle) -> dict:
    r = worker.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0},
                    timeout=300.0)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.slow
@pytest.mark.long
def test_a_prompt_computed_on_worker_0_is_loaded_from_disk_on_worker_1(tmp_path):
    pytest.importorskip("sglang_router", reason="SGLang's model gateway is not installed here "
                                                "(pip install 'radixserve[router]', i.e. sglang-router==0.3.2)")
    storage = tmp_path / "shared-hicache"
    proc, log, (w0, w1) = _start_dp(storage)
    try:
        assert f"share one hierarchical cache storage directory: {storage}" in log
        first = _complete(w0)
        prompt = first["usage"]["prompt_tokens"]
        assert 900 <= prompt <= 1500, prompt
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert w0.metrics()["radixserve:hicache_bytes_written_total"] > 0
        second = _complete(w1)
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        # NOTE: whole 32-token storage pages of the cacheable head (never the last token) come from disk
        assert cached == (prompt - 1) // 32 * 32 and cached > 0.95 * prompt, (cached, prompt)
        assert second["choices"][0]["text"] == first["choices"][0]["text"]
        metrics = w1.metrics()
        assert metrics["radixserve:hicache_loaded_tokens_total"] == cached
        assert metrics["radixserve:hicache_corrupt_pages_total"] == 0
        for worker in (w0, w1):
            assert_conservation(wait_idle(worker))
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(40)
            except subprocess.TimeoutExpired:
                proc.kill()
