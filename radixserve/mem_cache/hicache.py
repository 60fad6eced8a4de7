"""`HiCacheController`: the disk tier behind the radix tree (SGLang's HiCache L3), and `make_hicache`.

The `KVManager` calls it at four points and it never owns a slot for longer than one call:
- `extend_match` (match_prefix): after the tree's hit, load the following stored pages of the request's key into
  free slots and insert them into the tree (the tree then owns them); the longer match is returned.
- `on_insert` (cache_unfinished_req / cache_finished_req, write_through): store each full page not stored yet.
- `on_lock` (admission, write_through_selective): count hits of matched pages; store a page at its N-th hit.
- `on_evict` (the tree's eviction hook, write_back): store an evicted leaf's pages before its slots are freed.
Loading is synchronous, before the forward that needs the pages (docs/hicache.md).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from radixserve.mem_cache.radix_cache import MatchResult, TreeNode
from radixserve.mem_cache.radix_key import RadixKey
from radixserve.mem_cache.storage.base import WRITE_POLICIES, StorageBackend, parse_size
from radixserve.mem_cache.storage.keys import page_keys

logger = logging.getLogger(__name__)

SELECTIVE_HITS = 2  # write_through_selective stores a page at its second hit
MIN_PAGE_TOKENS = 32  # NOTE: a storage page is the smallest multiple of the pool's page size >= this
_HIT_COUNTS_KEPT = 1 << 16
_GATHER_PAGES = 16  # pages copied from the pool at once when storing


def storage_page_tokens(page_size: int) -> int:
    return -(-MIN_PAGE_TOKENS // page_size) * page_size


class HiCacheController:
    """Moves whole storage pages (`page_tokens` tokens, a multiple of the pool's page size) between the KV pool
    (`kv_pool`: per-layer K/V buffers) and a `StorageBackend`, keyed by `page_keys` under `fingerprint`."""

    def __init__(self, backend: StorageBackend, kv_pool: Any, allocator: Any, tree: Any, fingerprint: bytes,
                 page_tokens: int, write_policy: str = "write_through", stats: Any = None) -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"hicache_write_policy={write_policy!r} is not one of {', '.join(WRITE_POLICIES)}")
        if page_tokens % allocator.page_size:
            raise ValueError(f"storage page of {page_tokens} tokens is not a multiple of the pool's page size")
        self.backend, self.kv_pool, self.allocator, self.tree = backend, kv_pool, allocator, tree
        self.fingerprint, self.page_tokens, self.write_policy = fingerprint, page_tokens, write_policy
        self.loaded_tokens = 0  # tokens loaded from storage into the tree, in all
        self.scheduler_stats = stats  # a SchedulerStats: its hicache_* counters are copied from ours after each use
        # NOTE: set by the scheduler: blocks until no launched forward is still running. Under the overlap loop a
        # freed slot (an overrun or retracted request's) may still be written by the forward in flight; only a
        # later forward on the same stream may reuse it, so a load (a write from this thread) waits first; and a
        # continuing chunk's KV is published before its forward has run, so a selective store waits too.
        self.before_pool_write: Callable[[], None] | None = None
        self.load_calls = 0
        self._hits: OrderedDict[str, int] = OrderedDict()  # write_through_selective: page key -> hits
        if write_policy == "write_back":
            tree.evict_hook = self.on_evict

    @property
    def stats(self) -> dict:
        return {**self.backend.stats.as_dict(), "loaded_tokens": self.loaded_tokens, "usage": self.backend.usage()}

    def _sync(self) -> None:
        out, mine = self.scheduler_stats, self.backend.stats
        if out is not None:
            out.hicache_loaded_tokens, out.hicache_storage_hits = self.loaded_tokens, mine.hits
            out.hicache_storage_misses, out.hicache_corrupt_pages = mine.misses, mine.corrupt
            out.hicache_bytes_written, out.hicache_bytes_read = mine.bytes_written, mine.bytes_read

    def _wait_for_forwards(self) -> bool:
        """Block until no launched forward runs (`before_pool_write`); False if one failed (then skip the I/O)."""
        if self.before_pool_write is not None:
            try:
                self.before_pool_write()
            except Exception as exc:  # NOTE: a failed forward is the failure handling's; this load or store is skipped
                logger.warning("hierarchical cache page transfer skipped: %s", exc)
                return False
        return True

    def _keys(self, tokens: Sequence[int], extra_key: Any, num_pages: int | None = None) -> list[str]:
        return page_keys(self.fingerprint, extra_key, tokens, self.page_tokens, num_pages)

    # ---- page payloads --------------------------------------------------------------------------
    def _gather(self, slots: torch.Tensor) -> torch.Tensor:
        """K/V of `slots` for every layer: [2, layers, len(slots), heads, head_dim] on the CPU."""
        pool, idx = self.kv_pool, slots.to(self.kv_pool.device, torch.int64)
        k = torch.stack([pool.k_buffer[layer][idx] for layer in range(pool.layer_num)])
        v = torch.stack([pool.v_buffer[layer][idx] for layer in range(pool.layer_num)])
        return torch.stack([k, v]).cpu().contiguous()

    def _store_pages(self, keys: Sequence[str], slots: torch.Tensor) -> int:
        """Store page i of `keys` from `slots[i * page_tokens:(i + 1) * page_tokens]` (pages already stored are
        skipped); returns the pages written."""
        todo = [i for i, key in enumerate(keys) if not self.backend.exists(key)]
        if not todo or not self.backend.enabled:
            return 0
        t, written = self.page_tokens, 0
        for start in range(0, len(todo), _GATHER_PAGES):  # NOTE: bounds the host copy of a long prompt's KV
            group = todo[start:start + _GATHER_PAGES]
            kv = self._gather(torch.cat([slots[i * t:(i + 1) * t] for i in group]))
            for n, i in enumerate(group):
                page = kv[:, :, n * t:(n + 1) * t].contiguous()
                written += self.backend.set(keys[i], page.view(torch.uint8).numpy().tobytes())
        self._sync()
        return written

    def _page_shape(self) -> tuple[int, ...]:
        pool = self.kv_pool
        return (2, pool.layer_num, self.page_tokens, pool.head_num, pool.head_dim)

    def _decode(self, payload: bytes) -> torch.Tensor | None:
        shape = self._page_shape()
        element = torch.tensor([], dtype=self.kv_pool.dtype).element_size()
        if len(payload) != element * torch.Size(shape).numel():
            return None
        return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(self.kv_pool.dtype).view(shape)

    # ---- load -----------------------------------------------------------------------------------
    def extend_match(self, tokens: Sequence[int], extra_key: Any, match: MatchResult, priority: int = 0) -> MatchResult:
        """After the tree's hit `match` on `tokens` (the cacheable head only: never the last token), load the
        stored pages that follow into free slots, insert them into the tree and return the longer match.

        NOTE: only free slots are used, never eviction: other waiting requests' unlocked matches may point at
        evictable tree slots between their match and their lock."""
        t, m = self.page_tokens, len(match.device_indices)
        first, last = m // t, len(tokens) // t  # storage pages [first, last) could extend the match
        if first >= last or not self.backend.enabled:
            return match
        keys = self._keys(tokens, extra_key, last)[first:]
        room = (self.allocator.available_size() + m - first * t) // t  # NOTE: whole pages of free slots
        pages: list[torch.Tensor] = []
        for key in keys[:max(room, 0)]:
            if not self.backend.exists(key):
                break
            page = self._decode(self.backend.get(key) or b"")
            if page is None:
                self.backend.delete(key)
                break
            pages.append(page)
        end = (first + len(pages)) * t
        self._sync()
        if end <= m:
            return match
        if not self._wait_for_forwards():
            return match
        slots = self.allocator.alloc(end - m)
        if slots is None:
            return match
        kv = torch.cat(pages, dim=2)[:, :, m - first * t:]
        pool, idx = self.kv_pool, slots.to(self.kv_pool.device, torch.int64)
        for layer in range(pool.layer_num):
            pool.k_buffer[layer][idx] = kv[0, layer].to(pool.device)
            pool.v_buffer[layer][idx] = kv[1, layer].to(pool.device)
        if pool.device.type == "cuda":
            torch.cuda.synchronize(pool.device)  # NOTE: forwards run on their own stream: the KV must be there
        key = RadixKey(tokens[:end], extra_key)
        prefix_len = self.tree.insert(key, torch.cat([match.device_indices.to(slots.dtype), slots]), priority)
        if prefix_len > m:  # NOTE: not expected (nothing ran since the match); the tree keeps its own slots
            self.allocator.free(slots[: prefix_len - m])
        new = self.tree.match_prefix(RadixKey(tokens, extra_key))
        if len(new.device_indices) < end:
            raise RuntimeError(f"loaded {end - m} tokens from storage but the tree matches {len(new.device_indices)}")
        self.loaded_tokens += end - m
        self.load_calls += 1
        self._sync()
        return new

    # ---- store ----------------------------------------------------------------------------------
    def on_insert(self, key: RadixKey, slots: torch.Tensor, chunked: bool = False) -> None:
        """write_through: `key` (page-aligned) was inserted into the tree and `slots` hold its KV; store every full
        storage page not stored yet.

        NOTE: a continuing chunk (`chunked`) is published at the start of the next step, while its forward may
        still run under the overlap loop: its KV is not read then. The insert after the request's last chunk (its
        result processed: all KV computed) stores every page from the first, so the chunks' pages too."""
        if self.write_policy != "write_through" or chunked or not self.backend.enabled:
            return
        last = len(key) // self.page_tokens
        if last:
            self._store_pages(self._keys(key.raw_token_ids, key.extra_key, last), slots[: last * self.page_tokens])

    def on_lock(self, tokens: Sequence[int], extra_key: Any, slots: torch.Tensor) -> None:
        """write_through_selective: a request was admitted with `slots` matched for `tokens`; count a hit on each
        full page and store the pages at their SELECTIVE_HITS-th hit."""
        if self.write_policy != "write_through_selective" or not self.backend.enabled:
            return
        keys = self._keys(tokens, extra_key, len(slots) // self.page_tokens)
        due = []
        for i, key in enumerate(keys):
            hits = self._hits.pop(key, 0) + 1
            self._hits[key] = hits
            if hits == SELECTIVE_HITS:
                due.append(i)
        while len(self._hits) > _HIT_COUNTS_KEPT:
            self._hits.popitem(last=False)
        if due and self._wait_for_forwards():
            # NOTE: a matched node may be a continuing chunk published while its forward runs: wait for it first
            t = self.page_tokens
            self._store_pages([keys[i] for i in due], torch.cat([slots[i * t:(i + 1) * t] for i in due]))

    def on_evict(self, node: TreeNode) -> None:
        """write_back: `node`, a leaf, is being evicted (its slots and its ancestors' are still valid): store the
        full storage pages that end inside it."""
        if not self.backend.enabled:
            return
        path = []
        while node is not None and node.parent is not None:
            path.append(node)
            node = node.parent
        path.reverse()
        length = sum(len(n.key) for n in path)
        leaf_start = length - len(path[-1].key)
        t = self.page_tokens
        first, last = leaf_start // t, length // t  # the pages that end in (leaf_start, length]
        if first >= last:
            return
        tokens = [tok for n in path for tok in n.key.raw_token_ids]
        slots = torch.cat([n.value for n in path])
        keys = self._keys(tokens, path[-1].key.extra_key, last)[first:]
        self._store_pages(keys, slots[first * t:last * t])


def default_storage_dir() -> Path:
    from radixserve import envs

    return Path(envs.CACHE_DIR.get()) / "hicache"


def open_storage_backend(server_args: Any) -> tuple[StorageBackend, str]:
    """The store `--hicache-storage-backend` names and where it is, for the log (the one place a backend is
    chosen). Raises ValueError for a bad URL, RuntimeError when the redis package is missing; a store that
    cannot be reached is returned turned off."""
    if server_args.hicache_storage_backend == "redis":
        from radixserve.mem_cache.storage.redis_backend import RedisStorageBackend

        store = RedisStorageBackend(server_args.hicache_storage_url)
        return store, f"{store.location} (maxmemory {store.capacity_bytes} bytes, {store.eviction_policy or '?'})"
    from radixserve.mem_cache.storage.file_backend import FileStorageBackend

    directory = server_args.hicache_storage_dir or default_storage_dir()
    files = FileStorageBackend(directory, parse_size(server_args.hicache_storage_size))
    return files, f"{directory} ({files.capacity_bytes} bytes cap)"


def make_hicache(server_args: Any, model_runner: Any, tree: Any, allocator: Any,
                 stats: Any = None) -> HiCacheController | None:
    """The scheduler's disk tier, or None when `--enable-hierarchical-cache` is off. Raises ValueError for a
    combination it cannot serve (a hybrid sliding-window pool, the radix cache disabled)."""
    if not getattr(server_args, "enable_hierarchical_cache", False):
        return None
    if tree.sliding_window is not None:  # NOTE: the tree declares a hybrid pool (tiers.py)
        raise ValueError("--enable-hierarchical-cache does not support sliding-window models with the hybrid KV pool "
                         "(docs/hicache.md); pass --disable-hybrid-swa-memory or drop the flag")
    if tree.disable or tree.is_eagle:
        raise ValueError("--enable-hierarchical-cache needs the radix cache (drop --disable-radix-cache)")
    from radixserve.mem_cache.storage.keys import kv_fingerprint, weights_identity

    # NOTE: a ModelRunner's attributes (SchedulerRunner does not promise them: the tests' fakes run no hicache)
    pool = model_runner.token_to_kv_pool
    page_tokens = storage_page_tokens(allocator.page_size)
    fingerprint = kv_fingerprint(
        weights=weights_identity(model_runner.loaded.source), quantization=server_args.quantization,
        config=repr(model_runner.model_config), dtype=str(model_runner.dtype),
        kv_dtype=str(pool.dtype), page_size=allocator.page_size, page_tokens=page_tokens, layers=pool.layer_num,
        heads=pool.head_num, head_dim=pool.head_dim)
    backend, where = open_storage_backend(server_args)
    logger.info("hierarchical cache: %s storage at %s (%s, %d-token pages)", server_args.hicache_storage_backend,
                where, server_args.hicache_write_policy, page_tokens)
    return HiCacheController(backend, pool, allocator, tree, fingerprint, page_tokens, server_args.hicache_write_policy,
                             stats)
