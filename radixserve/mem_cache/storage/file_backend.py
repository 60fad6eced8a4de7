"""`FileStorageBackend`: one file per page in a directory, written atomically, checksummed, capped in bytes.

A page file is `<key>.kv`: a 40-byte header (magic, payload length, blake2b-128 of the payload) and the payload.
It is written to a temp file in the same directory, fsynced and renamed over the final name (`os.replace`), so a
reader sees a whole page or none; a page whose header or checksum does not verify is counted, deleted and a miss.
Files are created owner-only (0600, the directory 0700). The size cap evicts the least recently used files (the
file's mtime, touched on every read; an in-memory index ordered by it). A full disk, a read-only or unwritable
directory turns the store off with one warning; serving goes on without it.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import re
import struct
import time
from collections import OrderedDict
from pathlib import Path

from radixserve.mem_cache.storage.base import StorageStats

logger = logging.getLogger(__name__)

MAGIC = b"RSKVPG01"
_HEADER = struct.Struct("<8sQ16s")  # magic, payload length, blake2b-128 digest of the payload
HEADER_BYTES = _HEADER.size
SUFFIX = ".kv"
TMP_PREFIX = ".tmp-"
_KEY_RE = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
# NOTE: errors that mean the store cannot work at all (not a bad page): they turn it off
_FATAL_ERRNOS = {errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT}
STALE_TMP_S = 600.0  # a temp file this old was left by a crashed writer: removed at open


def checksum(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


class FileStorageBackend:
    """Pages as files in `directory` (created 0700), at most `capacity_bytes` of them (headers included)."""

    def __init__(self, directory: str | os.PathLike, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"storage capacity must be positive, got {capacity_bytes}")
        self.directory = Path(directory)
        self.capacity_bytes = capacity_bytes
        self.stats = StorageStats()
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> file bytes, least recently used first
        self._usage = 0
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

    def _open(self) -> None:
        created = not self.directory.exists()
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        if created:
            os.chmod(self.directory, 0o700)  # NOTE: mkdir's mode is masked by the umask
        if not os.access(self.directory, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, "directory is not writable", str(self.directory))
        now, found = time.time(), []
        with os.scandir(self.directory) as entries:
            for entry in entries:
                if not entry.is_file(follow_symlinks=False):
                    continue
                stat = entry.stat(follow_symlinks=False)
                if entry.name.startswith(TMP_PREFIX):
                    if now - stat.st_mtime > STALE_TMP_S:
                        _unlink(entry.path)
                elif entry.name.endswith(SUFFIX):
                    found.append((stat.st_mtime_ns, entry.name[: -len(SUFFIX)], stat.st_size))
        for _, key, size in sorted(found):
            self._index[key] = size
            self._usage += size
        self._make_room(0)

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
        if key in self._index:
            return True
        return self._path(key).is_file()  # NOTE: another process over the same directory may have written it

    def get(self, key: str) -> bytes | None:
        if not self.enabled:
            return None
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            self._forget(key)
            self.stats.misses += 1
            return None
        except OSError as exc:
            self._turn_off(exc, "reading")
            return None
        payload = _verify(data)
        if payload is None:
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
        self._touch(key, len(data))
        return payload

    def set(self, key: str, payload: bytes) -> bool:
        if not self.enabled:
            return False
        path = self._path(key)
        size = HEADER_BYTES + len(payload)
        if size > self.capacity_bytes:
            return False
        tmp = self.directory / f"{TMP_PREFIX}{key}-{os.getpid()}-{os.urandom(4).hex()}"
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
        while self._index and self._usage + incoming > self.capacity_bytes:
            key, _ = next(iter(self._index.items()))
            self.delete(key)
            self.stats.evicted += 1


def _verify(data: bytes) -> bytes | None:
    if len(data) < HEADER_BYTES:
        return None
    magic, length, digest = _HEADER.unpack_from(data)
    payload = data[HEADER_BYTES:]
    if magic != MAGIC or length != len(payload) or checksum(payload) != digest:
        return None
    return payload


def _unlink(path: str | os.PathLike) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.debug("could not remove %s: %s", path, exc)
