"""check_conservation must name leaked and doubly-owned slots, not only notice a wrong total."""

import pytest
import torch

from radixserve.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from radixserve.mem_cache.conservation import ConservationError, check_conservation
from radixserve.mem_cache.kv_manager import ReqKV
from radixserve.mem_cache.memory_pool import ReqToTokenPool
from radixserve.mem_cache.radix_cache import RadixCache, RadixKey


def Req(row: int, protected: int, allocated: int) -> ReqKV:  # noqa: N802
    return ReqKV(req_pool_idx=row, cache_protected_len=protected, kv_allocated_len=allocated)


def setup(page_size: int = 1, size: int = 16):
    pool = ReqToTokenPool(4, 32)
    alloc = TokenToKVPoolAllocator(size) if page_size == 1 else PagedTokenToKVPoolAllocator(size, page_size)
    return pool, alloc, RadixCache(pool, alloc, page_size=page_size)


def test_idle_pool_passes_and_reports_its_terms():
    pool, alloc, cache = setup()
    cache.insert(RadixKey([1, 2, 3]), alloc.alloc(3))
    assert check_conservation(alloc, cache, pool, []) == {
        "available": 13, "pending_free": 0, "evictable": 3, "protected": 0, "request_private": 0, "size": 16}


def test_a_leaked_slot_is_listed():
    pool, alloc, cache = setup()
    alloc.alloc(2)  # nobody owns slots 1, 2
    with pytest.raises(ConservationError) as err:
        check_conservation(alloc, cache, pool, [])
    assert err.value.leaked == [1, 2] and "leaked pages [1, 2]" in str(err.value)


def test_a_slot_owned_by_tree_and_request_is_listed():
    pool, alloc, cache = setup()
    slots = alloc.alloc(4)
    cache.insert(RadixKey([1, 2, 3]), slots[:3])
    row = pool.alloc(1)[0]
    pool.req_to_token[row, :2] = torch.tensor([3, 4], dtype=torch.int32)  # slot 3 belongs to the tree
    with pytest.raises(ConservationError) as err:
        check_conservation(alloc, cache, pool, [Req(row, 0, 2)])
    assert 3 in err.value.doubly_owned


def test_a_row_referencing_a_free_slot_as_prefix_is_refused():
    pool, alloc, cache = setup()
    slots = alloc.alloc(3)
    cache.insert(RadixKey([1, 2]), slots[:2])
    alloc.free(slots[2:])
    row = pool.alloc(1)[0]
    pool.req_to_token[row, :2] = torch.tensor([slots[0], slots[2]], dtype=torch.int32)
    with pytest.raises(ConservationError, match="does not own") as err:
        check_conservation(alloc, cache, pool, [Req(row, 2, 2)])
    assert err.value.doubly_owned == [int(slots[2])]


def test_paged_private_tail_counts_a_whole_page():
    pool, alloc, cache = setup(page_size=4, size=32)
    slots = alloc.alloc(8)
    row = pool.alloc(1)[0]
    pool.req_to_token[row, :6] = slots[:6].to(torch.int32)
    report = check_conservation(alloc, cache, pool, [Req(row, 0, 6)])
    assert report["request_private"] == 8


def test_idle_requires_free_rows_and_no_locks():
    pool, alloc, cache = setup()
    cache.insert(RadixKey([1, 2]), alloc.alloc(2))
    node = cache.match_prefix(RadixKey([1, 2])).last_node
    cache.inc_lock_ref(node)
    with pytest.raises(ConservationError, match="locked"):
        check_conservation(alloc, cache, pool, [])
    cache.dec_lock_ref(node)
    pool.alloc(1)
    with pytest.raises(ConservationError, match="rows are in use"):
        check_conservation(alloc, cache, pool, [])


def test_corrupted_tree_counters_are_caught():
    pool, alloc, cache = setup()
    cache.insert(RadixKey([1, 2]), alloc.alloc(2))
    cache.evictable_size_ += 1
    with pytest.raises(ConservationError, match="recount"):
        check_conservation(alloc, cache, pool, [])


def test_open_free_group_counts_as_free():
    pool, alloc, cache = setup()
    slots = alloc.alloc(3)
    alloc.free_group_begin()
    alloc.free(slots)
    assert check_conservation(alloc, cache, pool, [])["pending_free"] == 3
    alloc.free_group_end()
