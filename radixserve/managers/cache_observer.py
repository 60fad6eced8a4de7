"""The scheduler's answer to the cache explorer: a bounded snapshot of its radix tree, taken between steps.

Runs on the scheduler thread when a `CacheTreeReq` arrives, so it reads a tree no step is changing;
its cost is bounded by the request's limits (nodes, tokens per node, events), not by the tree's size.
The first request turns on the tree's event log; it then records every operation in a fixed ring.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from radixserve.mem_cache.cache_events import CacheEventLog
from radixserve.mem_cache.cache_view import NamespaceLabels, tree_snapshot
from radixserve.protocol.io_struct import CacheTreeOut, CacheTreeReq

if TYPE_CHECKING:
    from radixserve.managers.scheduler import Scheduler

EVENT_LOG_CAPACITY = 4096
LIMITS = {"max_nodes": 5000, "max_tokens": 4096, "max_events": 4096}  # NOTE: what one snapshot may ask for


def cache_tree_snapshot(scheduler: Scheduler, req: CacheTreeReq) -> CacheTreeOut:
    start = time.perf_counter()
    cache = scheduler.tree_cache
    if cache.events is None:
        cache.events = CacheEventLog(EVENT_LOG_CAPACITY)
    requests = [(r.rid, getattr(r.kv.last_node, "id", None), r.extra_key, r.kv.cache_protected_len, r.seqlen)
                for r in scheduler.active_requests()]
    snapshot = tree_snapshot(cache, NamespaceLabels(), max_nodes=_clamp(req.max_nodes, "max_nodes"),
                             max_tokens=_clamp(req.max_tokens, "max_tokens"), since=req.since,
                             max_events=_clamp(req.max_events, "max_events"), requests=requests)
    available = scheduler.token_to_kv_pool_allocator.available_size()
    size = scheduler.max_total_num_tokens
    evictable, protected = cache.evictable_size(), cache.protected_size()
    snapshot["pool"] = {"size": size, "available": available, "evictable": evictable, "protected": protected,
                        "in_requests": max(size - available - evictable - protected, 0)}
    snapshot["tiers"] = tiers_of(scheduler, snapshot["pool"])
    snapshot["waiting_requests"] = len(scheduler.waiting_queue)
    snapshot["cache_epoch"] = scheduler.cache_epoch
    snapshot["took_ms"] = round((time.perf_counter() - start) * 1000, 3)
    return CacheTreeOut(snapshot)


def tiers_of(scheduler: Scheduler, pool: dict) -> dict:
    """Which tier holds what: the device pool (its tokens as `pool` counts them, and the tree's nodes there), and with
    --enable-hierarchical-cache the host and storage tiers' pages, bytes, capacity and counters (hicache.py)."""
    hicache = scheduler.kv_manager.hicache
    out = {"device": {"tokens": pool["size"], "cached": pool["evictable"] + pool["protected"],
                      "free": pool["available"]}, "hierarchical": hicache is not None}
    if hicache is not None:
        out.update(hicache.tier_summary())
    return out


def _clamp(value: int, name: str) -> int:
    return max(1, min(int(value), LIMITS[name]))
