"""The host-memory tier of the hierarchical cache (SGLang's HiCache L2): storage pages kept as CPU tensors.

A `HostKVTier` holds whole storage pages (`[2, layers, page_tokens, heads, head_dim]`) under the same page keys
as the storage backend, in an LRU bounded by bytes. It sits in front of the storage backend; the controller
(hicache.py) is the one place that decides the order (host first, then storage) and what is copied where.

Pages are kept in `dtype` (by default the KV pool's): a page in the pool's dtype loads back bit-identical; a page
kept in a compact dtype (bfloat16 from a float32 pool) halves the bytes and is rounded once on the way in, so the
loaded KV is close to, not equal to, the computed KV (docs/hicache.md).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

HOST_DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class HostTierStats:
    """Counters of one host tier since it was made."""

    hits: int = 0  # get() that returned a page
    misses: int = 0
    pages_stored: int = 0
    bytes_stored: int = 0
    evicted: int = 0  # pages dropped to stay under the byte bound

    def as_dict(self) -> dict:
        return asdict(self)


class HostKVTier:
    """Pages by key in host memory, at most `capacity_bytes` of them, least recently used dropped first.

    `get` returns the page converted to `pool_dtype`; `put` converts to the tier's `dtype` (one copy, so the
    caller's tensor is never aliased)."""

    def __init__(self, capacity_bytes: int, pool_dtype: torch.dtype, dtype: torch.dtype | None = None) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"hicache_size must be positive, got {capacity_bytes} bytes")
        self.capacity_bytes, self.pool_dtype = int(capacity_bytes), pool_dtype
        self.dtype = dtype or pool_dtype
        self._pages: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._used = 0
        self.stats = HostTierStats()
        self.on_evict: Callable[[str], None] | None = None  # told each key the byte bound drops (KV events)

    def __len__(self) -> int:
        return len(self._pages)

    def __contains__(self, key: str) -> bool:
        return key in self._pages

    def usage(self) -> int:
        """Bytes the tier holds now (never over `capacity_bytes`)."""
        return self._used

    def get(self, key: str) -> torch.Tensor | None:
        """The page under `key` in the pool's dtype (and marks it most recently used), or None."""
        page = self._pages.get(key)
        if page is None:
            self.stats.misses += 1
            return None
        self._pages.move_to_end(key)
        self.stats.hits += 1
        return page if page.dtype == self.pool_dtype else page.to(self.pool_dtype)

    def put(self, key: str, page: torch.Tensor) -> bool:
        """Keep a copy of `page` under `key` (most recently used); False if one page is over the whole bound."""
        size = page.numel() * torch.empty((), dtype=self.dtype).element_size()
        if size > self.capacity_bytes:
            return False
        self.delete(key)
        # NOTE: the byte bound holds before the new page is counted: evict first, then add
        while self._used + size > self.capacity_bytes and self._pages:
            gone, old = self._pages.popitem(last=False)
            self._used -= old.numel() * old.element_size()
            self.stats.evicted += 1
            if self.on_evict is not None:
                self.on_evict(gone)
        copy = page.detach().to("cpu", self.dtype, copy=True).contiguous()
        self._pages[key] = copy
        self._used += size
        self.stats.pages_stored += 1
        self.stats.bytes_stored += size
        return True

    def delete(self, key: str) -> None:
        old = self._pages.pop(key, None)
        if old is not None:
            self._used -= old.numel() * old.element_size()


def host_tier_bytes(size_gb: float, ratio: float, pool_bytes: int) -> int:
    """The host tier's bound from `--hicache-size` (GB, 1e9 bytes; wins when > 0) or `--hicache-ratio` (times the
    device KV pool's bytes); 0 when neither is given (no host tier)."""
    if size_gb and size_gb > 0:
        return int(size_gb * 1e9)
    if ratio and ratio > 0:
        return int(ratio * pool_bytes)
    return 0
