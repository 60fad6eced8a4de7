"""`StorageBackend`: what the disk tier needs of a page store, and `StorageStats`, its counters."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Protocol

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
STORAGE_BACKENDS = ("file", "redis")
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)


def parse_size(value: str | int) -> int:
    """Bytes from an int or a string such as "2GiB", "512MiB", "10GB", "4096" (KiB, MiB... are powers of 1024,
    KB, MB... of 1000); a ValueError naming `hicache_storage_size` otherwise."""
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    else:
        match = _SIZE_RE.match(str(value))
        if match is None:
            raise ValueError(f"hicache_storage_size={value!r} is not a size such as 2GiB, 500MB or 1073741824")
        unit = (match.group(2) or "B").upper()
        base = 1024 if "I" in unit else 1000
        size = int(float(match.group(1)) * base ** " KMGT".index(unit[0] if unit != "B" else " "))
    if size <= 0:
        raise ValueError(f"hicache_storage_size must be positive, got {value!r}")
    return size


@dataclass
class StorageStats:
    """Counters of one backend since it was opened (read by the tier's metrics and the tests)."""

    hits: int = 0  # get() that returned a page
    misses: int = 0  # get() of an absent page (corrupt pages count here too)
    corrupt: int = 0  # pages whose header or checksum did not verify: deleted
    pages_written: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    evicted: int = 0  # pages removed to stay under the size cap
    disabled: bool = False  # the tier turned itself off (full disk, unwritable directory)

    def as_dict(self) -> dict:
        return asdict(self)


class StorageBackend(Protocol):
    """A page store keyed by a string; values are one page's payload (bytes). A page at a time.

    Implementations must make a page visible only when it is complete, verify what they return, and never raise
    on an I/O failure: a failing store turns itself off (`enabled` False) and reports misses from then on.
    """

    stats: StorageStats
    kind: str  # "file" or "redis" (--hicache-storage-backend)
    on_evict: Callable[[str], None] | None  # told each key the store deletes to stay under its cap
    capacity_bytes: int  # the size cap (file) or the server's maxmemory (redis; 0: none)

    @property
    def enabled(self) -> bool: ...

    def exists(self, key: str) -> bool:
        """Whether a complete page is stored under `key` (not verified: `get` may still find it corrupt)."""
        ...

    def get(self, key: str) -> bytes | None:
        """The verified payload stored under `key`, or None (absent, corrupt or the store is off)."""
        ...

    def set(self, key: str, payload: bytes) -> bool:
        """Store `payload` under `key` (replacing any); returns whether it was stored."""
        ...

    def delete(self, key: str) -> None:
        """Remove the page under `key` if there is one."""
        ...

    def usage(self) -> int:
        """Bytes the store holds now (the size cap applies to this)."""
        ...

    def pages(self) -> int | None:
        """Pages the store holds now, or None when it cannot tell cheaply (a shared server)."""
        ...
