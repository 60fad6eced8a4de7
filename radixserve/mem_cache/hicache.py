"""`HiCacheController`: the tiers behind the radix tree (SGLang's HiCache: an optional host-memory tier, L2, in front
of a storage backend, L3), and `make_hicache`. This class alone orders them: loads look in host, then storage.

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
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

from radixserve.mem_cache.host_tier import HostKVTier
from radixserve.mem_cache.kv_events import HOST_MEDIUM, STORAGE_MEDIUM, KVEventSink
from radixserve.mem_cache.radix_cache import MatchResult, TreeNode
from radixserve.mem_cache.radix_key import RadixKey, pack_tokens
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
                 page_tokens: int, write_policy: str = "write_through", stats: Any = None,
                 host: HostKVTier | None = None, kv_events: KVEventSink | None = None) -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"hicache_write_policy={write_policy!r} is not one of {', '.join(WRITE_POLICIES)}")
        if page_tokens % allocator.page_size:
            raise ValueError(f"storage page of {page_tokens} tokens is not a multiple of the pool's page size")
        self.backend, self.kv_pool, self.allocator, self.tree = backend, kv_pool, allocator, tree
        self.fingerprint, self.page_tokens, self.write_policy = fingerprint, page_tokens, write_policy
        self.loaded_tokens = 0  # tokens loaded into the tree, in all (host + storage)
        # NOTE: the host tier (host_tier.py) sits in front of the backend; this class alone decides the order:
        # a load looks in host first, then storage (promoting what storage gives to host); a store goes to both
        self.host = host
        self.host_loaded_tokens = self.storage_loaded_tokens = 0  # loaded_tokens by the tier they came from
        self.load_s = self.store_s = 0.0  # wall time in loads (reads + pool writes) and stores, in all
        self.scheduler_stats = stats  # a SchedulerStats: its hicache_* counters are copied from ours after each use
        # NOTE: set by the scheduler: blocks until no launched forward is still running. Under the overlap loop a
        # freed slot (an overrun or retracted request's) may still be written by the forward in flight; only a
        # later forward on the same stream may reuse it, so a load (a write from this thread) waits first; and a
        # continuing chunk's KV is published before its forward has run, so a selective store waits too.
        self.before_pool_write: Callable[[], None] | None = None
        self.load_calls = 0
        self._hits: OrderedDict[str, int] = OrderedDict()  # write_through_selective: page key -> hits
        # KV events (--kv-events-config): pages copied into / dropped from the host tier ("CPU") and storage
        self.kv_events = kv_events
        if kv_events is not None:
            backend.on_evict = partial(kv_events.tier_removed, STORAGE_MEDIUM)
            if host is not None:
                host.on_evict = partial(kv_events.tier_removed, HOST_MEDIUM)
        if write_policy == "write_back":
            tree.evict_hook = self.on_evict

    @property
    def stats(self) -> dict:
        out = {**self.backend.stats.as_dict(), "loaded_tokens": self.loaded_tokens, "usage": self.backend.usage(),
               "host_loaded_tokens": self.host_loaded_tokens, "storage_loaded_tokens": self.storage_loaded_tokens,
               "load_s": self.load_s, "store_s": self.store_s}
        if self.host is not None:
            out.update({f"host_{k}": v for k, v in self.host.stats.as_dict().items()},
                       host_usage=self.host.usage(), host_capacity=self.host.capacity_bytes)
        return out

    def tier_summary(self) -> dict[str, Any]:
        """What each tier behind the tree holds and has done, for the cache explorer: pages, bytes, capacity, hit and
        load counters (the host entry is None without a host tier)."""
        shape = torch.Size(self._page_shape())
        page_bytes = shape.numel() * torch.tensor([], dtype=self.kv_pool.dtype).element_size()
        host, store, s = self.host, self.backend, self.backend.stats
        return {
            "page_tokens": self.page_tokens, "page_bytes": page_bytes, "write_policy": self.write_policy,
            "loads": self.load_calls, "loaded_tokens": self.loaded_tokens, "load_s": round(self.load_s, 6),
            "store_s": round(self.store_s, 6),
            "host": None if host is None else {
                "pages": len(host), "bytes": host.usage(), "capacity_bytes": host.capacity_bytes,
                "dtype": str(host.dtype).removeprefix("torch."), "hits": host.stats.hits,
                "misses": host.stats.misses, "evicted": host.stats.evicted,
                "loaded_tokens": self.host_loaded_tokens},
            "storage": {
                "backend": store.kind, "enabled": store.enabled, "pages": store.pages(), "bytes": store.usage(),
                "capacity_bytes": store.capacity_bytes, "hits": s.hits, "misses": s.misses, "corrupt": s.corrupt,
                "pages_written": s.pages_written, "evicted": s.evicted, "loaded_tokens": self.storage_loaded_tokens},
        }

    def _sync(self) -> None:
        out, mine = self.scheduler_stats, self.backend.stats
        if out is not None:
            out.hicache_loaded_tokens, out.hicache_storage_hits = self.loaded_tokens, mine.hits
            out.hicache_storage_misses, out.hicache_corrupt_pages = mine.misses, mine.corrupt
            out.hicache_bytes_written, out.hicache_bytes_read = mine.bytes_written, mine.bytes_read
            out.hicache_host_loaded_tokens = self.host_loaded_tokens
            out.hicache_storage_loaded_tokens = self.storage_loaded_tokens
            out.hicache_load_seconds, out.hicache_store_seconds = self.load_s, self.store_s
            if self.host is not None:
                out.hicache_host_hits, out.hicache_host_misses = self.host.stats.hits, self.host.stats.misses
                out.hicache_host_usage_bytes = self.host.usage()

    @property
    def _storing(self) -> bool:
        return self.backend.enabled or self.host is not None

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

    def _path(self, tokens: Sequence[int] | bytes, extra_key: Any, pages: Sequence[int]) -> tuple | None:
        """What a KV event needs to name stored pages (their path's packed tokens, namespace, page numbers); None
        (and nothing computed) without KV events."""
        if self.kv_events is None:
            return None
        return tokens if isinstance(tokens, bytes) else pack_tokens(list(tokens)), extra_key, list(pages)

    def _announce(self, medium: str, keys: Sequence[str], path: tuple | None, done: Sequence[int]) -> None:
        """KV events: pages `done` (indices into `keys` and `path`'s page numbers) are now in tier `medium`."""
        if path is not None and done:
            packed, extra_key, pages = path
            self.kv_events.tier_stored(medium, [keys[i] for i in done], packed, extra_key, [pages[i] for i in done],
                                       self.page_tokens)

    def _store_pages(self, keys: Sequence[str], slots: torch.Tensor, path: tuple | None = None) -> int:
        """Store page i of `keys` from `slots[i * page_tokens:(i + 1) * page_tokens]` (pages already stored are
        skipped); returns the pages written. `path` (`_path`): name the pages in KV events."""
        start_s, host = time.perf_counter(), self.host
        to_disk = {i for i, key in enumerate(keys) if self.backend.enabled and not self.backend.exists(key)}
        to_host = {i for i, key in enumerate(keys) if host is not None and key not in host}
        todo = sorted(to_disk | to_host)
        if not todo:
            return 0
        t, written = self.page_tokens, 0
        for start in range(0, len(todo), _GATHER_PAGES):  # NOTE: bounds the host copy of a long prompt's KV
            group = todo[start:start + _GATHER_PAGES]
            kv = self._gather(torch.cat([slots[i * t:(i + 1) * t] for i in group]))
            for n, i in enumerate(group):
                page = kv[:, :, n * t:(n + 1) * t].contiguous()
                # NOTE: each page is announced right after its copy: a later put may drop it again (its removal
                # event must follow its store event)
                if host is not None and i in to_host and host.put(keys[i], page):
                    self._announce(HOST_MEDIUM, keys, path, [i])
                if i in to_disk and self.backend.set(keys[i], page.view(torch.uint8).numpy().tobytes()):
                    written += 1
                    self._announce(STORAGE_MEDIUM, keys, path, [i])
        self.store_s += time.perf_counter() - start_s
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
        # NOTE: a writable buffer (the file backend reads into a bytearray) is viewed, not copied
        buf = payload if isinstance(payload, bytearray) else bytearray(payload)
        return torch.frombuffer(buf, dtype=torch.uint8).view(self.kv_pool.dtype).view(shape)

    # ---- load -----------------------------------------------------------------------------------
    def extend_match(self, tokens: Sequence[int], extra_key: Any, match: MatchResult, priority: int = 0,
                     make_room: Callable[[int], int] | None = None) -> MatchResult:
        """After the tree's hit `match` on `tokens` (the cacheable head only: never the last token), load the
        stored pages that follow into free slots, insert them into the tree and return the longer match.

        `make_room(n)`, where given, may evict from the tree (never this match) until `n` slots are free, and
        returns the slots free then: the load may then take evictable slots too, not only free ones.
        NOTE: without it only free slots are used: other waiting requests' unlocked matches may point at evictable
        tree slots between their match and their lock. The KVManager passes it only at admission, right before the
        request's lock, when no other unlocked match is in use (PrefillPlanner._admit matches each request again)."""
        t, m = self.page_tokens, len(match.device_indices)
        first, last = m // t, len(tokens) // t  # storage pages [first, last) could extend the match
        if first >= last or not (self.backend.enabled or self.host is not None):
            return match
        start_s = time.perf_counter()
        keys = self._keys(tokens, extra_key, last)[first:]
        reachable = self.allocator.available_size() + (self.tree.evictable_size() if make_room else 0)
        room = (reachable + m - first * t) // t  # NOTE: whole pages of free (or, with make_room, evictable) slots
        pages: list[torch.Tensor] = []
        from_host: list[bool] = []
        path = self._path(tokens, extra_key, range(first, last))  # NOTE: None without KV events
        for n, key in enumerate(keys[:max(room, 0)]):
            page = self._read_page(key, None if path is None else partial(self._announce, HOST_MEDIUM, keys, path, [n]))
            if page is None:
                break
            pages.append(page[0])
            from_host.append(page[1])
        end = (first + len(pages)) * t
        self.load_s += time.perf_counter() - start_s
        self._sync()
        if end <= m:
            return match
        if not self._wait_for_forwards():
            return match
        if make_room is not None:
            fit = (make_room(end - m) + m - first * t) // t  # NOTE: the match's own evictable slots stay
            pages, from_host = pages[:fit], from_host[:fit]
            end = (first + len(pages)) * t
            if end <= m:
                return match
        slots = self.allocator.alloc(end - m)
        if slots is None:
            return match
        start_s = time.perf_counter()
        pool, idx, skip = self.kv_pool, slots.to(self.kv_pool.device, torch.int64), m - first * t
        # NOTE: one layer at a time through a small reused buffer: a cat of whole pages along the token axis would
        # allocate (and page-fault) the whole prefix's KV again, about twice slower (benchmarks/bench_hicache_tiers.py)
        scratch = torch.empty((end - m, pool.head_num, pool.head_dim), dtype=pool.dtype)
        for layer in range(pool.layer_num):
            for side, buffer in ((0, pool.k_buffer[layer]), (1, pool.v_buffer[layer])):
                torch.cat([pages[0][side, layer, skip:]] + [page[side, layer] for page in pages[1:]], out=scratch)
                buffer[idx] = scratch.to(pool.device)
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
        host_tokens = t * sum(from_host) - (m - first * t if from_host[0] else 0)
        self.host_loaded_tokens += host_tokens
        self.storage_loaded_tokens += end - m - host_tokens
        self.load_calls += 1
        self.load_s += time.perf_counter() - start_s
        self._sync()
        # NOTE: the loaded tokens are device KV now; the per-tier lengths say where they came from
        return new._replace(host_hit_length=host_tokens, storage_hit_length=end - m - host_tokens)

    def _read_page(self, key: str, promoted: Callable[[], None] | None = None) -> tuple[torch.Tensor, bool] | None:
        """One page in the pool's dtype and whether it came from the host tier: host first, then storage (a page
        storage gives is promoted to host, then `promoted` is called: its KV event); None at the first miss or a
        corrupt page."""
        if self.host is not None:
            page = self.host.get(key)
            if page is not None:
                return page, True
        if not self.backend.enabled or not self.backend.exists(key):
            return None
        page = self._decode(self.backend.get(key) or b"")
        if page is None:
            self.backend.delete(key)
            if self.kv_events is not None:
                self.kv_events.tier_removed(STORAGE_MEDIUM, key)
            return None
        if self.host is not None and self.host.put(key, page) and promoted is not None:
            promoted()
        return page, False

    # ---- store ----------------------------------------------------------------------------------
    def on_insert(self, key: RadixKey, slots: torch.Tensor, chunked: bool = False) -> None:
        """write_through: `key` (page-aligned) was inserted into the tree and `slots` hold its KV; store every full
        storage page not stored yet.

        NOTE: a continuing chunk (`chunked`) is published at the start of the next step, while its forward may
        still run under the overlap loop: its KV is not read then. The insert after the request's last chunk (its
        result processed: all KV computed) stores every page from the first, so the chunks' pages too."""
        if self.write_policy != "write_through" or chunked or not self._storing:
            return
        last = len(key) // self.page_tokens
        if last:
            self._store_pages(self._keys(key.raw_token_ids, key.extra_key, last), slots[: last * self.page_tokens],
                              self._path(key.packed, key.extra_key, range(last)))

    def on_lock(self, tokens: Sequence[int], extra_key: Any, slots: torch.Tensor) -> None:
        """write_through_selective: a request was admitted with `slots` matched for `tokens`; count a hit on each
        full page and store the pages at their SELECTIVE_HITS-th hit."""
        if self.write_policy != "write_through_selective" or not self._storing:
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
            self._store_pages([keys[i] for i in due], torch.cat([slots[i * t:(i + 1) * t] for i in due]),
                              self._path(tokens, extra_key, due))

    def on_evict(self, node: TreeNode) -> None:
        """write_back: `node`, a leaf, is being evicted (its slots and its ancestors' are still valid): store the
        full storage pages that end inside it."""
        if not self._storing:
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
        self._store_pages(keys, slots[first * t:last * t], self._path(tokens, path[-1].key.extra_key, range(first, last)))


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
    host = make_host_tier(server_args, pool)
    return HiCacheController(backend, pool, allocator, tree, fingerprint, page_tokens, server_args.hicache_write_policy,
                             stats, host, tree.kv_events)


def make_host_tier(server_args: Any, pool: Any) -> HostKVTier | None:
    """The host tier `--hicache-size` / `--hicache-ratio` ask for (in front of the storage backend), or None."""
    from radixserve.mem_cache.host_tier import HOST_DTYPES, host_tier_bytes

    pool_bytes = pool.size * pool.bytes_per_token(pool.head_num, pool.head_dim, pool.layer_num, pool.dtype)
    capacity = host_tier_bytes(getattr(server_args, "hicache_size", 0), getattr(server_args, "hicache_ratio", 0),
                               pool_bytes)
    if not capacity:
        return None
    dtype = HOST_DTYPES[getattr(server_args, "hicache_host_dtype", "auto")]
    host = HostKVTier(capacity, pool.dtype, dtype)
    logger.info("hierarchical cache: host tier of %d bytes (%.2fx the KV pool), pages in %s", capacity,
                capacity / max(pool_bytes, 1), host.dtype)
    return host
