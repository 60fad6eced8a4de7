"""The radix tree of a hybrid (sliding-window) model: nodes whose window KV may be gone (tombstones).

A node's `value` holds full slots as in `RadixCache`; whether each token still has window KV is the allocator's
`full_to_window` (swa_memory.py), and `node.window_len` counts the node's tokens that have it. What changes:

- `match_prefix` backs off from the longest cached prefix to the longest whole-page m whose positions
  m - W + 1 .. m - 1 all have window KV: exactly what the next token's window layers read (the oracle is
  `reference.longest_hybrid_prefix`). The rest of the path stays for the full layers of later matches.
- Locks: `inc_lock_ref` protects the full KV of the whole path, as before; `inc_window_lock` protects the window
  KV of the path's last W - 1 tokens only, the part a request holding that node will read. The top node of that
  range carries a mark that the unlock walk stops at; a split moves the mark to the upper half (which copies
  the lock count), so the walk still ends where the count was taken.
- Eviction: `evict` removes whole leaves (their window KV goes with their full KV, in the allocator's `free`);
  `evict_window` tombstones the window KV of nodes no window lock covers, by the eviction policy's order,
  without touching full KV.
- `insert` of tokens the tree already holds revives tombstoned window KV from the caller's copy
  (`transfer_window`), so a request that recomputed a tombstoned prefix keeps reading its window KV.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable
from typing import Any

import torch

from radixserve.mem_cache.kv_events import make_kv_events
from radixserve.mem_cache.radix_cache import MatchResult, RadixCache, TreeNode
from radixserve.mem_cache.radix_key import RadixKey
from radixserve.mem_cache.tiers import WINDOW_TIER

__all__ = ["SWARadixCache", "make_tree_cache", "usable_window_prefix"]


def make_tree_cache(req_to_token_pool: Any, allocator: Any, page_size: int, server_args: Any,
                    sliding_window: int | None) -> RadixCache:
    """The scheduler's tree: a `SWARadixCache` over a hybrid pool (`sliding_window` set), else a `RadixCache`."""
    options = {"disable": server_args.disable_radix_cache, "eviction_policy": server_args.radix_eviction_policy}
    if sliding_window is None:
        tree = RadixCache(req_to_token_pool, allocator, page_size, **options)
    else:
        tree = SWARadixCache(req_to_token_pool, allocator, page_size, sliding_window, **options)
    tree.kv_events = make_kv_events(server_args, tree)  # NOTE: None unless --kv-events-config publishes
    return tree


def usable_window_prefix(present: torch.Tensor, page_size: int, window: int) -> int:
    """Longest page-aligned m <= len(present) with present[max(0, m - window + 1) : m] all True."""
    missing = torch.nonzero(~present).flatten().tolist()
    m = len(present) // page_size * page_size
    while m > 0:
        last = bisect.bisect_left(missing, m) - 1  # the last tombstone before m
        if last < 0 or missing[last] < m - window + 1:
            return m
        m = missing[last] // page_size * page_size
    return 0


class SWARadixCache(RadixCache):
    """`RadixCache` for a model with sliding-window layers (window `sliding_window`, the largest of its layers)
    over a `SWATokenToKVPoolAllocator`. The bigram (EAGLE) view is not supported here."""

    def __init__(self, req_to_token_pool: Any, token_to_kv_pool_allocator: Any, page_size: int = 1,
                 sliding_window: int = 1, disable: bool = False, eviction_policy: str = "lru") -> None:
        if token_to_kv_pool_allocator is None or not token_to_kv_pool_allocator.is_hybrid:
            raise ValueError("SWARadixCache needs a hybrid allocator (SWATokenToKVPoolAllocator)")
        if sliding_window < 1:
            raise ValueError(f"sliding_window must be positive, got {sliding_window}")
        self.sliding_window = sliding_window
        self._marks = itertools.count(1)
        super().__init__(req_to_token_pool, token_to_kv_pool_allocator, page_size, disable, eviction_policy)

    def reset(self) -> None:
        super().reset()
        self.window_evictable_size_ = 0
        self.window_protected_size_ = 0

    def window_evictable_size(self) -> int:
        return self.window_evictable_size_

    def window_protected_size(self) -> int:
        return self.window_protected_size_

    def tier_lock_sizes(self, name: str) -> tuple[int, int]:
        if name == WINDOW_TIER:
            return self.window_evictable_size_, self.window_protected_size_
        return super().tier_lock_sizes(name)

    def node_tier_fields(self, node: TreeNode) -> dict[str, int]:
        """Tokens of the node with window KV, and its window locks."""
        return {"window": node.window_len, "window_locks": node.window_lock_ref}

    def total_window_size(self) -> int:
        """Window slots held by the tree, recounted from the allocator's table (independent of the counters)."""
        alloc = self.token_to_kv_pool_allocator
        return sum(alloc.window_count(node.value) for node in self._iter_nodes())

    # ------------------------------------------------------------------ match
    def match_prefix(self, key: RadixKey) -> MatchResult:
        match = super().match_prefix(key)
        cached = len(match.device_indices)
        if cached == 0:
            return match
        present = self.token_to_kv_pool_allocator.window_present(match.device_indices)
        usable = usable_window_prefix(present, self.page_size, self.sliding_window)
        if usable == cached:
            return match
        if usable == 0:
            return MatchResult(self._empty.device_indices, self.root_node)
        # NOTE: the longer match's split stays; this one splits the path where the usable prefix ends.
        return super().match_prefix(self._tree_key(key)[:usable])

    # ------------------------------------------------------------------ structure
    def _add_leaf(self, parent: TreeNode, tokens: bytes, extra_key: Any, value: torch.Tensor,
                  priority: int, chunked: bool, now: float) -> TreeNode:
        leaf = super()._add_leaf(parent, tokens, extra_key, value, priority, chunked, now)
        leaf.window_len = self.token_to_kv_pool_allocator.window_count(value)
        self.window_evictable_size_ += leaf.window_len
        return leaf

    def _split_node(self, child: TreeNode, split_len: int, now: float) -> TreeNode:
        upper = super()._split_node(child, split_len, now)
        upper.window_len = self.token_to_kv_pool_allocator.window_count(upper.value)
        child.window_len -= upper.window_len
        upper.window_lock_ref = child.window_lock_ref  # NOTE: same lock state: the counters stay exact
        upper.window_mark, child.window_mark = child.window_mark, None
        return upper

    def _delete_leaf(self, node: TreeNode) -> None:
        self.window_evictable_size_ -= node.window_len  # NOTE: an unlocked leaf has no window lock either
        super()._delete_leaf(node)

    def insert(self, key: RadixKey, value: torch.Tensor | None = None, priority: int = 0,
               chunked: bool = False) -> int:
        prefix_len = super().insert(key, value, priority, chunked)
        if prefix_len and value is not None and not self.disable:
            self._revive(self._tree_key(key), value, prefix_len)
        return prefix_len

    def _revive(self, key: RadixKey, value: torch.Tensor, prefix_len: int) -> None:
        """Move window KV from the caller's copy of the first `prefix_len` tokens to tree tokens that lack it."""
        alloc, tokens, node, pos = self.token_to_kv_pool_allocator, key.packed, self.root_node, 0
        while pos < prefix_len:
            node = node.children[self._child_key(tokens, pos, key.extra_key)]
            size = len(node.key)
            moved = alloc.transfer_window(value[pos : pos + size], node.value)
            if moved:
                self._change_window(node, moved)
            pos += size

    def _change_window(self, node: TreeNode, delta: int) -> None:
        node.window_len += delta
        if node.window_lock_ref:
            self.window_protected_size_ += delta
        else:
            self.window_evictable_size_ += delta

    # ------------------------------------------------------------------ window locks
    def inc_window_lock(self, node: TreeNode) -> int | None:
        """Protect the window KV of the last W - 1 tokens of the path to `node`; returns the mark for the unlock."""
        if self.disable or node is self.root_node:
            return None
        covered, need = 0, self.sliding_window - 1
        while True:
            node = self._trim_to(node, need - covered)
            if node.window_lock_ref == 0:
                self.window_evictable_size_ -= node.window_len
                self.window_protected_size_ += node.window_len
            node.window_lock_ref += 1
            covered += len(node.key)
            if covered >= need or node.parent is self.root_node:
                break
            node = node.parent
        if node.window_mark is None:
            node.window_mark = next(self._marks)
        return node.window_mark

    def _trim_to(self, node: TreeNode, tokens: int) -> TreeNode:
        """`node`, split so that its lower part holds about `tokens` (whole pages) when it is longer: a window lock
        then protects the window, not the rest of a long node (a prefill chunk is one node)."""
        keep = max(-(-tokens // self.page_size) * self.page_size, self.page_size)
        if len(node.key) > keep:
            self._split_node(node, len(node.key) - keep, self._now())
        return node

    def dec_window_lock(self, node: TreeNode, mark: int | None) -> None:
        """Release a window lock taken by `inc_window_lock(node)` (which returned `mark`)."""
        if mark is None or self.disable:
            return
        while True:
            if node is None or node is self.root_node:
                raise ValueError(f"window lock mark {mark} not found above the locked node")
            if node.window_lock_ref <= 0:
                raise ValueError(f"dec_window_lock on a node without a window lock {node!r}")
            node.window_lock_ref -= 1
            if node.window_lock_ref == 0:
                self.window_protected_size_ -= node.window_len
                self.window_evictable_size_ += node.window_len
            if node.window_mark == mark:
                if node.window_lock_ref == 0:
                    node.window_mark = None
                return
            node = node.parent

    # ------------------------------------------------------------------ eviction
    def evict_window(self, num_tokens: int) -> int:
        """Tombstone the window KV of nodes no window lock covers, policy order, until `num_tokens` window slots are
        freed (or none is left); full KV stays. Returns the window slots freed.

        NOTE: a walk and a sort of the candidates per call, O(n log n) in the tree's nodes; called only when the
        window pool is short."""
        if self.disable or num_tokens <= 0:
            return 0
        candidates = [n for n in self._iter_nodes() if n.window_len and n.window_lock_ref == 0]
        candidates.sort(key=lambda n: (self._eviction_key(n), n.id))
        alloc, freed = self.token_to_kv_pool_allocator, 0
        for node in candidates:
            if freed >= num_tokens:
                break
            count = alloc.free_window(node.value)
            self.window_evictable_size_ -= count
            node.window_len -= count
            freed += count
        return freed

    def drop_namespaces(self, match: Callable[[Any], bool]) -> int:
        stack = [c for c in self.root_node.children.values() if match(c.key.extra_key)]
        window = 0
        while stack:
            node = stack.pop()
            window += node.window_len
            stack.extend(node.children.values())
        freed = super().drop_namespaces(match)  # NOTE: raises, changing nothing, if one is locked
        self.window_evictable_size_ -= window
        return freed

    def available_and_evictable_str(self) -> str:
        alloc = self.token_to_kv_pool_allocator
        return (f"{super().available_and_evictable_str()}, window available={alloc.window_available_size()}, "
                f"window evictable={self.window_evictable_size_}, window protected={self.window_protected_size_}")
