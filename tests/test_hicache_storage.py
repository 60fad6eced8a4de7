"""The disk tier's file backend and page keys (radixserve/mem_cache/storage/): no model, no torch work."""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys
import textwrap
import time

import pytest

from radixserve.mem_cache.storage.base import parse_size
from radixserve.mem_cache.storage.file_backend import HEADER_BYTES, SUFFIX, TMP_PREFIX, FileStorageBackend
from radixserve.mem_cache.storage.keys import kv_fingerprint, namespace_bytes, page_keys, weights_identity
from radixserve.server_args import ServerArgs

PAGE = b"x" * 1000


def test_set_get_exists_delete_and_usage(tmp_path):
    store = FileStorageBackend(tmp_path / "s", 1 << 20)
    assert not store.exists("a") and store.get("a") is None and store.stats.misses == 1
    assert store.set("a", PAGE)
    assert store.exists("a") and store.get("a") == PAGE
    assert store.usage() == HEADER_BYTES + len(PAGE)
    assert store.stats.hits == 1 and store.stats.bytes_read == len(PAGE) and store.stats.bytes_written == len(PAGE)
    store.delete("a")
    assert not store.exists("a") and store.usage() == 0
    with pytest.raises(ValueError, match="storage key"):
        store.set("../escape", PAGE)


def test_files_are_owner_only(tmp_path):
    store = FileStorageBackend(tmp_path / "s", 1 << 20)
    store.set("k", PAGE)
    assert stat.S_IMODE(os.stat(tmp_path / "s").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(tmp_path / "s" / ("k" + SUFFIX)).st_mode) == 0o600


def test_a_leftover_temp_file_is_never_read(tmp_path):
    """A crash between the temp write and the rename leaves a partial temp file: no reader sees it as a page."""
    folder = tmp_path / "s"
    store = FileStorageBackend(folder, 1 << 20)
    partial = folder / f"{TMP_PREFIX}k-123-abcd"
    partial.write_bytes(b"RSKVPG01" + b"\0" * 10)  # a header cut short
    assert not store.exists("k") and store.get("k") is None
    reopened = FileStorageBackend(folder, 1 << 20)
    assert not reopened.exists("k") and reopened.usage() == 0
    # an old temp file (a writer that crashed long ago) is removed at open
    os.utime(partial, (time.time() - 3600, time.time() - 3600))
    FileStorageBackend(folder, 1 << 20)
    assert not partial.exists()


def test_a_flipped_byte_is_detected_counted_and_deleted(tmp_path):
    store = FileStorageBackend(tmp_path / "s", 1 << 20)
    store.set("k", PAGE)
    path = tmp_path / "s" / ("k" + SUFFIX)
    data = bytearray(path.read_bytes())
    data[HEADER_BYTES + 500] ^= 0x01
    path.write_bytes(bytes(data))
    assert store.get("k") is None
    assert store.stats.corrupt == 1 and store.stats.misses == 1 and store.stats.hits == 0
    assert not path.exists() and not store.exists("k") and store.usage() == 0


def test_a_truncated_page_is_corrupt(tmp_path):
    store = FileStorageBackend(tmp_path / "s", 1 << 20)
    store.set("k", PAGE)
    path = tmp_path / "s" / ("k" + SUFFIX)
    path.write_bytes(path.read_bytes()[:-1])
    assert store.get("k") is None and store.stats.corrupt == 1


def test_size_cap_evicts_least_recently_used(tmp_path):
    one = HEADER_BYTES + len(PAGE)
    store = FileStorageBackend(tmp_path / "s", 3 * one)
    for key in "abc":
        store.set(key, PAGE)
    assert store.get("a") == PAGE  # a is now the most recently used
    store.set("d", PAGE)
    assert not store.exists("b") and all(store.exists(k) for k in "acd")
    assert store.usage() == 3 * one and store.stats.evicted == 1
    assert not store.set("big", b"x" * (3 * one))  # one page over the cap is refused
    # the order survives a restart: the index is rebuilt from the files' mtimes (touched on read)
    os.utime(tmp_path / "s" / ("c" + SUFFIX), (1, 1))
    reopened = FileStorageBackend(tmp_path / "s", 2 * one)
    assert not reopened.exists("c") and reopened.exists("a") and reopened.exists("d")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_directory_turns_the_tier_off_with_one_warning(tmp_path, caplog):
    folder = tmp_path / "ro"
    folder.mkdir()
    os.chmod(folder, 0o500)
    try:
        with caplog.at_level(logging.WARNING, logger="radixserve.mem_cache.storage.file_backend"):
            store = FileStorageBackend(folder, 1 << 20)
            assert not store.enabled
            assert not store.set("k", PAGE) and store.get("k") is None and not store.exists("k")
            assert not store.set("j", PAGE)
    finally:
        os.chmod(folder, 0o700)
    assert len([r for r in caplog.records if "turned off" in r.message]) == 1


def test_unusable_directory_turns_the_tier_off_with_one_warning(tmp_path, caplog, monkeypatch):
    """A path under a regular file cannot be a directory; a read-only file system refuses the write (EROFS)."""
    (tmp_path / "file").write_bytes(b"")
    with caplog.at_level(logging.WARNING, logger="radixserve.mem_cache.storage.file_backend"):
        store = FileStorageBackend(tmp_path / "file" / "s", 1 << 20)
        assert not store.enabled and not store.set("k", PAGE) and store.get("k") is None
    assert len([r for r in caplog.records if "turned off" in r.message]) == 1
    caplog.clear()
    store = FileStorageBackend(tmp_path / "s", 1 << 20)
    real_open = os.open

    def read_only(path, flags, *args):
        if flags & os.O_CREAT:
            raise OSError(30, "Read-only file system")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", read_only)
    with caplog.at_level(logging.WARNING, logger="radixserve.mem_cache.storage.file_backend"):
        for key in "abc":
            assert not store.set(key, PAGE)
    assert not store.enabled
    assert len([r for r in caplog.records if "turned off" in r.message]) == 1


def test_a_full_disk_turns_the_tier_off_with_one_warning(tmp_path, caplog, monkeypatch):
    store = FileStorageBackend(tmp_path / "s", 1 << 20)
    store.set("before", PAGE)

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with caplog.at_level(logging.WARNING, logger="radixserve.mem_cache.storage.file_backend"):
        assert not store.set("a", PAGE)
        assert not store.set("b", PAGE)
    assert not store.enabled and store.stats.disabled
    assert len([r for r in caplog.records if "turned off" in r.message]) == 1
    assert not any(p.name.startswith(TMP_PREFIX) for p in (tmp_path / "s").iterdir())  # no temp file left


def test_kill_9_during_writes_leaves_only_complete_pages(tmp_path):
    """A writer killed mid-way: every page a new reader finds verifies; no temp file is read as a page."""
    folder = tmp_path / "s"
    script = textwrap.dedent(f"""
        import sys
        from radixserve.mem_cache.storage.file_backend import FileStorageBackend
        store = FileStorageBackend({str(folder)!r}, 1 << 30)
        i = 0
        while True:
            store.set(f"p{{i}}", bytes([i % 251]) * 200_000)
            i += 1
            if i == 3:
                print("ready", flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline().strip() == b"ready"
        time.sleep(0.3)
    finally:
        proc.kill()  # SIGKILL
        proc.wait()
    reader = FileStorageBackend(folder, 1 << 30)
    pages = [p.name[: -len(SUFFIX)] for p in folder.iterdir() if p.name.endswith(SUFFIX)]
    assert len(pages) >= 3
    for key in pages:
        payload = reader.get(key)
        assert payload == bytes([int(key[1:]) % 251]) * 200_000
    assert reader.stats.corrupt == 0


def test_parse_size_and_server_args():
    assert parse_size("2GiB") == 2 << 30 and parse_size("500MB") == 500_000_000 and parse_size(4096) == 4096
    with pytest.raises(ValueError, match="hicache_storage_size"):
        ServerArgs(hicache_storage_size="lots")
    with pytest.raises(ValueError, match="hicache_storage_backend"):
        ServerArgs(hicache_storage_backend="nfs")
    with pytest.raises(ValueError, match="hicache_write_policy"):
        ServerArgs(hicache_write_policy="sometimes")
    with pytest.raises(ValueError, match="disable_radix_cache"):
        ServerArgs(enable_hierarchical_cache=True, disable_radix_cache=True)
    assert not ServerArgs().enable_hierarchical_cache  # NOTE: opt-in


# ---- keys ---------------------------------------------------------------------------------------------------
FP = dict(weights="w|1|2", quantization="none", config="cfg", dtype="float32", kv_dtype="torch.float32",
          page_size=1, page_tokens=32, layers=30, heads=3, head_dim=64)
TOKENS = list(range(100))


def keys_with(extra_key=None, tokens=TOKENS, **changes):
    return page_keys(kv_fingerprint(**{**FP, **changes}), extra_key, tokens, 32)


def test_keys_chain_over_whole_pages():
    keys = keys_with()
    assert len(keys) == 3 and len(set(keys)) == 3 and all(len(k) == 40 for k in keys)
    assert keys_with(tokens=TOKENS[:64]) == keys[:2]  # a prefix's keys are the prefix of the keys
    changed = keys_with(tokens=[7] + TOKENS[1:])
    assert all(a != b for a, b in zip(changed, keys, strict=True))  # page 0 changes every later key
    later = keys_with(tokens=TOKENS[:40] + [7] + TOKENS[41:])
    assert later[0] == keys[0] and later[1] != keys[1] and later[2] != keys[2]


@pytest.mark.parametrize("change", [dict(extra_key="tenant-a"), dict(extra_key=("lora", "a")), dict(dtype="bfloat16"),
                                    dict(kv_dtype="torch.bfloat16"), dict(page_size=4), dict(weights="w|1|3"),
                                    dict(config="cfg2"), dict(layers=29), dict(quantization="int8")])
def test_any_namespace_or_setting_change_gives_different_keys(change):
    base = keys_with()
    other = keys_with(**change)
    assert not set(base) & set(other)


def test_namespace_encoding_is_injective():
    values = [None, "a", b"a", 1, "1", ("a",), ("a", "b"), ("ab",), (("a",), "b"), ("a", ("b",))]
    encoded = [namespace_bytes(v) for v in values]
    assert len(set(encoded)) == len(values)


def test_weights_identity_follows_size_and_mtime(tmp_path):
    weights = tmp_path / "model.gguf"
    weights.write_bytes(b"1234")
    first = weights_identity(weights)
    os.utime(weights, ns=(1, 10**18))
    assert weights_identity(weights) != first
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"1")
    assert "model.safetensors|1|" in weights_identity(folder)
