"""Eviction policies of the radix cache: each maps a tree node to a sort key; smallest is evicted first."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radixserve.mem_cache.radix_cache import TreeNode

EvictionKey = Callable[["TreeNode"], Any]


def _lru(node: TreeNode) -> float:
    return node.last_access_time


def _lfu(node: TreeNode) -> tuple[int, float]:
    return (node.hit_count, node.last_access_time)


def _fifo(node: TreeNode) -> float:
    return node.creation_time


def _priority(node: TreeNode) -> tuple[int, float]:
    return (node.priority, node.last_access_time)


def _slru(node: TreeNode) -> tuple[int, float]:
    return (1 if node.hit_count >= 2 else 0, node.last_access_time)


# NOTE: every key here only grows over a node's life (access times, hit counts and the max
# priority never decrease). The cache's persistent heap relies on that: a stale heap entry is a
# lower bound of the node's true key, so it can be refreshed lazily when it reaches the top.
# Policies whose key can shrink (MRU, FILO) would break that and are deliberately absent.
EVICTION_POLICIES: dict[str, EvictionKey] = {
    "lru": _lru,
    "lfu": _lfu,
    "fifo": _fifo,
    "priority": _priority,
    "slru": _slru,
}


def get_eviction_key(name: str) -> EvictionKey:
    """The sort-key function of policy `name`; ValueError listing the valid names otherwise."""
    try:
        return EVICTION_POLICIES[name]
    except KeyError:
        valid = ", ".join(sorted(EVICTION_POLICIES))
        raise ValueError(f"unknown eviction policy {name!r}; valid policies: {valid}") from None
