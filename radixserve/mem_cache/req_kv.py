"""ReqKV, the handle the KV manager keeps on each request; KVRequest, what it reads of a request; TreePin.

Only `KVManager` (kv_manager.py) writes a `ReqKV`; everyone may read it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch

if TYPE_CHECKING:
    from radixserve.mem_cache.radix_cache import TreeNode


@dataclass(eq=False)
class ReqKV:
    """A request's KV bookkeeping (SGLang's field names). Written by KVManager only; read by anyone.

    Row positions [0, cache_protected_len) hold tree slots, kept from eviction by a lock on
    `last_node` while `locked`; positions [cache_protected_len, kv_allocated_len) hold the request's
    own slots. `kv_committed_len` tokens have KV written by forwards whose results were processed;
    under overlap the forward in flight has already allocated one more (kv_allocated_len runs ahead).
    Before the request has a row, `prefix_indices` holds the slots of its prefix match.
    """

    req_pool_idx: int | None = None
    last_node: TreeNode | None = None
    locked: bool = False
    cache_protected_len: int = 0
    kv_committed_len: int = 0
    kv_allocated_len: int = 0
    prefix_indices: torch.Tensor | None = None
    window_lock: int | None = None  # a hybrid tree's window-lock mark (SWARadixCache.inc_window_lock)
    window_freed_len: int = 0  # hybrid: own positions below this have had their window KV freed
    # tokens the hierarchical cache loaded into the tree for this request's matches, by the tier they came from
    # (summed over its matches while it waits; `cached_by_tier` clamps them to its cached tokens)
    host_hit_len: int = 0
    storage_hit_len: int = 0

    @property
    def prefix_len(self) -> int:
        """Leading tokens whose KV exists: the match before a row exists, then the row's slots.

        NOTE: a continuing chunked prefill is carried by this length alone: its row already holds them."""
        return self.kv_allocated_len if self.req_pool_idx is not None else self.cache_protected_len


class KVRequest(Protocol):
    """What the KV manager reads of a request (`Req` is one); it writes only `kv`."""

    kv: ReqKV
    origin_input_ids: Sequence[int]
    output_ids: Sequence[int]
    fill_ids: Sequence[int]  # the tokens this round computes: matched and published as a prefix
    extra_key: Any  # the cache namespace (RadixKey.extra_key)
    priority: int  # of the tree nodes it publishes (the priority eviction policy)

    @property
    def prefix_match_limit(self) -> int: ...


class TreePin(NamedTuple):
    """A lock a session holds on a tree node (KVManager.pin_prefix): the node, its window mark, its depth."""

    node: TreeNode
    window_mark: int | None
    tokens: int
