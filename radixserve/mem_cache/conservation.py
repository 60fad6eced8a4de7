"""The KV accounting identity and single ownership of every slot, checked with slot/page ids on failure.

    available + evictable + protected + sum over active requests of
        (ceil_page(kv_allocated_len) - cache_protected_len)  ==  allocator.size

and every page 1..num_pages is owned exactly once: by the free list, by the tree (a node's
value), or by one active request (its private row positions [cache_protected_len,
kv_allocated_len)). Slots collected by an open free group count as free. Requests are anything with
a KV handle `kv` (a `ReqKV`): `Req`, or a `ReqKV` itself.

The allocator declares its tiers (`tier_names`, tiers.py): the first, `device`, is the pool above; each further
tier has its own check (`_tier_check`), run after the device pool's. A hybrid model's window pool (swa_memory.py),
tier `window`, has the same identity and single ownership (`check_window_pool`):

    window available + window evictable + window protected + sum over active requests of
        (their own positions with window KV)  ==  window pool size

every window slot owned once, by the window free list or through `full_to_window` by the owner of a full
slot (a window slot named by a free full slot, or by two, fails); and each active request still has the window
KV its next token reads: positions max(0, kv_committed_len - W + 1) .. kv_allocated_len - 1.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from radixserve.mem_cache.tiers import WINDOW_TIER

if TYPE_CHECKING:
    from radixserve.mem_cache.kv_manager import ReqKV


class ConservationError(AssertionError):
    """The identity or single ownership failed. `leaked` / `doubly_owned` list page ids (slot ids at page 1)."""

    def __init__(self, message: str, leaked: list[int] | None = None, doubly_owned: list[int] | None = None,
                 report: dict | None = None) -> None:
        super().__init__(message)
        self.leaked = leaked or []
        self.doubly_owned = doubly_owned or []
        self.report = report or {}


def _unique_active(active: Sequence[ReqKV]) -> list[ReqKV]:
    """The KV handles that hold a row, each once."""
    seen: dict[int, ReqKV] = {}
    for kv in active:
        if kv.req_pool_idx is not None:
            seen.setdefault(id(kv), kv)
    return list(seen.values())


def _tree_nodes(tree_cache: Any) -> list[Any]:
    if tree_cache is None or tree_cache.disable:
        return []
    return list(tree_cache._iter_nodes())


def _recount_tree(nodes: list[Any], tree_cache: Any) -> None:
    evictable = sum(len(n.key) for n in nodes if n.lock_ref == 0)
    protected = sum(len(n.key) for n in nodes if n.lock_ref > 0)
    if (evictable, protected) != (tree_cache.evictable_size(), tree_cache.protected_size()):
        raise ConservationError(
            f"tree counters evictable={tree_cache.evictable_size()} protected={tree_cache.protected_size()} "
            f"disagree with a recount evictable={evictable} protected={protected}"
        )


def check_conservation(allocator: Any, tree_cache: Any, req_to_token_pool: Any,
                       active: Sequence[ReqKV] = (), pinned: Sequence[Any] = ()) -> dict[str, int]:
    """Check the identity and single ownership; returns the terms, raises ConservationError otherwise.

    `active`: the KV handles (`req.kv`) of the requests that may hold KV; `pinned`: the tree nodes agent sessions
    hold a lock on (session_cache.py), one entry per pin.

    With no active requests it also requires every request row free and no tree lock held but the sessions' pins.
    """
    ps = allocator.page_size
    reqs = _unique_active(active)
    nodes = _tree_nodes(tree_cache)
    if tree_cache is not None and not tree_cache.disable:
        _recount_tree(nodes, tree_cache)
    pending = torch.cat(allocator.free_group) if allocator.free_group else torch.empty(0, dtype=torch.int64)
    pending_pages = torch.unique(pending.cpu().long() // ps)
    report = {
        "available": allocator.available_size(),
        "pending_free": len(pending_pages) * ps,
        "evictable": tree_cache.evictable_size() if tree_cache is not None else 0,
        "protected": tree_cache.protected_size() if tree_cache is not None else 0,
        "request_private": sum(-(-r.kv_allocated_len // ps) * ps - r.cache_protected_len for r in reqs),
        "size": allocator.size,
    }
    total = sum(v for k, v in report.items() if k != "size")
    leaked, doubly_owned = _ownership(allocator, nodes, req_to_token_pool, reqs, pending_pages)
    if total != allocator.size or leaked or doubly_owned:
        raise ConservationError(
            f"KV conservation failed: {report} sums to {total}, not {allocator.size}; "
            f"leaked pages {leaked[:50]}, doubly-owned pages {doubly_owned[:50]} (page_size={ps})",
            leaked, doubly_owned, report,
        )
    _check_rows_reference_owned(allocator, nodes, req_to_token_pool, reqs)
    # NOTE: the device tier is checked above; every further tier the allocator declares has its check here
    for name in allocator.tier_names[1:]:
        report.update(_tier_check(name)(allocator, tree_cache, nodes, req_to_token_pool, reqs, pinned))
    if not reqs:
        _check_idle(tree_cache, req_to_token_pool, report, pinned)
    return report


def _ownership(allocator: Any, nodes: list[Any], pool: Any, reqs: list[Any],
               pending_pages: torch.Tensor) -> tuple[list[int], list[int]]:
    ps, num_pages = allocator.page_size, allocator.size // allocator.page_size
    owners = [allocator.free_pages.cpu().long(), pending_pages]
    tree_slots = torch.cat([n.value.cpu().long() for n in nodes]) if nodes else torch.empty(0, dtype=torch.int64)
    doubly: set[int] = {slot // ps for slot in _repeated(tree_slots)}
    owners.append(torch.unique(tree_slots // ps))
    for req in reqs:
        private = pool.req_to_token[req.req_pool_idx, req.cache_protected_len:req.kv_allocated_len]
        private = private.to(torch.int64).cpu()
        doubly.update(p // ps for p in _repeated(private))
        owners.append(torch.unique(private // ps))
    counts = torch.bincount(torch.cat(owners), minlength=num_pages + 1)
    doubly.update(torch.nonzero(counts > 1).flatten().tolist())
    if counts[0] > 0:
        doubly.add(0)  # page 0 is reserved: anyone owning it is a bug
    leaked = (torch.nonzero(counts[1:num_pages + 1] == 0).flatten() + 1).tolist()
    return leaked, sorted(doubly)


def _repeated(values: torch.Tensor) -> list[int]:
    if values.numel() == 0:
        return []
    uniq, counts = torch.unique(values, return_counts=True)
    return uniq[counts > 1].tolist()


def _check_rows_reference_owned(allocator: Any, nodes: list[Any], pool: Any, reqs: list[Any]) -> None:
    """A request's shared prefix [0, cache_protected_len) must point at tree slots, never at free ones."""
    if not reqs:
        return
    tree_slots = set(torch.cat([n.value for n in nodes]).tolist()) if nodes else set()
    for req in reqs:
        shared = pool.req_to_token[req.req_pool_idx, :req.cache_protected_len].tolist()
        stray = sorted(set(shared) - tree_slots)
        if stray:
            raise ConservationError(
                f"request row {req.req_pool_idx} references slots {stray[:50]} as cached prefix, "
                "but the tree does not own them", leaked=[], doubly_owned=stray,
            )


def _pinned_paths(tree_cache: Any, pinned: Sequence[Any]) -> list[Any]:
    """Every node on the path from the root to each pinned node (the root left out), once per pin."""
    out = []
    for node in pinned:
        while node is not None and node is not tree_cache.root_node:
            out.append(node)
            node = node.parent
    return out


def _check_idle(tree_cache: Any, pool: Any, report: dict, pinned: Sequence[Any] = ()) -> None:
    if pool is not None and pool.available_size() != pool.size:
        raise ConservationError(
            f"no active request, yet request rows are in use: {pool.size - pool.available_size()} of {pool.size}",
            report=report,
        )
    # NOTE: idle, the only locks are the sessions' pins: each node's lock_ref is the number of pins at or below it
    expected: dict[int, list] = {}
    for node in _pinned_paths(tree_cache, pinned):
        expected.setdefault(id(node), [node, 0])[1] += 1
    pinned_tokens = sum(len(node.key) for node, _ in expected.values())
    if report["protected"] != pinned_tokens:
        raise ConservationError(f"no active request, yet {report['protected']} tree tokens are locked "
                                f"({pinned_tokens} pinned by sessions)", report=report)
    wrong = [(len(node.key), node.lock_ref, count) for node, count in expected.values() if node.lock_ref != count]
    if wrong:
        raise ConservationError(f"session-pinned nodes' lock refs disagree with their pins (tokens, lock_ref, "
                                f"pins): {wrong[:10]}", report=report)


# ---------------------------------------------------------------------------------------------- further tiers
TierCheck = Callable[[Any, Any, list[Any], Any, list[Any], Sequence[Any]], dict[str, int]]


def _tier_check(name: str) -> TierCheck:
    """The check of tier `name` beyond the device pool: (allocator, tree, nodes, req_to_token pool, requests, the
    sessions' pinned nodes) ->
    its report terms, raising ConservationError. A tier without one is an error, never a silent pass."""
    checks: dict[str, TierCheck] = {WINDOW_TIER: check_window_pool}
    if name not in checks:
        raise ConservationError(f"no conservation check for KV tier {name!r}: add one to conservation.py")
    return checks[name]


# ---------------------------------------------------------------------------------------------- window pool
def check_window_pool(allocator: Any, tree_cache: Any, nodes: list[Any], pool: Any, reqs: list[Any],
                      pinned: Sequence[Any] = ()) -> dict[str, int]:
    """Raises ConservationError if the window pool's identity, ownership or a running window fails; returns terms."""
    table, size = allocator.full_to_window, allocator.tier_capacity(WINDOW_TIER)
    hybrid_tree = tree_cache is not None and tree_cache.is_hybrid
    if hybrid_tree and not tree_cache.disable:
        _recount(nodes, tree_cache, allocator)
    private = [pool.req_to_token[r.req_pool_idx, r.cache_protected_len:r.kv_allocated_len].long() for r in reqs]
    # NOTE: a tree that does not track the window tier (a plain RadixCache) holds none of it: (0, 0)
    evictable, protected = tree_cache.tier_lock_sizes(WINDOW_TIER) if tree_cache is not None else (0, 0)
    report = {
        "window_available": allocator.tier_free(WINDOW_TIER),
        "window_evictable": evictable,
        "window_protected": protected,
        "window_request_private": sum(allocator.window_count(p) for p in private),
        "window_size": size,
    }
    total = sum(v for k, v in report.items() if k != "window_size")
    owners = [allocator.window.free_pages.cpu().long()]
    owners += [table[n.value.long()].cpu().long() for n in nodes]
    owners += [table[p].cpu().long() for p in private]
    counts = torch.bincount(torch.cat(owners), minlength=size + 1)
    counts[0] = 0  # NOTE: 0 in the table means "no window KV"
    leaked = (torch.nonzero(counts[1:] == 0).flatten() + 1).tolist()
    doubly = torch.nonzero(counts > 1).flatten().tolist()
    if total != size or leaked or doubly:
        raise ConservationError(
            f"window pool conservation failed: {report} sums to {total}, not {size}; leaked window slots "
            f"{leaked[:50]}, doubly-owned window slots {doubly[:50]}", leaked, doubly, report)
    _check_running_windows(allocator, tree_cache, pool, reqs)
    if not reqs and report["window_protected"]:
        # NOTE: idle, window locks may only be the sessions' pins' (on the paths to their nodes)
        on_pins = {id(n) for n in _pinned_paths(tree_cache, pinned)}
        stray = [n for n in nodes if n.window_lock_ref and id(n) not in on_pins]
        if stray or not pinned:
            raise ConservationError(f"no active request, yet {report['window_protected']} window slots are locked",
                                    report=report)
    return report


def _recount(nodes: list[Any], tree_cache: Any, allocator: Any) -> None:
    evictable = protected = 0
    for node in nodes:
        actual = allocator.window_count(node.value)
        if actual != node.window_len:
            raise ConservationError(f"{node!r} counts {node.window_len} tokens with window KV; the table says {actual}")
        if node.window_lock_ref:
            protected += actual
        else:
            evictable += actual
    counters = (tree_cache.window_evictable_size(), tree_cache.window_protected_size())
    if (evictable, protected) != counters:
        raise ConservationError(f"tree window counters evictable, protected = {counters} disagree with a recount "
                                f"{(evictable, protected)}")


def _check_running_windows(allocator: Any, tree_cache: Any, pool: Any, reqs: list[Any]) -> None:
    window = tree_cache.sliding_window if tree_cache is not None else None
    if window is None:
        return
    for req in reqs:
        lo = max(0, req.kv_committed_len - window + 1)
        slots = pool.req_to_token[req.req_pool_idx, lo:req.kv_allocated_len]
        missing = (~allocator.window_present(slots)).nonzero().flatten()
        if len(missing):
            raise ConservationError(f"request row {req.req_pool_idx} lost window KV it still reads: positions "
                                    f"{(missing + lo).tolist()[:20]}")
