"""RadixAttention's prefix cache: a radix tree over token ids whose nodes hold KV slot indices.

Ownership: a KV slot is either free (in the allocator), owned by the tree (in exactly one node's
`value`), or private to one request (row positions `[cache_protected_len, kv_allocated_len)` of its
`req_to_token` row). The tree frees a slot only when it evicts the node holding it. It knows keys and slots, not requests:
`insert` returns how much of a key it already held (the caller frees its duplicates), and the request
side of SGLang's `cache_finished_req` / `cache_unfinished_req` (which row positions to free, lock moves)
is `KVManager`'s (`kv_manager.py`), so every change of a request's slot ownership is in that one file.
"""

from __future__ import annotations

import heapq
import itertools
import math
import struct
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from radixserve.mem_cache.cache_events import CacheEventLog
from radixserve.mem_cache.evict_policy import get_eviction_key
from radixserve.mem_cache.memory_pool import SLOT_DTYPE
from radixserve.mem_cache.radix_key import RadixKey, common_prefix_len
from radixserve.mem_cache.tiers import MatchResult, TieredCache

if TYPE_CHECKING:
    from radixserve.mem_cache.kv_events import KVEventSink

__all__ = ["MatchResult", "RadixCache", "RadixKey", "TreeNode"]

_node_ids = itertools.count()


class TreeNode:
    """One edge of the tree: `key` (tokens from the parent) and `value` (one KV slot per token)."""

    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access_time",
                 "creation_time", "hit_count", "priority", "id", "in_heap", "window_len", "window_lock_ref",
                 "window_mark")

    def __init__(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.children: dict[Any, TreeNode] = {}
        self.parent: TreeNode | None = None
        self.key: RadixKey | None = None
        self.value: torch.Tensor | None = None
        self.lock_ref = 0
        self.last_access_time = now
        self.creation_time = now
        self.hit_count = 0
        self.priority = 0
        self.id = next(_node_ids)
        self.in_heap = False  # NOTE: at most one eviction-heap entry per node
        # a hybrid tree's (swa_radix_cache.py): tokens with window KV, window locks, the lock-boundary mark
        self.window_len = 0
        self.window_lock_ref = 0
        self.window_mark: int | None = None

    def __repr__(self) -> str:
        size = 0 if self.key is None else len(self.key)
        return f"TreeNode(id={self.id}, len={size}, lock_ref={self.lock_ref})"


class RadixCache(TieredCache):
    """The radix tree cache. Usable with no pools (tests): then eviction frees nothing.

    `page_size` > 1 makes every key, match and node a whole number of pages. With `disable=True`
    nothing is cached: matches are empty, inserts return 0, locks and eviction do nothing,
    `cache_unfinished_req` publishes nothing (a chunked request keeps its own row as its prefix)
    and `cache_finished_req` frees the request's private KV.

    `is_eagle=True` keys the tree by the EAGLE bigram view (`RadixKey.to_bigram`): every key passed
    in is converted, and the slot of position i stands for the pair (t[i], t[i+1]). Set `events` to
    a `CacheEventLog` to record what the tree does (None, the default, records nothing).
    """

    def __init__(self, req_to_token_pool: Any = None, token_to_kv_pool_allocator: Any = None,
                 page_size: int = 1, disable: bool = False, eviction_policy: str = "lru",
                 is_eagle: bool = False) -> None:
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.page_size = page_size
        self.disable = disable
        self.is_eagle = is_eagle
        self.events: CacheEventLog | None = None
        # called with each leaf `evict` removes, before its slots are freed (the disk tier's write_back)
        self.evict_hook: Callable[[TreeNode], None] | None = None
        # KV events for a router (kv_events.py, --kv-events-config): told what blocks the tree stores and removes
        self.kv_events: KVEventSink | None = None
        self.eviction_policy = eviction_policy
        self._eviction_key = get_eviction_key(eviction_policy)
        self._page_struct = struct.Struct(f"{page_size}q")  # unpacks one page: a child key
        self.device = getattr(token_to_kv_pool_allocator, "device", torch.device("cpu"))
        self._last_time = -math.inf
        self.reset()

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        """Forget every node (frees nothing: the caller clears the allocator too)."""
        self.root_node = TreeNode(self._now())
        self.root_node.key = RadixKey(())
        self.root_node.value = torch.empty(0, dtype=SLOT_DTYPE, device=self.device)
        self.root_node.lock_ref = 1  # NOTE: the root is locked forever, so it is never evicted
        self.root_node.priority = -sys.maxsize
        self.evictable_size_ = 0
        self.protected_size_ = 0
        self.evictable_leaves: set[TreeNode] = set()
        self._heap: list[tuple[Any, int, TreeNode]] = []
        self._empty = MatchResult(self.root_node.value, self.root_node)
        if self.events is not None:
            self.events.record("reset", None, None, 0)
        if self.kv_events is not None:
            self.kv_events.cleared()

    def _now(self) -> float:
        # NOTE: strictly increasing between operations, so LRU order never depends on clock ties.
        now = time.monotonic()
        if now <= self._last_time:
            now = math.nextafter(self._last_time, math.inf)
        self._last_time = now
        return now

    def evictable_size(self) -> int:
        return self.evictable_size_

    def protected_size(self) -> int:
        return self.protected_size_

    def total_size(self) -> int:
        """Tokens held by the tree, recounted by a walk (independent of the two counters)."""
        return sum(len(node.value) for node in self._iter_nodes())

    def node_count(self) -> int:
        return sum(1 for _ in self._iter_nodes())

    def _iter_nodes(self):
        stack = list(self.root_node.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def all_values_flatten(self) -> torch.Tensor:
        values = [node.value for node in self._iter_nodes()]
        return torch.cat(values) if values else self.root_node.value.clone()

    # ------------------------------------------------------------------ match
    def match_prefix(self, key: RadixKey) -> MatchResult:
        """Longest cached page-aligned prefix of `key`; splits the edge it ends inside; locks nothing.

        `device_indices` may share storage with a node's value: read it, never write into it.
        """
        key = self._tree_key(key)
        if self.disable or len(key) < self.page_size:
            return self._empty
        tokens = key.page_aligned(self.page_size).packed
        values, node = self._match_helper(tokens, key.extra_key)
        if not values:
            return MatchResult(self._empty.device_indices, node)
        indices = values[0] if len(values) == 1 else torch.cat(values)
        if self.events is not None:
            self.events.record("match", node.id, key.extra_key, len(indices), len(key))
        return MatchResult(indices, node)

    def _tree_key(self, key: Any) -> RadixKey:
        """`key` as this tree files it: a RadixKey, in the bigram view when the tree is EAGLE's."""
        if not isinstance(key, RadixKey):
            key = RadixKey(key)
        if key.is_bigram != self.is_eagle:
            if not self.is_eagle:
                raise ValueError("a bigram key needs a RadixCache(is_eagle=True)")
            key = key.to_bigram()
        return key

    def _child_key(self, tokens: bytes, pos: int, extra_key: Any) -> Any:
        # NOTE: same value as RadixKey.child_key (pretty_print asserts it); a full page is always there
        plain = self._page_struct.unpack_from(tokens, pos * 8)
        if self.page_size == 1:
            plain = plain[0]
        return plain if extra_key is None else (extra_key, plain)

    def _match_helper(self, tokens: bytes, extra_key: Any) -> tuple[list[torch.Tensor], TreeNode]:
        now = self._now()
        ps = self.page_size
        node = self.root_node
        node.last_access_time = now
        values: list[torch.Tensor] = []
        pos, end = 0, len(tokens) // 8
        while pos < end:
            child = node.children.get(self._child_key(tokens, pos, extra_key))
            if child is None:
                break
            child.last_access_time = now
            edge = child.key.packed
            matched = common_prefix_len(edge, tokens, pos) // ps * ps
            if matched * 8 < len(edge):
                node = self._split_node(child, matched, now)
                values.append(node.value)
                break
            values.append(child.value)
            node = child
            pos += matched
        return values, node

    def _split_node(self, child: TreeNode, split_len: int, now: float) -> TreeNode:
        """Cut `child`'s edge after `split_len` tokens; returns the new upper node."""
        upper = TreeNode(now)
        upper.key = child.key[:split_len]
        upper.value = child.value[:split_len].clone()
        # NOTE: copying lock_ref keeps evictable/protected counters exact without any update.
        upper.lock_ref = child.lock_ref
        upper.priority = child.priority
        upper.hit_count = child.hit_count
        upper.parent = child.parent
        lower_key = child.key[split_len:]
        upper.children = {lower_key.child_key(self.page_size): child}
        upper.parent.children[child.key.child_key(self.page_size)] = upper
        child.parent = upper
        child.key = lower_key
        child.value = child.value[split_len:].clone()
        if self.events is not None:
            self.events.record("split", upper.id, upper.key.extra_key, split_len, child.id)
        return upper

    # ------------------------------------------------------------------ insert
    def insert(self, key: RadixKey, value: torch.Tensor | None = None, priority: int = 0,
               chunked: bool = False) -> int:
        """Insert `key` -> `value`; returns how many leading tokens were already cached.

        The tree keeps its own slots for those tokens: the caller must free its duplicates
        `value[:prefix_len]` (beyond what it already shared). `value=None` stores the token ids.
        """
        key = self._tree_key(key)
        if self.disable:
            return 0
        key = key.page_aligned(self.page_size)
        if value is None:
            value = torch.tensor(key.raw_token_ids[:len(key)], dtype=SLOT_DTYPE)
        elif len(value) < len(key):
            raise ValueError(f"insert: {len(value)} values for a key of {len(key)} tokens")
        return self._insert_helper(key.packed, key.extra_key, value, priority, chunked)

    def _insert_helper(self, tokens: bytes, extra_key: Any, value: torch.Tensor,
                       priority: int, chunked: bool) -> int:
        now = self._now()
        ps = self.page_size
        node = self.root_node
        node.last_access_time = now
        node.priority = max(node.priority, priority)
        pos, end = 0, len(tokens) // 8
        while pos < end:
            child = node.children.get(self._child_key(tokens, pos, extra_key))
            if child is None:
                break
            child.last_access_time = now
            matched = common_prefix_len(child.key.packed, tokens, pos) // ps * ps
            if matched * 8 < len(child.key.packed):
                child = self._split_node(child, matched, now)
            child.priority = max(child.priority, priority)
            if not chunked:  # NOTE: a request's own chunks must not inflate LFU counts
                child.hit_count += 1
            node = child
            pos += matched
        if pos < end:
            node = self._add_leaf(node, tokens[pos * 8:], extra_key, value[pos:end].clone(), priority, chunked, now)
        if self.events is not None:
            self.events.record("insert", node.id, extra_key, end - pos, pos)
        if self.kv_events is not None and pos < end:
            self.kv_events.stored(tokens[:end * 8], extra_key, pos, end)
        return pos

    def _add_leaf(self, parent: TreeNode, tokens: bytes, extra_key: Any, value: torch.Tensor,
                  priority: int, chunked: bool, now: float) -> TreeNode:
        leaf = TreeNode(now)
        leaf.key = RadixKey._trusted(tokens, extra_key, self.is_eagle)
        leaf.value = value
        leaf.parent = parent
        leaf.priority = priority
        leaf.hit_count = 0 if chunked else 1
        parent.children[leaf.key.child_key(self.page_size)] = leaf
        self.evictable_size_ += len(leaf.key)
        self._update_leaf_status(parent)
        self._update_leaf_status(leaf)
        return leaf

    # ------------------------------------------------------------------ locks
    def _path_to_root(self, node: TreeNode) -> list[TreeNode]:
        path = []
        while node is not self.root_node:
            if node is None:
                raise ValueError("node is not in this cache (evicted, reset, or from another tree)")
            path.append(node)
            node = node.parent
        return path

    def inc_lock_ref(self, node: TreeNode) -> int:
        """Protect `node` and its ancestors from eviction; returns the change of evictable size."""
        if self.disable:
            return 0
        delta = 0
        for n in self._path_to_root(node):
            n.lock_ref += 1
            if n.lock_ref == 1:
                size = len(n.key)
                self.evictable_size_ -= size
                self.protected_size_ += size
                delta -= size
                self._update_leaf_status(n)
        if self.events is not None:
            self.events.record("lock", node.id, node.key.extra_key, -delta, node.lock_ref)
        return delta

    def dec_lock_ref(self, node: TreeNode) -> int:
        """Release one lock on `node` and its ancestors; returns the change of evictable size."""
        if self.disable:
            return 0
        path = self._path_to_root(node)
        if path and path[0].lock_ref <= 0:
            raise ValueError(f"dec_lock_ref on an unlocked node {path[0]!r}")
        delta = 0
        for n in path:
            n.lock_ref -= 1
            if n.lock_ref == 0:
                size = len(n.key)
                self.evictable_size_ += size
                self.protected_size_ -= size
                delta += size
                self._update_leaf_status(n)
        if self.events is not None:
            self.events.record("unlock", node.id, node.key.extra_key, delta, node.lock_ref)
        return delta

    # ------------------------------------------------------------------ eviction
    def _update_leaf_status(self, node: TreeNode) -> None:
        if node is self.root_node:
            return
        if node.lock_ref == 0 and not node.children:
            if node not in self.evictable_leaves:
                self.evictable_leaves.add(node)
                if not node.in_heap:
                    self._push(node)
        else:
            self.evictable_leaves.discard(node)

    def _push(self, node: TreeNode) -> None:
        node.in_heap = True
        heapq.heappush(self._heap, (self._eviction_key(node), node.id, node))

    def evict(self, num_tokens: int) -> int:
        """Evict whole unlocked leaves, lowest policy key first, until `num_tokens` are freed.

        Returns the tokens freed (may overshoot by part of a node). Cost O(k log n) for k nodes:
        the heap persists between calls; stale entries (node locked, grown, or touched since it
        was pushed) are dropped or re-pushed with the fresh key when they reach the top.
        """
        if self.disable or num_tokens <= 0:
            return 0
        evicted = 0
        freed: list[torch.Tensor] = []
        victims: list[tuple[int, int, Any, int]] = []
        heap, leaves, eviction_key = self._heap, self.evictable_leaves, self._eviction_key
        while evicted < num_tokens and heap:
            entry_key, _, node = heapq.heappop(heap)
            node.in_heap = False
            if node not in leaves:
                continue
            if eviction_key(node) != entry_key:
                self._push(node)
                continue
            freed.append(node.value)
            evicted += len(node.key)  # NOTE: == len(node.value), without a tensor call
            if self.events is not None:
                victims.append((node.id, len(node.key), node.key.extra_key, node.parent.id))
            if self.evict_hook is not None:
                self.evict_hook(node)  # NOTE: before _delete_leaf: the hook walks the node's path to the root
            if self.kv_events is not None:
                self.kv_events.removed(node)
            self._delete_leaf(node)
        if freed and self.token_to_kv_pool_allocator is not None:
            self.token_to_kv_pool_allocator.free(torch.cat(freed))
        if self.events is not None and victims:
            self.events.record("evict", None, None, evicted, (num_tokens, victims))
        return evicted

    def drop_namespaces(self, match: Callable[[Any], bool]) -> int:
        """Frees the whole subtree of every namespace whose `extra_key` satisfies `match` (an unloaded LoRA
        adapter's KV); returns the tokens freed. Raises, changing nothing, if one of those nodes is locked.

        NOTE: namespaces partition the tree below the root, so each is a set of the root's subtrees."""
        tops = [c for c in self.root_node.children.values() if match(c.key.extra_key)]
        nodes, stack = [], list(tops)
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children.values())
        if any(node.lock_ref for node in nodes):
            raise RuntimeError("a namespace to drop is locked by a running request")
        if self.kv_events is not None:
            for node in nodes:  # NOTE: before the nodes are unlinked: the sink walks each one's path
                self.kv_events.removed(node)
        for top in tops:
            del self.root_node.children[top.key.child_key(self.page_size)]
        freed = sum(len(node.key) for node in nodes)
        victims = [(n.id, len(n.key), n.key.extra_key, n.parent.id) for n in nodes]
        for node in nodes:
            self.evictable_leaves.discard(node)
            node.parent = None
        self.evictable_size_ -= freed
        if nodes and self.token_to_kv_pool_allocator is not None:
            self.token_to_kv_pool_allocator.free(torch.cat([node.value for node in nodes]))
        if self.events is not None and nodes:
            self.events.record("evict", None, None, freed, (freed, victims))
        return freed

    def _delete_leaf(self, node: TreeNode) -> None:
        parent = node.parent
        del parent.children[node.key.child_key(self.page_size)]
        self.evictable_size_ -= len(node.key)
        self.evictable_leaves.discard(node)
        node.parent = None
        self._update_leaf_status(parent)

    # ------------------------------------------------------------------ keys of requests
    def key_of(self, tokens: Any, extra_key: Any) -> RadixKey:
        """The page-aligned key under which a request's tokens are published (bigram view with `is_eagle`).

        NOTE: SGLang's cache_finished_req / cache_unfinished_req are KVManager's here: they decide which
        of a request's slots to free, so the tree only takes keys and slots (insert, match_prefix, locks)."""
        return RadixKey(tokens, extra_key, self.is_eagle).page_aligned(self.page_size)

    # ------------------------------------------------------------------ debug
    def pretty_print(self, max_tokens: int | None = 10, tokenizer: Any = None, reveal_namespace: bool = False,
                     events: int = 0) -> str:
        """Depth-first dump (also printed); asserts every child is filed under its own child key.

        Each node shows its namespace (kind and a short hash; the value too with `reveal_namespace`),
        length, lock_ref, evictable or protected, hit count, seconds since last access and its first
        `max_tokens` tokens (None: all), decoded when a `tokenizer` is given. `events` > 0 appends
        that many recent events when the tree records them.
        """
        from radixserve.mem_cache.cache_view import NamespaceLabels, format_events, format_tree, tree_snapshot

        stack = [self.root_node]
        while stack:
            node = stack.pop()
            for child_key, child in node.children.items():
                assert child.key.child_key(self.page_size) == child_key, (child_key, child)
                stack.append(child)
        snapshot = tree_snapshot(self, NamespaceLabels(reveal=reveal_namespace), max_nodes=None,
                                 max_tokens=max_tokens, max_events=events or None)
        texts = None
        if tokenizer is not None:
            texts = {n["id"]: tokenizer.decode(n["tokens"]) for n in snapshot["nodes"] if n["parent"] is not None}
        text = format_tree(snapshot, texts)
        if events > 0 and snapshot["events"]:
            text += "\nrecent events:\n" + format_events(snapshot, events)
        print(text)
        return text

    def available_and_evictable_str(self) -> str:
        alloc = self.token_to_kv_pool_allocator
        available = alloc.available_size() if alloc is not None else 0
        return f"available={available}, evictable={self.evictable_size_}, protected={self.protected_size_}"
