"""KVManager: the one owner of a request's KV, and ReqKV, the handle it keeps on each request.

The scheduler, its batches and its policy ask the manager; nothing else writes a `ReqKV` or a
`req_to_token` row. Behind it: the radix tree (`RadixCache`, which owns the slots in its nodes),
the allocator (which owns the free slots) and the request-to-token table. A request owns the slots
at its private row positions `[cache_protected_len, kv_allocated_len)`.

A request's KV goes through: `match_prefix` (waiting: an unlocked match) → `lock` (admitted) →
`alloc_extend` (a row, the matched slots and new ones written into it) → `commit` (a forward's
result was processed) → `cache_unfinished` (computed tokens published, still locked) →
`alloc_decode` … → `release` (finished: handed to the tree; retracted or aborted: freed). A speculative
verify step allocates its draft tokens' slots with `alloc_extend` and gives back the rejected ones with
`release_tail`.

A hybrid model (sliding-window layers, `SWARadixCache` over a `SWATokenToKVPoolAllocator`) adds a second
pool behind the same slots: each allocation takes a window slot per token, `_slide_windows` frees the window KV of
a request's own tokens that left its window, and each lock also takes a window lock (`ReqKV.window_lock`)
over the last W - 1 tokens of the locked path (docs/radix_cache.md, "Hybrid models").

Every change of who owns a request's slots is in this file: the tree (`RadixCache`) takes keys and
slots only, and `cache_unfinished_req` / `cache_finished_req` (SGLang's names, on its RadixCache) are
here, where the request's row is. What the manager reads of a request is `KVRequest`; `ReqKV`, `KVRequest` and
`TreePin` are defined in req_kv.py and re-exported here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from radixserve.mem_cache.radix_key import RadixKey
from radixserve.mem_cache.req_kv import KVRequest, ReqKV, TreePin
from radixserve.mem_cache.tiers import split_cached_tokens

if TYPE_CHECKING:
    from radixserve.mem_cache.allocator import TokenToKVPoolAllocator
    from radixserve.mem_cache.hicache import HiCacheController
    from radixserve.mem_cache.memory_pool import ReqToTokenPool
    from radixserve.mem_cache.radix_cache import MatchResult, RadixCache, TreeNode

__all__ = ["KVManager", "KVRequest", "ReqKV", "TreePin", "WINDOW_SLIDE_TOKENS"]


class KVManager:
    """The tree, the allocator and `req_to_token` behind one object; the only writer of `ReqKV`.

    `stats` (a SchedulerStats, optional) receives the evicted-token count and the time spent on
    cache operations.
    """

    def __init__(self, req_to_token_pool: ReqToTokenPool, allocator: TokenToKVPoolAllocator, tree_cache: RadixCache,
                 stats: Any = None, hicache: HiCacheController | None = None) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.tree_cache = tree_cache
        self.page_size = allocator.page_size
        self.stats = stats
        self.hicache = hicache  # the disk tier (hicache.py), None unless --enable-hierarchical-cache
        # NOTE: a hybrid model's window W (the tree declares it, tiers.py), None for a plain one: the one switch
        # for the window pool
        self.sliding_window: int | None = tree_cache.sliding_window
        # SessionPins.unpin_namespaces (session_cache.py), set by SessionPins; None: no sessions
        self.release_pins: Callable[[Callable[[Any], bool]], int] | None = None

    # ---- sizes ----------------------------------------------------------------------------------
    def available_size(self) -> int:
        return self.allocator.available_size()

    def evictable_size(self) -> int:
        return self.tree_cache.evictable_size()

    def free_and_evictable(self) -> int:
        return self.allocator.available_size() + self.tree_cache.evictable_size()

    def window_free_and_evictable(self) -> int:
        """Window slots free or held evictable by the tree (hybrid models only)."""
        return self.allocator.window_available_size() + self.tree_cache.window_evictable_size()

    def timing(self):
        return self.stats.timing("cache_ops_s") if self.stats is not None else nullcontext()

    # ---- before a row: match and lock -----------------------------------------------------------
    def match_prefix(self, req: KVRequest, evict_for_load: bool = False) -> int:
        """Match the cacheable head of `req.fill_ids` (see Req.prefix_match_limit); locks nothing.

        With the hierarchical cache, stored pages past the tree's hit are loaded: into free slots, or with
        `evict_for_load` also into slots evicted from the tree for them (never this match's own). NOTE: evicting
        may invalidate other requests' unlocked matches: pass it only right before this request is locked, when
        every other match in use is locked (PrefillPlanner._admit). The match is remembered on the handle and
        replaced by the next one; returns its length."""
        kv = req.kv
        assert kv.req_pool_idx is None and not kv.locked, f"{req!r} already holds KV"  # NOTE: waiting only
        tokens = req.fill_ids[: req.prefix_match_limit]
        match = self.tree_cache.match_prefix(RadixKey(tokens, req.extra_key))
        if self.hicache is not None:
            # NOTE: stored pages past the tree's hit are loaded and inserted: the tree owns them
            make_room = partial(self._room_for_load, match.last_node) if evict_for_load else None
            match = self.hicache.extend_match(tokens, req.extra_key, match, req.priority, make_room)
            kv.host_hit_len += match.host_hit_length
            kv.storage_hit_len += match.storage_hit_length
        kv.prefix_indices, kv.last_node = match.device_indices, match.last_node
        kv.cache_protected_len = len(match.device_indices)
        return kv.cache_protected_len

    def _room_for_load(self, node: TreeNode, num_tokens: int) -> int:
        """Evict the shortfall of `num_tokens` free slots for a load past the match ending at `node` (locked
        meanwhile, so the load's own prefix stays); returns the free slots."""
        mark = self._inc_lock(node)
        try:
            self.evict(num_tokens)
        finally:
            self._dec_lock(node, mark)
        return self.allocator.available_size()

    def cached_by_tier(self, kv: ReqKV, cached: int) -> dict[str, int] | None:
        """`cached` prefix tokens split by the tier that held them when matched ({"device", "host", "storage"},
        summing to `cached`); None without the hierarchical cache (the split is then all device)."""
        if self.hicache is None:
            return None
        return split_cached_tokens(cached, kv.host_hit_len, kv.storage_hit_len)

    def forget_match(self, req: KVRequest) -> None:
        """Drop a waiting request's unlocked match (after the tree was flushed)."""
        kv = req.kv
        assert not kv.locked and kv.req_pool_idx is None
        kv.prefix_indices, kv.last_node, kv.cache_protected_len = None, None, 0

    def lock(self, req: KVRequest) -> None:
        """Keep the matched prefix from eviction until the request releases its KV."""
        kv = req.kv
        assert not kv.locked
        kv.window_lock = self._inc_lock(kv.last_node)
        kv.locked = True
        if self.hicache is not None and kv.cache_protected_len:
            self.hicache.on_lock(req.fill_ids[: kv.cache_protected_len], req.extra_key, kv.prefix_indices)
        if self.sliding_window is not None and kv.cache_protected_len:
            self._check_window_of_match(kv)

    @contextmanager
    def locked_while(self, req: KVRequest) -> Iterator[None]:
        """Lock the match only for the block: its evictable tokens count as protected meanwhile."""
        node = req.kv.last_node
        mark = self._inc_lock(node)
        try:
            yield
        finally:
            self._dec_lock(node, mark)

    # ---- session pins (session_cache.py) --------------------------------------------------------
    def pin_prefix(self, tokens: Sequence[int], extra_key: Any, max_tokens: int) -> TreePin | None:
        """Lock the tree's node at the end of the cached head (at most `max_tokens`) of `tokens`; None if none of
        it is cached. NOTE: the pinned tokens stay tree-owned and count as protected until `unpin`."""
        tree = self.tree_cache
        if tree.disable or max_tokens <= 0:
            return None
        with self.timing():
            match = tree.match_prefix(tree.key_of(list(tokens[:max_tokens]), extra_key))
            if len(match.device_indices) == 0:
                return None
            return TreePin(match.last_node, self._inc_lock(match.last_node), len(match.device_indices))

    def unpin(self, pin: TreePin) -> None:
        """Release a pin_prefix lock."""
        self._dec_lock(pin.node, pin.window_mark)

    def _inc_lock(self, node: TreeNode) -> int | None:
        """Lock the path to `node` (and, hybrid, the window KV of its last W - 1 tokens); returns the window mark."""
        self.tree_cache.inc_lock_ref(node)
        return self.tree_cache.inc_window_lock(node) if self.sliding_window is not None else None

    def _dec_lock(self, node: TreeNode, window_mark: int | None) -> None:
        self.tree_cache.dec_lock_ref(node)
        if self.sliding_window is not None:
            self.tree_cache.dec_window_lock(node, window_mark)

    def _check_window_of_match(self, kv: ReqKV) -> None:
        """A locked match must still have the window KV its next token reads (nothing evicts between match and lock)."""
        cpl = kv.cache_protected_len
        needed = kv.prefix_indices[max(0, cpl - self.sliding_window + 1): cpl]
        if not bool(self.allocator.window_present(needed).all()):
            raise RuntimeError(f"a locked match of {cpl} tokens lost window KV it needs between match and lock")

    # ---- allocation -----------------------------------------------------------------------------
    def evict(self, num_tokens: int, window_tokens: int = 0) -> int:
        """Evict only the shortfall between `num_tokens` and what the allocator has free (hybrid: and tombstone
        the shortfall of `window_tokens` window slots); returns the full tokens evicted."""
        shortfall = num_tokens - self.allocator.available_size()
        evicted = 0
        if shortfall > 0 and not self.tree_cache.disable:
            with self.timing():
                evicted = self.tree_cache.evict(shortfall)
            if self.stats is not None:
                self.stats.evicted_tokens += evicted
        window_short = window_tokens - (self.allocator.window_available_size() if window_tokens else 0)
        if window_short > 0 and not self.tree_cache.disable:
            with self.timing():
                self.tree_cache.evict_window(window_short)
        return evicted

    def _slide_windows(self, kvs: Sequence[ReqKV]) -> None:
        """Hybrid: free the window KV of each request's own tokens that left its window for good.

        NOTE: only positions below kv_committed_len - W + 1: every forward launched or to come queries a position
        at or past kv_committed_len, so none reads them; the tree's positions are the tree's (window locks)."""
        window, table, pieces = self.sliding_window, self.req_to_token_pool.req_to_token, []
        for kv in kvs:
            if kv.req_pool_idx is None:
                continue
            lo = max(kv.window_freed_len, kv.cache_protected_len)
            hi = kv.kv_committed_len - window + 1
            if hi - lo >= WINDOW_SLIDE_TOKENS:
                pieces.append(table[kv.req_pool_idx, lo:hi])
                kv.window_freed_len = hi
        if pieces:
            self.allocator.free_window(torch.cat(pieces))

    def alloc_extend(self, reqs: Sequence[KVRequest], seq_lens: Sequence[int]) -> torch.Tensor:
        """Give each request a row (if it has none) and slots for positions [prefix_len, seq_len).

        The row gets the matched prefix's slots, then the new ones; returns the new slots of all
        requests, flat in request order (the forward's `out_cache_loc`).
        """
        kvs = [r.kv for r in reqs]
        prefix_lens = [kv.prefix_len for kv in kvs]
        extend_num = sum(seq_lens) - sum(prefix_lens)
        if self.sliding_window is not None:
            self._slide_windows(kvs)
        new = [kv for kv in kvs if kv.req_pool_idx is None]
        rows = self.req_to_token_pool.alloc(len(new)) if new else []
        if rows is None:
            raise RuntimeError(f"no free request row for {len(new)} request(s): the admission budget was wrong")
        try:
            out = self._alloc_extend_slots(kvs, prefix_lens, seq_lens, extend_num)
        except RuntimeError:
            if rows:
                self.req_to_token_pool.free(rows)  # NOTE: a failed allocation leaks nothing
            raise
        table = self.req_to_token_pool.req_to_token
        for kv, row in zip(new, rows, strict=True):
            kv.req_pool_idx = row
            if kv.cache_protected_len:
                table[row, : kv.cache_protected_len] = kv.prefix_indices
            kv.prefix_indices = None
        offset = 0
        for kv, pre, seq in zip(kvs, prefix_lens, seq_lens, strict=True):
            table[kv.req_pool_idx, pre:seq] = out[offset : offset + seq - pre]
            offset += seq - pre
            kv.kv_allocated_len = seq
        return out

    def _alloc_extend_slots(self, kvs: list[ReqKV], prefix_lens: list[int], seq_lens: Sequence[int],
                            extend_num: int) -> torch.Tensor:
        window = extend_num if self.sliding_window is not None else 0
        if self.page_size == 1:
            self.evict(extend_num, window)
            out = self.allocator.alloc(extend_num)
        else:
            # NOTE: one extra page per request over-estimates a partial page's needs (as SGLang does).
            self.evict(extend_num + len(kvs) * self.page_size, window)
            last_loc = [self._slot_at(kv, pre - 1) for kv, pre in zip(kvs, prefix_lens, strict=True)]
            out = self.allocator.alloc_extend(prefix_lens, seq_lens, last_loc, extend_num)
        if out is None:
            raise self._out_of_memory("prefill", extend_num)
        return out

    def _slot_at(self, kv: ReqKV, position: int) -> int:
        """The slot of a prefix position (-1 for none): from the match before a row exists, else the row."""
        if position < 0:
            return -1
        if kv.req_pool_idx is None:
            return int(kv.prefix_indices[position])
        return int(self.req_to_token_pool.req_to_token[kv.req_pool_idx, position])

    def alloc_decode(self, reqs: Sequence[KVRequest]) -> torch.Tensor:
        """One slot per request, for the token it feeds next, at row position `kv_allocated_len`."""
        kvs = [r.kv for r in reqs]
        positions = [kv.kv_allocated_len for kv in kvs]
        window = len(kvs) if self.sliding_window is not None else 0
        if window:
            self._slide_windows(kvs)
        if self.page_size == 1:
            self.evict(len(kvs), window)
            out = self.allocator.alloc(len(kvs))
        else:
            self.evict(len(kvs) * self.page_size, window)
            last_loc = [self._slot_at(kv, pos - 1) for kv, pos in zip(kvs, positions, strict=True)]
            out = self.allocator.alloc_decode([pos + 1 for pos in positions], last_loc)
        if out is None:
            raise self._out_of_memory("decode", len(kvs))
        table = self.req_to_token_pool.req_to_token
        table[_index([kv.req_pool_idx for kv in kvs], table), _index(positions, table)] = out
        for kv in kvs:
            kv.kv_allocated_len += 1
        return out

    def slots_needed(self, reqs: Sequence[KVRequest], counts: Sequence[int]) -> int:
        """Free slots that `counts[i]` more tokens for each request take (whole pages beyond its last one)."""
        if self.page_size == 1:
            return sum(counts)
        pages = self._page_ceil
        return sum(pages(r.kv.kv_allocated_len + n) - pages(r.kv.kv_allocated_len) for r, n in zip(reqs, counts,
                                                                                                   strict=True))

    def _page_ceil(self, positions: int) -> int:
        return -(-positions // self.page_size) * self.page_size

    def can_allocate(self, reqs: Sequence[KVRequest], counts: Sequence[int]) -> bool:
        """Evict the shortfall, then say whether `counts[i]` more tokens for each request fit."""
        needed = self.slots_needed(reqs, counts)
        if self.sliding_window is None:
            self.evict(needed)
            return self.allocator.available_size() >= needed
        window = sum(counts)  # NOTE: one window slot per token, whatever the page size
        self._slide_windows([r.kv for r in reqs])
        self.evict(needed, window)
        return self.allocator.available_size() >= needed and self.allocator.window_available_size() >= window

    def can_decode(self, reqs: Sequence[KVRequest]) -> bool:
        """Evict the shortfall, then say whether the next decode step of `reqs` (one token each) fits: one slot per
        request, or a page per request at a page start."""
        return self.can_allocate(reqs, [1] * len(reqs))

    def _out_of_memory(self, what: str, num_tokens: int) -> RuntimeError:
        return RuntimeError(f"out of KV memory allocating {num_tokens} {what} slot(s) "
                            f"({self.tree_cache.available_and_evictable_str()}); the admission budget was wrong")

    # ---- after a forward ------------------------------------------------------------------------
    def commit(self, req: KVRequest, computed_len: int) -> None:
        """A forward that wrote KV up to `computed_len` has had its result processed."""
        req.kv.kv_committed_len = computed_len

    def release_tail(self, req: KVRequest, keep_len: int) -> None:
        """Keep the request's first `keep_len` row positions and free what it allocated beyond them (a verify
        step's rejected draft tokens). With pages, a page that still holds a kept position stays with the request.

        NOTE: only private positions are freed: `keep_len` is at least its committed tokens."""
        kv = req.kv
        assert kv.cache_protected_len <= keep_len <= kv.kv_allocated_len, (keep_len, kv)
        row = self.req_to_token_pool.req_to_token[kv.req_pool_idx]
        first_free = self._page_ceil(keep_len)
        if first_free < kv.kv_allocated_len:
            self._free_row(row, [(first_free, kv.kv_allocated_len)])
        kept_tail = min(first_free, kv.kv_allocated_len)
        if self.sliding_window is not None and keep_len < kept_tail:
            # NOTE: hybrid: the kept page's slots past keep_len stay with the request, but the tokens they held are
            # gone; their window KV must go too, or the next allocation of the same slots maps new window slots over
            # it and leaks it (found with n-gram drafts on Gemma 3, page size 4)
            self.allocator.free_window(row[keep_len:kept_tail])
        kv.kv_allocated_len = keep_len

    def cache_unfinished_req(self, req: KVRequest, chunked: bool = False) -> None:
        """Publish a running request's computed tokens (`fill_ids`) in the tree, keeping them locked.

        Inserts the page-aligned prefix, frees the request's duplicates `[cache_protected_len, prefix_len)`
        (the tree held those tokens already), points the row at the tree's slots, locks the new last node
        and unlocks the old one. With the cache disabled nothing is published."""
        tree = self.tree_cache
        if tree.disable:
            return
        kv = req.kv
        with self.timing():
            row = self.req_to_token_pool.req_to_token[kv.req_pool_idx]
            key = tree.key_of(req.fill_ids, req.extra_key)
            prefix_len = tree.insert(key, row[: len(key)], req.priority, chunked=chunked)
            if self.hicache is not None:  # NOTE: before the duplicates are freed (a chunk's KV may be in flight)
                self.hicache.on_insert(key, row[: len(key)], chunked)
            _check_protected_prefix(kv, prefix_len)
            self._free_row(row, [(kv.cache_protected_len, prefix_len)])
            match = self._rematch(key)
            # NOTE: the row must name the tree's slots before anything is allocated again, or a live row
            # would reference the duplicates just freed.
            row[kv.cache_protected_len: len(key)] = match.device_indices[kv.cache_protected_len:]
            mark = self._inc_lock(match.last_node)
            if kv.locked:
                self._dec_lock(kv.last_node, kv.window_lock)
            kv.cache_protected_len, kv.last_node, kv.locked, kv.window_lock = len(key), match.last_node, True, mark

    def _rematch(self, key: RadixKey) -> MatchResult:
        match = self.tree_cache.match_prefix(key)
        if len(match.device_indices) != len(key):
            raise RuntimeError(f"re-match found {len(match.device_indices)} of {len(key)} just-inserted tokens")
        return match

    def cache_finished_req(self, req: KVRequest, is_insert: bool = True) -> None:
        """Hand a finished request's KV to the tree (with is_insert=False, a retracted or aborted one's: none).

        Inserts the page-aligned first `kv_committed_len` tokens, frees the request's duplicates
        `[cache_protected_len, prefix_len)` and everything else it holds privately (the unaligned tail and
        any slot allocated beyond the committed tokens), and unlocks; then frees the row."""
        kv, tree = req.kv, self.tree_cache
        row = self.req_to_token_pool.req_to_token[kv.req_pool_idx]
        cpl, allocated = kv.cache_protected_len, kv.kv_allocated_len
        # NOTE: [0, cpl) are tree slots the request only referenced; they stay.
        to_free = [(cpl, allocated)]
        if is_insert and not tree.disable:
            key = tree.key_of(_prefix_of(req.origin_input_ids, req.output_ids, kv.kv_committed_len), req.extra_key)
            prefix_len = tree.insert(key, row[: len(key)], req.priority)
            if self.hicache is not None:
                self.hicache.on_insert(key, row[: len(key)])
            _check_protected_prefix(kv, prefix_len)
            to_free = [(cpl, prefix_len), (len(key), allocated)]  # [prefix_len, len(key)) went to the tree
        self._free_row(row, to_free)
        if kv.locked:
            self._dec_lock(kv.last_node, kv.window_lock)
        self.req_to_token_pool.free(kv.req_pool_idx)

    def _free_row(self, row: torch.Tensor, ranges: list[tuple[int, int]]) -> None:
        """Free the slots at these row positions in one call, so that each page is freed once."""
        pieces = [row[lo:hi] for lo, hi in ranges if hi > lo]
        if pieces:
            self.allocator.free(pieces[0] if len(pieces) == 1 else torch.cat(pieces))

    def release(self, req: KVRequest, insert: bool) -> None:
        """Give up all of the request's KV: hand it to the tree (finished) or free it (retracted, aborted)."""
        kv = req.kv
        with self.timing():
            if kv.req_pool_idx is not None:
                self.cache_finished_req(req, is_insert=insert)
            elif kv.locked:
                self._dec_lock(kv.last_node, kv.window_lock)
        req.kv = ReqKV()

    def drop_namespaces(self, match: Callable[[Any], bool]) -> int:
        """Frees the cached KV of every namespace `match` selects (no request may hold any of it: the caller
        checks); returns the tokens freed. Agent sessions' pins in those namespaces are released first."""
        with self.timing():
            if self.release_pins is not None:  # NOTE: a pinned node is locked, and the tree refuses to drop it
                self.release_pins(match)
            return self.tree_cache.drop_namespaces(match)

    def flush(self) -> int:
        """Empty the tree (only when no request holds KV: the caller checks); returns the tokens freed."""
        freed = self.tree_cache.evict(self.tree_cache.evictable_size())
        self.tree_cache.reset()
        return freed


# NOTE: a request's out-of-window KV is freed in runs of at least this many tokens (one free call per run, not
# per step), so it holds at most W + WINDOW_SLIDE_TOKENS window slots of its own while it decodes.
WINDOW_SLIDE_TOKENS = 16


def _check_protected_prefix(kv: ReqKV, prefix_len: int) -> None:
    if prefix_len < kv.cache_protected_len:
        raise RuntimeError(f"request's protected prefix ({kv.cache_protected_len} tokens) is no longer in the tree "
                           f"(found {prefix_len}); was the cache reset while it ran?")


def _prefix_of(origin: Sequence[int], output: Sequence[int], length: int) -> Sequence[int]:
    """(origin + output)[:length], without a list copy when both are array('q')."""
    if type(origin) is type(output):
        return (origin + output)[:length]  # type: ignore[operator]
    return (list(origin) + list(output))[:length]


def _index(values: list[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=like.device)
