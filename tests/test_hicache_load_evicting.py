"""A load from the tiers may evict (benchmarks/bench_hicache_working_set.py: a working set larger than the pool).

Once the pool is full of other prefixes' evictable KV, a load into free slots only loads nothing; at admission
(`KVManager.match_prefix(req, evict_for_load=True)`, what PrefillPlanner._admit calls with the hierarchical cache)
the load evicts other prefixes for its pages, never its own match's slots. Conservation is checked after each step."""

from __future__ import annotations

import torch
from test_hicache_host_tier import PAGE_BYTES, HostStack, T
from test_hicache_storage_tier import FakeReq, expected, random_kv

from radixserve.mem_cache.radix_key import RadixKey


def test_a_load_at_admission_evicts_other_prefixes_but_not_its_own(tmp_path):
    stack = HostStack(tmp_path, 64 * PAGE_BYTES, policy="write_through", pool_tokens=6 * T)
    a_tokens, kv = list(range(4 * T + 1)), random_kv(4 * T + 1)
    stack.run(FakeReq(a_tokens), kv)  # write_through: A's 4 whole pages go to host (and disk)
    stack.evict_all()
    b_tokens = a_tokens[:T] + list(range(10_000, 10_000 + 6 * T - 12 - T))  # shares A's page 0; fills the pool
    stack.run(FakeReq(b_tokens), random_kv(len(b_tokens)))
    assert stack.alloc.available_size() == 12 and stack.tree.evictable_size() == 6 * T - 12
    loaded = stack.hicache.host_loaded_tokens
    req = FakeReq(list(a_tokens))
    assert stack.manager.match_prefix(req) == T  # free slots only: not one page fits
    stack.conserved()
    assert stack.hicache.host_loaded_tokens == loaded
    assert stack.manager.match_prefix(req, evict_for_load=True) == 4 * T  # B's own tail evicted for the load
    stack.conserved()
    assert stack.hicache.host_loaded_tokens == loaded + 3 * T
    torch.testing.assert_close(stack.kv_at(req.kv.prefix_indices), expected(kv, 4 * T), rtol=0, atol=0)
    shared = stack.tree.match_prefix(RadixKey(b_tokens, None))
    assert len(shared.device_indices) == T  # the shared page 0 (the load's own match) stayed
    stack.manager.lock(req)
    stack.manager.alloc_extend([req], [len(req.fill_ids)])
    stack.conserved([req.kv])
    stack.manager.commit(req, len(req.fill_ids))
    stack.manager.release(req, insert=True)
    stack.conserved()


def test_a_load_that_cannot_fit_loads_what_fits(tmp_path):
    stack = HostStack(tmp_path, 64 * PAGE_BYTES, policy="write_through", pool_tokens=6 * T)
    a_tokens, kv = list(range(5 * T + 1)), random_kv(5 * T + 1)
    stack.run(FakeReq(a_tokens), kv)
    stack.evict_all()
    other = FakeReq(list(range(20_000, 20_000 + 3 * T)))
    stack.manager.match_prefix(other)
    stack.manager.lock(other)  # a running request's 3 pages: locked, never evicted for a load
    stack.manager.alloc_extend([other], [3 * T])
    req = FakeReq(list(a_tokens))
    assert stack.manager.match_prefix(req, evict_for_load=True) == 3 * T  # the 3 free pages of 6, no more
    stack.conserved([other.kv])
    torch.testing.assert_close(stack.kv_at(req.kv.prefix_indices), expected(kv, 3 * T), rtol=0, atol=0)
