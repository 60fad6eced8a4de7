"""KV slot operations of the scheduler, over the radix cache and the allocators (reference §2.10, §3).

Every eviction the scheduler causes goes through `evict_from_tree_cache`, so the evicted-token
counter is exact; every release goes through `release`, the radix cache's `release_kv_cache`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from radixserve.mem_cache.common import release_kv_cache
from radixserve.mem_cache.radix_cache import MatchResult, RadixKey

if TYPE_CHECKING:
    from radixserve.managers.schedule_batch import Req, ScheduleBatch


def match_prefix(tree_cache: Any, token_ids: list[int], extra_key: Any) -> MatchResult:
    return tree_cache.match_prefix(RadixKey(token_ids, extra_key))


def release(req: Req, tree_cache: Any, is_insert: bool = True) -> None:
    """Give up all of `req`'s KV: insert (finish) or not (retract/abort), unlock, free its row."""
    release_kv_cache(req, tree_cache, is_insert=is_insert)


def evict_from_tree_cache(batch: ScheduleBatch, num_tokens: int) -> int:
    """Evict only the shortfall between `num_tokens` and what the allocator has free."""
    shortfall = num_tokens - batch.allocator.available_size()
    if shortfall <= 0 or batch.tree_cache.disable:
        return 0
    if batch.stats is None:
        return batch.tree_cache.evict(shortfall)
    with batch.stats.timing("cache_ops_s"):
        evicted = batch.tree_cache.evict(shortfall)
    batch.stats.evicted_tokens += evicted
    return evicted


def _out_of_memory(batch: ScheduleBatch, what: str, num_tokens: int) -> RuntimeError:
    detail = batch.tree_cache.available_and_evictable_str()
    return RuntimeError(f"out of KV memory allocating {num_tokens} {what} slot(s) ({detail}); "
                        "the admission budget was wrong")


def alloc_for_extend(batch: ScheduleBatch, prefix_lens: list[int], seq_lens: list[int]) -> torch.Tensor:
    """New KV slots for positions [prefix_len, seq_len) of each request, flat in request order."""
    extend_num = sum(s - p for s, p in zip(seq_lens, prefix_lens, strict=True))
    allocator, ps = batch.allocator, batch.page_size
    if ps == 1:
        evict_from_tree_cache(batch, extend_num)
        out = allocator.alloc(extend_num)
    else:
        # NOTE: one extra page per request over-estimates a partial page's needs (as SGLang does).
        evict_from_tree_cache(batch, extend_num + len(seq_lens) * ps)
        # NOTE: a new row is not written yet: the last prefix slot comes from prefix_indices.
        last_loc = [int(r.prefix_indices[-1]) if len(r.prefix_indices) else -1 for r in batch.reqs]
        out = allocator.alloc_extend(prefix_lens, seq_lens, last_loc, extend_num)
    if out is None:
        raise _out_of_memory(batch, "prefill", extend_num)
    return out


def alloc_for_decode(batch: ScheduleBatch) -> torch.Tensor:
    """One KV slot per request, for the token at row position `kv_committed_len`."""
    allocator, reqs = batch.allocator, batch.reqs
    if batch.page_size == 1:
        evict_from_tree_cache(batch, len(reqs))
        out = allocator.alloc(len(reqs))
    else:
        evict_from_tree_cache(batch, len(reqs) * batch.page_size)
        table = batch.req_to_token_pool.req_to_token
        committed = [r.kv_committed_len for r in reqs]
        last_loc = [int(table[r.req_pool_idx, n - 1]) for r, n in zip(reqs, committed, strict=True)]
        out = allocator.alloc_decode([c + 1 for c in committed], last_loc)
    if out is None:
        raise _out_of_memory(batch, "decode", len(reqs))
    return out
