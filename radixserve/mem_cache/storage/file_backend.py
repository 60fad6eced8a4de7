"""`FileStorageBackend`: one file per page in a directory, written atomically, checksummed, capped in bytes.

A page file is `<key>.kv`: a 40-byte header (magic, payload length, blake2b-128 of the payload) and the payload.
It is written to a temp file in the same directory, fsynced and renamed over the final name (`os.replace`), so a
reader sees a whole page or none; a page whose header or checksum does not verify is counted, deleted and a miss.
Files are created owner-only (0600, the directory 0700). The size cap evicts the least recently used files (the
file's mtime, touched on every read; an in-memory index ordered by it). A full disk, a read-only or unwritable
directory turns the store off with one warning; serving goes on without it.

Several processes may share one directory (the workers of `serve --dp N`): writes are atomic renames, a temp file
is removed at open only when its writer (the pid in its name) is dead or it is old, a page another process wrote
is adopted by `exists`, one it deleted is a miss, and the size index is rebuilt from the directory every
`RESCAN_S` seconds of writes and before evicting, so the cap holds for the directory as a whole (docs/hicache.md).
"""

from __future__ import annotations

import errno
import logging
import os
import re
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from radixserve.mem_cache.storage.base import StorageStats
from radixserve.mem_cache.storage.page_format import HEADER as _HEADER
from radixserve.mem_cache.storage.page_format import HEADER_BYTES, MAGIC, checksum, verify_parts

logger = logging.getLogger(__name__)

# NOTE: the page format (header, checksum) is page_format's, shared with the Redis backend
SUFFIX = ".kv"
TMP_PREFIX = ".tmp-"
_KEY_RE = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
# NOTE: errors that mean the store cannot work at all (not a bad page): they turn it off
_FATAL_ERRNOS = {errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT}
STALE_TMP_S = 600.0  # a temp file this old was left by a crashed writer: removed at open
DEAD_WRITER_TMP_S = 60.0  # a temp file of a pid not alive here, this old, is removed at open too
RESCAN_S = 10.0  # the size index is rebuilt from the directory at most this often on writes (other processes)
RESCAN_BEFORE_EVICT_S = 1.0  # ... and before evicting, if not rebuilt for this long


class FileStorageBackend:
    """Pages as files in `directory` (created 0700), at most `capacity_bytes` of them (headers included)."""

    kind = "file"

    def __init__(self, directory: str | os.PathLike, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"storage capacity must be positive, got {capacity_bytes}")
        self.directory = Path(directory)
        self.capacity_bytes = capacity_bytes
        self.stats = StorageStats()
        self.on_evict: Callable[[str], None] | None = None  # told each key the size cap deletes (KV events)
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> file bytes, least recently used first
        self._usage = 0
        self._scanned_at = 0.0  # time.monotonic() of the last rebuild of the index from the directory
        try:
            self._open()
        except OSError as exc:
            self._turn_off(exc, "opening")

    # ---- state ----------------------------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        return not self.stats.disabled

    def usage(self) -> int:
        return self._usage

    def pages(self) -> int | None:
        """Pages in the directory as this process last indexed it (other workers' writes count after a rescan)."""
        return len(self._index)

    def _open(self) -> None:
        created = not self.directory.exists()
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        if created:
            os.chmod(self.directory, 0o700)  # NOTE: mkdir's mode is masked by the umask
        if not os.access(self.directory, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, "directory is not writable", str(self.directory))
        self._rescan(clean_temp=True)
        self._make_room(0)

    def _rescan(self, clean_temp: bool = False) -> None:
        """Rebuild the index and usage from the directory, least recently used (oldest mtime) first.

        NOTE: other processes over the same directory add and remove pages; this is how their pages count
        against the cap. With `clean_temp` (at open) abandoned temp files are removed, never a live writer's."""
        now, found = time.time(), []
        with os.scandir(self.directory) as entries:
            for entry in entries:
                try:
                    if not entry.is_file(follow_symlinks=False):
                        continue
                    stat = entry.stat(follow_symlinks=False)
                except FileNotFoundError:  # removed by another process while listing
                    continue
                if entry.name.startswith(TMP_PREFIX):
                    if clean_temp and _abandoned_temp(entry.name, now - stat.st_mtime):
                        _unlink(entry.path)
                elif entry.name.endswith(SUFFIX):
                    found.append((stat.st_mtime_ns, entry.name[: -len(SUFFIX)], stat.st_size))
        self._index.clear()
        for _, key, size in sorted(found):
            self._index[key] = size
        self._usage = sum(self._index.values())
        self._scanned_at = time.monotonic()

    def _turn_off(self, exc: OSError, doing: str) -> None:
        if not self.stats.disabled:
            self.stats.disabled = True
            logger.warning("hierarchical cache storage at %s turned off (%s: %s); serving continues without it",
                           self.directory, doing, exc)

    def _path(self, key: str) -> Path:
        if not _KEY_RE.match(key):
            raise ValueError(f"storage key {key!r} must be 1-128 characters of [A-Za-z0-9_-]")
        return self.directory / (key + SUFFIX)

    # ---- the protocol ---------------------------------------------------------------------------
    def exists(self, key: str) -> bool:
        if not self.enabled:
            return False
        try:
            size = os.stat(self._path(key)).st_size
        except OSError:
            self._forget(key)  # NOTE: another process over the same directory may have deleted it
            return False
        if key not in self._index:
            self._touch(key, size)  # written by another process: adopted into the index (and the usage)
        return True

    def get(self, key: str) -> bytearray | None:
        """The verified payload as a `bytearray` (writable: the controller views it as a tensor without a copy)."""
        if not self.enabled:
            return None
        path = self._path(key)
        try:
            with open(path, "rb", buffering=0) as f:
                # NOTE: one read of the header, then one read into a buffer of the payload's size (no slicing copy)
                header = f.read(HEADER_BYTES)
                size = os.fstat(f.fileno()).st_size
                payload: bytearray | None = bytearray(max(size - HEADER_BYTES, 0))
                view, got = memoryview(payload), 0
                while got < len(payload) and (n := f.readinto(view[got:])):
                    got += n
                view.release()
                if got != len(payload) or f.read(1):
                    payload = None  # NOTE: changed under us (another writer replaces whole files, so not expected)
        except FileNotFoundError:
            self._forget(key)
            self.stats.misses += 1
            return None
        except OSError as exc:
            self._turn_off(exc, "reading")
            return None
        if payload is None or not verify_parts(header, payload):
            logger.warning("hierarchical cache page %s failed its checksum; deleted", path.name)
            self.stats.corrupt += 1
            self.stats.misses += 1
            self.delete(key)
            return None
        self.stats.hits += 1
        self.stats.bytes_read += len(payload)
        try:
            os.utime(path)  # NOTE: the LRU order survives a restart: the index is rebuilt by mtime
        except OSError:
            pass
        self._touch(key, HEADER_BYTES + len(payload))
        return payload

    def set(self, key: str, payload: bytes) -> bool:
        if not self.enabled:
            return False
        path = self._path(key)
        size = HEADER_BYTES + len(payload)
        if size > self.capacity_bytes:
            return False
        tmp = self.directory / f"{TMP_PREFIX}{key}-{os.getpid()}-{os.urandom(4).hex()}"
        if time.monotonic() - self._scanned_at > RESCAN_S:
            self._try_rescan()
        try:
            self._make_room(size - self._index.get(key, 0))
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(_HEADER.pack(MAGIC, len(payload), checksum(payload)))
                    f.write(payload)
                    f.flush()
                    os.fsync(f.fileno())
                # NOTE: the rename is the commit point: before it no reader can see the page
                os.replace(tmp, path)
            except BaseException:
                _unlink(tmp)
                raise
        except OSError as exc:
            if exc.errno in _FATAL_ERRNOS or isinstance(exc, PermissionError):
                self._turn_off(exc, "writing")
            else:
                logger.warning("hierarchical cache page %s not written: %s", path.name, exc)
            return False
        self._touch(key, size)
        self.stats.pages_written += 1
        self.stats.bytes_written += len(payload)
        return True

    def delete(self, key: str) -> None:
        self._forget(key)
        _unlink(self._path(key))

    # ---- size cap -------------------------------------------------------------------------------
    def _touch(self, key: str, size: int) -> None:
        self._usage += size - self._index.pop(key, 0)
        self._index[key] = size

    def _forget(self, key: str) -> None:
        self._usage -= self._index.pop(key, 0)

    def _make_room(self, incoming: int) -> None:
        """Delete least recently used pages until `incoming` more bytes fit under the cap."""
        if self._usage + incoming > self.capacity_bytes and time.monotonic() - self._scanned_at > RESCAN_BEFORE_EVICT_S:
            self._try_rescan()  # NOTE: another process may have evicted already: count before deleting
        while self._index and self._usage + incoming > self.capacity_bytes:
            key, _ = next(iter(self._index.items()))
            self.delete(key)
            self.stats.evicted += 1
            if self.on_evict is not None:
                self.on_evict(key)

    def _try_rescan(self) -> None:
        try:
            self._rescan()
        except OSError as exc:  # NOTE: the write that follows meets the same error and decides
            logger.debug("hierarchical cache storage rescan failed: %s", exc)
            self._scanned_at = time.monotonic()


def _abandoned_temp(name: str, age_s: float) -> bool:
    """Whether a temp file (`.tmp-<key>-<pid>-<random>`) of age `age_s` is a dead writer's: removed at open.

    NOTE: a live writer's temp file is never removed (it is renamed within milliseconds of being created). One is
    abandoned when it is older than STALE_TMP_S, or when its pid is not a live process on this host and it is
    older than DEAD_WRITER_TMP_S (a directory shared across hosts sees other hosts' pids as dead: the age guards
    them; a reused pid only keeps a file until STALE_TMP_S)."""
    if age_s > STALE_TMP_S:
        return True
    parts = name.rsplit("-", 2)
    if age_s <= DEAD_WRITER_TMP_S or len(parts) != 3 or not parts[1].isdigit():
        return False
    return not _pid_alive(int(parts[1]))


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, owned by someone else
        return True
    return True


def _unlink(path: str | os.PathLike) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.debug("could not remove %s: %s", path, exc)
