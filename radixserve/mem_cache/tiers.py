"""What a KV pool and a prefix cache say about themselves: their tiers, and the prefix-cache interface.

A *tier* is one pool of KV slots with its own capacity and free list. A plain model has one, `device` (the pool
every layer reads, indexed by the slot ids of `req_to_token` and the tree). A hybrid (sliding-window) model adds
`window`: the window layers' smaller pool behind the same slot ids (swa_memory.py). A host or disk tier adds
another name; code that reports or checks pools loops over the tiers instead of asking which class it holds.

Who declares what (NOTE: one place per decision; nobody probes with hasattr/getattr):

- the allocator: `is_hybrid` (class attribute) and `tier_names` (the tiers it hands out slots in, `device`
  first), `tier_capacity(name)` and `tier_free(name)`;
- the KV pool (`MHATokenToKVPool`, `SWAKVPool`): `is_hybrid` and `full_to_window` (None when not hybrid),
  what attention reads to translate full slots into window slots;
- the prefix cache (`PrefixCache`, below): `sliding_window` (None when not hybrid), `tiers()` (one `KVTier`
  per tier of its allocator, with the tree's evictable and protected slots in it) and `node_tier_fields(node)`
  (a node's per-tier fields for the cache view).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from radixserve.mem_cache.radix_cache import TreeNode
    from radixserve.mem_cache.radix_key import RadixKey

__all__ = ["DEVICE_TIER", "HOST_TIER", "STORAGE_TIER", "WINDOW_TIER", "KVTier", "MatchResult", "PrefixCache",
           "TieredCache", "split_cached_tokens", "tier_details"]

DEVICE_TIER = "device"  # the pool every layer reads (a hybrid model's full pool)
WINDOW_TIER = "window"  # a hybrid model's window pool (window layers only)
HOST_TIER = "host"  # the hierarchical cache's host-memory pages (host_tier.py)
STORAGE_TIER = "storage"  # the hierarchical cache's disk / remote pages (storage/)


@dataclass(frozen=True)
class KVTier:
    """One tier's slots right now. NOTE: capacity == free + used; used == evictable + protected + the slots
    requests hold privately + those an open free group collects (check_conservation proves it slot by slot)."""

    name: str
    capacity: int
    free: int
    evictable: int = 0
    protected: int = 0

    @property
    def used(self) -> int:
        """Slots not free: the tree's (evictable + protected), requests' private ones, a pending free group's."""
        return self.capacity - self.free

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "capacity": self.capacity, "used": self.used, "free": self.free,
                "evictable": self.evictable, "protected": self.protected}


class MatchResult(NamedTuple):
    """A prefix match, per tier. `device_indices`: the matched KV slots in the device pool (read, never write);
    `last_node`: the node the match ends at (lock it to keep the prefix). `host_hit_length` and
    `storage_hit_length`: further tokens past the device hit whose KV a host or a storage tier holds (the first
    is SGLang's HiCache name); 0 for a cache without those tiers. Re-exported by radix_cache.py.

    NOTE: `MatchResult(indices, node)` still builds one (the tier counts default to 0); read fields by name, since
    the tuple may grow.
    """

    device_indices: torch.Tensor
    last_node: TreeNode
    host_hit_length: int = 0
    storage_hit_length: int = 0

    @property
    def device_hit_length(self) -> int:
        """Tokens matched with KV in the device pool."""
        return len(self.device_indices)

    @property
    def last_device_node(self) -> TreeNode:
        """SGLang's name for `last_node`."""
        return self.last_node


def split_cached_tokens(cached: int, host: int, storage: int) -> dict[str, int]:
    """A request's `cached` tokens by the tier that held them: `host` and `storage` are the tokens the tiers
    loaded for its matches (clamped, host first); the rest were device hits. NOTE: the values sum to `cached`
    (SGLang's `cached_tokens_details` names: device, host, storage)."""
    cached = max(cached, 0)
    from_host = min(max(host, 0), cached)
    from_storage = min(max(storage, 0), cached - from_host)
    return {DEVICE_TIER: cached - from_host - from_storage, HOST_TIER: from_host, STORAGE_TIER: from_storage}


def tier_details(details: dict[str, int] | None) -> dict[str, dict[str, int]]:
    """`{"cached_tokens_details": details}` to merge into a usage or meta_info dict; {} when None (no tiers)."""
    return {} if details is None else {"cached_tokens_details": dict(details)}


@runtime_checkable
class PrefixCache(Protocol):
    """What the KV manager, the scheduler and the reports need of a prefix cache (SGLang's BasePrefixCache shape).

    `RadixCache` and `SWARadixCache` are ones. `match_prefix` returns a `MatchResult` whose per-tier hit counts
    (`device_hit_length`, `host_hit_length`, `storage_hit_length`) say where the matched KV is; a cache without
    host or storage tiers reports 0 for them.
    """

    page_size: int
    disable: bool
    sliding_window: int | None

    def reset(self) -> None: ...

    def match_prefix(self, key: RadixKey) -> MatchResult: ...

    def insert(self, key: RadixKey, value: torch.Tensor | None = None, priority: int = 0,
               chunked: bool = False) -> int: ...

    def evict(self, num_tokens: int) -> int: ...

    def inc_lock_ref(self, node: Any) -> int: ...

    def dec_lock_ref(self, node: Any) -> int: ...

    def evictable_size(self) -> int: ...

    def protected_size(self) -> int: ...

    @property
    def is_hybrid(self) -> bool: ...

    def tier_lock_sizes(self, name: str) -> tuple[int, int]: ...

    def tiers(self) -> list[KVTier]: ...

    def node_tier_fields(self, node: Any) -> dict[str, int]: ...


class TieredCache:
    """The tier half of a prefix cache over an allocator (a base of `RadixCache`): plain defaults for a cache whose
    tree tracks only the device tier. `SWARadixCache` overrides `tier_lock_sizes` and `node_tier_fields`.

    NOTE: expects `token_to_kv_pool_allocator` (may be None: tests drive a tree with no pools; then no tiers),
    `evictable_size()` and `protected_size()` on the class it is mixed into.
    """

    sliding_window: int | None = None  # NOTE: a hybrid tree's window W; None: not hybrid (the one switch)
    token_to_kv_pool_allocator: Any

    @property
    def is_hybrid(self) -> bool:
        """The tree tracks a window tier (window KV per node, window locks)."""
        return self.sliding_window is not None

    def tier_lock_sizes(self, name: str) -> tuple[int, int]:
        """(evictable, protected) slots the tree holds in tier `name`; (0, 0) for a tier it does not track."""
        if name == DEVICE_TIER:
            return self.evictable_size(), self.protected_size()  # type: ignore[attr-defined]
        return 0, 0

    def tiers(self) -> list[KVTier]:
        """One `KVTier` per tier of the allocator, device first, with the tree's evictable and protected slots."""
        alloc = self.token_to_kv_pool_allocator
        if alloc is None:
            return []
        return [KVTier(name, alloc.tier_capacity(name), alloc.tier_free(name), *self.tier_lock_sizes(name))
                for name in alloc.tier_names]

    def node_tier_fields(self, node: Any) -> dict[str, int]:
        """A node's per-tier fields beyond its key and lock (the cache view shows them); none for a plain tree."""
        return {}
