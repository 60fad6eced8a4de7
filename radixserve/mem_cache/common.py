"""Allocation helpers between the scheduler and the pools (reference 2.10): evict the shortfall, then
alloc; and `release_kv_cache`, the one place a request gives its KV up (finish, retract, abort).

Requests are any objects with the fields listed in `radix_cache` (origin/output/fill ids,
`req_pool_idx`, `prefix_indices`, `last_node`, `cache_protected_len`, `kv_committed_len`,
`kv_allocated_len`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from radixserve.mem_cache.radix_cache import RadixCache

__all__ = ["alloc_for_decode", "alloc_for_extend", "alloc_paged_token_slots_decode",
           "alloc_paged_token_slots_extend", "alloc_req_slots", "alloc_token_slots",
           "evict_from_tree_cache", "release_kv_cache"]


def evict_from_tree_cache(tree_cache: RadixCache | None, num_tokens: int) -> None:
    """Evict only the shortfall: what `num_tokens` needs beyond the allocator's free slots."""
    if tree_cache is None or tree_cache.disable:
        return
    shortfall = num_tokens - tree_cache.token_to_kv_pool_allocator.available_size()
    if shortfall > 0:
        tree_cache.evict(shortfall)


def _out_of_memory(tree_cache: RadixCache, what: str) -> RuntimeError:
    return RuntimeError(f"Out of memory allocating {what}; {tree_cache.available_and_evictable_str()}")


def alloc_token_slots(tree_cache: RadixCache, num_tokens: int) -> torch.Tensor:
    evict_from_tree_cache(tree_cache, num_tokens)
    out = tree_cache.token_to_kv_pool_allocator.alloc(num_tokens)
    if out is None:
        raise _out_of_memory(tree_cache, f"{num_tokens} KV slots")
    return out


def alloc_paged_token_slots_extend(tree_cache: RadixCache, prefix_lens: Sequence[int], seq_lens: Sequence[int],
                                   last_loc: Sequence[int], extend_num_tokens: int) -> torch.Tensor:
    # NOTE: evicts one extra page per request (an over-estimate of the partial-page effect).
    allocator = tree_cache.token_to_kv_pool_allocator
    evict_from_tree_cache(tree_cache, extend_num_tokens + len(seq_lens) * allocator.page_size)
    out = allocator.alloc_extend(prefix_lens, seq_lens, last_loc, extend_num_tokens)
    if out is None:
        raise _out_of_memory(tree_cache, f"{extend_num_tokens} extend slots")
    return out


def alloc_paged_token_slots_decode(tree_cache: RadixCache, seq_lens: Sequence[int],
                                   last_loc: Sequence[int]) -> torch.Tensor:
    allocator = tree_cache.token_to_kv_pool_allocator
    evict_from_tree_cache(tree_cache, len(seq_lens) * allocator.page_size)
    out = allocator.alloc_decode(seq_lens, last_loc)
    if out is None:
        raise _out_of_memory(tree_cache, f"{len(seq_lens)} decode slots")
    return out


def alloc_req_slots(req_to_token_pool: Any, reqs: Sequence[Any]) -> None:
    """Give every request without one a `req_to_token` row (a continuing chunked request keeps its own)."""
    needing = [req for req in reqs if req.req_pool_idx is None]
    rows = req_to_token_pool.alloc(len(needing))
    if rows is None:
        raise RuntimeError(f"no free request rows for {len(needing)} requests: the admission budget was wrong")
    for req, row in zip(needing, rows, strict=True):
        req.req_pool_idx = row


def alloc_for_extend(reqs: Sequence[Any], tree_cache: RadixCache) -> torch.Tensor:
    """Rows and KV slots for each request's positions [len(prefix_indices), len(fill_ids)).

    Writes the row (prefix slots, then new slots), sets `kv_committed_len = kv_allocated_len =
    len(fill_ids)`, and returns the new slots of all requests concatenated (`out_cache_loc`).
    """
    pool = tree_cache.req_to_token_pool
    allocator = tree_cache.token_to_kv_pool_allocator
    prefix_lens = [len(req.prefix_indices) for req in reqs]
    seq_lens = [len(req.fill_ids) for req in reqs]
    extend_num = sum(seq_lens) - sum(prefix_lens)
    new_rows = [req for req in reqs if req.req_pool_idx is None]
    alloc_req_slots(pool, reqs)
    try:
        if allocator.page_size == 1:
            out = alloc_token_slots(tree_cache, extend_num)
        else:
            last_loc = [int(req.prefix_indices[-1]) if len(req.prefix_indices) else -1 for req in reqs]
            out = alloc_paged_token_slots_extend(tree_cache, prefix_lens, seq_lens, last_loc, extend_num)
    except RuntimeError:
        for req in new_rows:  # NOTE: give the rows back, so a failed allocation leaks nothing
            pool.free(req.req_pool_idx)
            req.req_pool_idx = None
        raise
    offset = 0
    for req, prefix_len, seq_len in zip(reqs, prefix_lens, seq_lens, strict=True):
        row = pool.req_to_token[req.req_pool_idx]
        row[:prefix_len] = req.prefix_indices.to(row.dtype)
        row[prefix_len:seq_len] = out[offset:offset + seq_len - prefix_len].to(row.dtype)
        offset += seq_len - prefix_len
        req.kv_allocated_len = seq_len
        req.kv_committed_len = seq_len
    return out


def alloc_for_decode(reqs: Sequence[Any], tree_cache: RadixCache) -> torch.Tensor:
    """One KV slot per request for the token it feeds next, written at row position kv_allocated_len."""
    pool = tree_cache.req_to_token_pool
    allocator = tree_cache.token_to_kv_pool_allocator
    positions = [req.kv_allocated_len for req in reqs]
    if allocator.page_size == 1:
        out = alloc_token_slots(tree_cache, len(reqs))
    else:
        last_loc = [int(pool.req_to_token[req.req_pool_idx, pos - 1]) for req, pos in zip(reqs, positions, strict=True)]
        out = alloc_paged_token_slots_decode(tree_cache, [pos + 1 for pos in positions], last_loc)
    for req, pos, slot in zip(reqs, positions, out.tolist(), strict=True):
        pool.req_to_token[req.req_pool_idx, pos] = slot
        req.kv_allocated_len = pos + 1
        req.kv_committed_len = pos + 1
    return out


def release_kv_cache(req: Any, tree_cache: RadixCache, is_insert: bool = True) -> None:
    """The one place a request gives up its KV: on finish (is_insert=True), retract or abort (False).

    1. `tree_cache.cache_finished_req(req, is_insert)` inserts (or not), frees duplicates and the
       unaligned tail, and releases the request's lock.
    2. The over-allocation `[ceil_page(kv_committed_len), kv_allocated_len)` is freed.
    3. The request's `req_to_token` row is freed HERE (not by the tree), and the request's KV fields
       are cleared: `req_pool_idx=None`, `last_node=None`, lengths 0, `prefix_indices` empty.
    A request that holds a lock but no row (aborted between match and allocation) only unlocks.
    """
    if req.req_pool_idx is None:
        if req.last_node is not None:
            tree_cache.dec_lock_ref(req.last_node)
        _clear_kv_fields(req, tree_cache)
        return
    pool, alloc = tree_cache._pools()
    tree_cache.cache_finished_req(req, is_insert=is_insert)
    ps = tree_cache.page_size
    start = -(-req.kv_committed_len // ps) * ps
    if req.kv_allocated_len > start:
        alloc.free(pool.req_to_token[req.req_pool_idx, start:req.kv_allocated_len].to(torch.int64))
    pool.free(req.req_pool_idx)
    _clear_kv_fields(req, tree_cache)


def _clear_kv_fields(req: Any, tree_cache: RadixCache) -> None:
    req.req_pool_idx = None
    req.last_node = None
    req.cache_protected_len = 0
    req.kv_committed_len = 0
    req.kv_allocated_len = 0
    req.prefix_indices = torch.empty(0, dtype=torch.int64, device=tree_cache.device)
