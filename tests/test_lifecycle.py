"""Request lifecycle with real pools: admitted, chunked, finished, duplicated, retracted (reference 2.6, 2.7, 2.10, 3).

A small scheduler stand-in drives the cache. After every step it checks the conservation identity
and single ownership, and that every live row position points at a slot whose (simulated) KV
was computed for exactly that request's tokens up to that position.
"""

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from radixserve.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from radixserve.mem_cache.common import alloc_for_decode, alloc_for_extend, release_kv_cache
from radixserve.mem_cache.conservation import check_conservation
from radixserve.mem_cache.memory_pool import ReqToTokenPool
from radixserve.mem_cache.radix_cache import RadixCache, RadixKey


@dataclass(eq=False)
class Req:
    origin_input_ids: list[int]
    extra_key: Any = None
    output_ids: list[int] = field(default_factory=list)
    fill_ids: list[int] = field(default_factory=list)
    req_pool_idx: int | None = None
    prefix_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    last_node: Any = None
    cache_protected_len: int = 0
    kv_committed_len: int = 0
    kv_allocated_len: int = 0

    def seq(self) -> list[int]:
        return self.origin_input_ids + self.output_ids


class World:
    """Pools + cache + a record of what KV each slot holds, driven like the scheduler drives them."""

    def __init__(self, page_size: int, size: int = 512, rows: int = 8, disable: bool = False,
                 device: str = "cpu") -> None:
        self.pool = ReqToTokenPool(rows, 160, device)
        self.alloc = (TokenToKVPoolAllocator(size, device) if page_size == 1
                      else PagedTokenToKVPoolAllocator(size, page_size, device))
        self.cache = RadixCache(self.pool, self.alloc, page_size=page_size, disable=disable)
        self.active: list[Req] = []
        self.kv: dict[int, tuple] = {}  # slot -> (namespace, tokens up to and including its position)

    def check(self) -> dict:
        report = check_conservation(self.alloc, self.cache, self.pool, self.active)
        for req in self.active:
            row = self.pool.req_to_token[req.req_pool_idx, :req.kv_allocated_len].tolist()
            seq = req.seq()
            for pos, slot in enumerate(row):
                assert self.kv[slot] == (req.extra_key, tuple(seq[:pos + 1])), (req, pos, slot)
        return report

    def admit(self, reqs: list[Req], chunk: int | None = None) -> None:
        for req in reqs:
            full = req.seq()
            match = self.cache.match_prefix(RadixKey(full[:len(full) - 1], req.extra_key))
            req.prefix_indices, req.last_node = match.device_indices, match.last_node
            req.cache_protected_len = len(match.device_indices)
            self.cache.inc_lock_ref(req.last_node)
            end = len(full) if chunk is None else min(len(full), len(match.device_indices) + chunk)
            req.fill_ids = full[:end]
            self.active.append(req)
        self.extend(reqs)

    def extend(self, reqs: list[Req]) -> None:
        alloc_for_extend(reqs, self.cache)
        for req in reqs:
            self._record(req, len(req.prefix_indices), len(req.fill_ids))
        self.check()

    def next_chunk(self, req: Req, chunk: int) -> None:
        self.cache.cache_unfinished_req(req, chunked=True)
        self.check()
        req.fill_ids = req.seq()[:len(req.fill_ids) + chunk]
        self.extend([req])

    def prefill_done(self, req: Req, token: int, finished: bool = False) -> None:
        assert len(req.fill_ids) == len(req.seq()), "prefill is not complete"
        req.output_ids.append(token)
        if finished:
            self.finish(req)
        else:
            self.cache.cache_unfinished_req(req)
            self.check()

    def decode(self, reqs: list[Req], tokens: list[int]) -> None:
        positions = [req.kv_allocated_len for req in reqs]
        alloc_for_decode(reqs, self.cache)
        for req, pos, token in zip(reqs, positions, tokens, strict=True):
            self._record(req, pos, pos + 1)
            req.output_ids.append(token)
        self.check()

    def finish(self, req: Req) -> None:
        release_kv_cache(req, self.cache, is_insert=True)
        self.active.remove(req)
        self.check()

    def retract(self, req: Req) -> None:
        release_kv_cache(req, self.cache, is_insert=False)
        self.active.remove(req)
        self.check()

    def _record(self, req: Req, start: int, end: int) -> None:
        seq = req.seq()
        for pos in range(start, end):
            slot = int(self.pool.req_to_token[req.req_pool_idx, pos])
            self.kv[slot] = (req.extra_key, tuple(seq[:pos + 1]))


def test_example_c_chunked_prefill_with_pages():
    world = World(page_size=4, size=64)
    req = Req(list(range(100, 110)))
    world.admit([req], chunk=4)
    world.next_chunk(req, 4)
    assert req.prefix_indices.tolist() == [4, 5, 6, 7] and req.cache_protected_len == 4
    world.next_chunk(req, 2)
    assert req.prefix_indices.tolist() == list(range(4, 12)) and req.cache_protected_len == 8
    world.prefill_done(req, 7)
    assert req.prefix_indices.tolist() == list(range(4, 14)) and req.cache_protected_len == 8
    assert world.check()["request_private"] == 12 - 8
    world.finish(req)
    assert world.check() == {"available": 56, "pending_free": 0, "evictable": 8, "protected": 0,
                             "request_private": 0, "size": 64}


def test_example_d_duplicate_prefix_rewrites_the_row():
    world = World(page_size=1, size=32)
    first, second = Req(list(range(1, 9)) + [50]), Req(list(range(1, 9)) + [60])
    world.admit([first, second])
    world.prefill_done(first, 70)
    world.prefill_done(second, 80)
    assert world.pool.req_to_token[second.req_pool_idx, :9].tolist() == list(range(1, 9)) + [18]
    assert second.cache_protected_len == 9 and world.alloc.available_size() == 32 - 10
    assert world.cache.total_size() == 10


def test_example_l_finish_inserts_committed_tokens_only():
    world = World(page_size=1, size=32)
    req = Req([1, 2, 3, 4, 5, 6])
    world.admit([req])
    world.prefill_done(req, 7)
    world.decode([req], [8])
    world.decode([req], [9])
    world.finish(req)
    assert world.cache.total_size() == 8  # prompt 6 + outputs 7, 8; the last sample has no KV
    assert world.cache.match_prefix(RadixKey([1, 2, 3, 4, 5, 6, 7, 8, 9])).device_indices.numel() == 8


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("namespace", [None, ("tenant", 1)])
def test_full_lifecycle(page_size, namespace, device="cpu"):
    world = World(page_size=page_size, size=1024, device=device)
    system = list(range(1000, 1000 + 3 * page_size + 1))
    a = Req(system + [1, 2, 3], namespace)
    world.admit([a])
    world.prefill_done(a, 10)
    world.decode([a], [11])
    b = Req(system + [4, 5], namespace)  # hits a's published prompt
    world.admit([b])
    assert b.cache_protected_len == len(system) // page_size * page_size
    world.prefill_done(b, 20)
    c, d = Req(list(range(5000, 5000 + 2 * page_size + 2)), namespace), \
        Req(list(range(5000, 5000 + 2 * page_size + 2)), namespace)  # duplicates in one batch
    world.admit([c, d])
    world.prefill_done(c, 30)
    world.prefill_done(d, 31)
    assert torch.equal(c.prefix_indices[:2 * page_size], d.prefix_indices[:2 * page_size])
    e = Req(list(range(7000, 7000 + 5 * page_size + 3)), namespace)
    world.admit([e], chunk=page_size + page_size // 2 + 1)
    while len(e.fill_ids) < len(e.seq()):
        world.next_chunk(e, page_size + 1)
    world.prefill_done(e, 40)
    world.decode([a, b, c, d, e], [12, 21, 32, 33, 41])
    world.retract(b)
    assert b.req_pool_idx is None and b.output_ids == [20, 21]
    world.finish(d)
    world.decode([a, c, e], [13, 34, 42])
    world.admit([b])  # re-prefills origin + output and hits its own published prompt
    assert b.cache_protected_len >= len(system) // page_size * page_size
    world.prefill_done(b, 22)
    for req in list(world.active):
        world.finish(req)
    idle = world.check()
    assert idle["protected"] == 0 and idle["available"] + idle["evictable"] == idle["size"]
    world.cache.evict(10**9)
    assert world.check()["available"] == world.alloc.size


@pytest.mark.parametrize("page_size", [1, 4])
def test_disabled_cache_lifecycle(page_size):
    world = World(page_size=page_size, size=128, disable=True)
    req = Req(list(range(30)))
    world.admit([req], chunk=8)
    world.next_chunk(req, 8)
    assert req.prefix_indices.numel() == 8 and req.cache_protected_len == 0
    while len(req.fill_ids) < len(req.seq()):
        world.next_chunk(req, 8)
    world.prefill_done(req, 99)
    world.decode([req], [98])
    world.finish(req)
    assert world.alloc.available_size() == world.alloc.size and world.cache.total_size() == 0


@pytest.mark.parametrize("page_size", [1, 4])
def test_memory_pressure_evicts_only_the_shortfall(page_size):
    world = World(page_size=page_size, size=64)
    for i in range(6):
        req = Req(list(range(100 * i, 100 * i + 12)))
        world.admit([req])
        world.prefill_done(req, 1, finished=True)
    available, evictable = world.alloc.available_size(), world.cache.evictable_size()
    need = 30 + (page_size if page_size > 1 else 0)  # the paged path reserves one page per request
    assert need - available > 0, "the scenario must force an eviction"
    big = Req(list(range(9000, 9030)))
    world.admit([big])
    evicted = evictable - world.cache.evictable_size()
    assert need - available <= evicted < need - available + 12  # the shortfall, overshooting < one node
    world.prefill_done(big, 5, finished=True)
    assert world.check()["protected"] == 0


def test_release_without_a_row_only_unlocks_and_failed_alloc_returns_rows():
    world = World(page_size=1, size=16, rows=2)
    seed = Req([1, 2, 3, 4])
    world.admit([seed])
    world.prefill_done(seed, 5, finished=True)
    queued = Req([1, 2, 3, 9])
    match = world.cache.match_prefix(RadixKey(queued.origin_input_ids[:3]))
    queued.last_node, queued.cache_protected_len = match.last_node, 3
    world.cache.inc_lock_ref(match.last_node)
    assert world.cache.protected_size() == 3
    release_kv_cache(queued, world.cache)  # aborted between match and allocation
    assert world.cache.protected_size() == 0 and queued.last_node is None
    huge = Req(list(range(100, 140)))
    huge.fill_ids = huge.origin_input_ids
    with pytest.raises(RuntimeError, match="Out of memory"):
        alloc_for_extend([huge], world.cache)
    assert huge.req_pool_idx is None and world.pool.available_size() == 2
    world.check()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("page_size", [1, 16])
def test_full_lifecycle_on_cuda(page_size):
    test_full_lifecycle(page_size, ("tenant", 2), device="cuda")
