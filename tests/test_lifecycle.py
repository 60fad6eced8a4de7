"""A request's KV through the KVManager the scheduler uses: admitted, chunked, finished, duplicated, retracted.

A small scheduler stand-in drives the manager with real `Req`s and real pools, in the scheduler's
order (match, lock, allocate, the forward's result processed, publish or release). After every step
it checks the conservation identity and single ownership, and that every live row position points
at a slot whose (simulated) KV was computed for exactly that request's tokens up to that position.
"""

from typing import Any

import pytest
import torch

from radixserve.managers.schedule_batch import Req
from radixserve.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from radixserve.mem_cache.conservation import check_conservation
from radixserve.mem_cache.kv_manager import KVManager
from radixserve.mem_cache.memory_pool import SLOT_DTYPE, ReqToTokenPool
from radixserve.mem_cache.radix_cache import RadixCache, RadixKey
from radixserve.sampling_params import SamplingParams


def request(prompt: list[int], namespace: Any = None) -> Req:
    return Req(f"r{prompt[:3]}", prompt, SamplingParams(max_new_tokens=64), namespace)


def seq(req: Req) -> list[int]:
    return req.origin_input_ids + req.output_ids


class World:
    """Pools + tree + manager + a record of what KV each slot holds, driven as the scheduler drives them."""

    def __init__(self, page_size: int, size: int = 512, rows: int = 8, disable: bool = False,
                 device: str = "cpu") -> None:
        self.pool = ReqToTokenPool(rows, 160, device)
        self.alloc = (TokenToKVPoolAllocator(size, device) if page_size == 1
                      else PagedTokenToKVPoolAllocator(size, page_size, device))
        self.cache = RadixCache(self.pool, self.alloc, page_size=page_size, disable=disable)
        self.kv = KVManager(self.pool, self.alloc, self.cache)
        self.active: list[Req] = []
        self.slot_kv: dict[int, tuple] = {}  # slot -> (namespace, tokens up to and including its position)

    def check(self) -> dict:
        report = check_conservation(self.alloc, self.cache, self.pool, [r.kv for r in self.active])
        for req in self.active:
            row = self.pool.req_to_token[req.kv.req_pool_idx, :req.kv.kv_allocated_len].tolist()
            for pos, slot in enumerate(row):
                assert self.slot_kv[slot] == (req.extra_key, tuple(seq(req)[:pos + 1])), (req, pos, slot)
        return report

    def admit(self, reqs: list[Req], chunk: int | None = None) -> None:
        for req in reqs:
            req.init_next_round_input()
            matched = self.kv.match_prefix(req)
            self.kv.lock(req)
            if chunk is not None:
                req.fill_ids = req.fill_ids[:matched + chunk]
            self.active.append(req)
        self.extend(reqs)

    def extend(self, reqs: list[Req]) -> None:
        prefix_lens = [r.kv.prefix_len for r in reqs]
        out = self.kv.alloc_extend(reqs, [len(r.fill_ids) for r in reqs])
        assert out.dtype == SLOT_DTYPE and len(out) == sum(len(r.fill_ids) for r in reqs) - sum(prefix_lens)
        for req, pre in zip(reqs, prefix_lens, strict=True):
            req.start_running()  # NOTE: what ScheduleBatch.prepare_for_extend does once the KV manager gave a row
            self._record(req, pre, len(req.fill_ids))
            self.kv.commit(req, len(req.fill_ids))  # the forward's result is processed
        self.check()

    def next_chunk(self, req: Req, chunk: int) -> None:
        self.kv.cache_unfinished_req(req, chunked=True)
        self.check()
        req.fill_ids = seq(req)[:len(req.fill_ids) + chunk]
        self.extend([req])

    def prefill_done(self, req: Req, token: int, finished: bool = False) -> None:
        assert len(req.fill_ids) == len(seq(req)), "prefill is not complete"
        req.output_ids.append(token)
        if finished:
            self.finish(req)
        else:
            self.kv.cache_unfinished_req(req)
            self.check()

    def launch_decode(self, reqs: list[Req]) -> list[int]:
        """Allocate the decode step's slots (its forward is now in flight); returns their positions."""
        positions = [r.kv.kv_allocated_len for r in reqs]
        self.kv.alloc_decode(reqs)
        for req, pos in zip(reqs, positions, strict=True):
            assert pos == len(seq(req)) - 1  # NOTE: the slot of the last sampled token, which has no KV yet
            self._record(req, pos, pos + 1)
        self.check()
        return positions

    def decode(self, reqs: list[Req], tokens: list[int]) -> None:
        positions = self.launch_decode(reqs)
        for req, pos, token in zip(reqs, positions, tokens, strict=True):
            self.kv.commit(req, pos + 1)
            req.output_ids.append(token)
        self.check()

    def finish(self, req: Req) -> None:
        self.kv.release(req, insert=True)
        self.active.remove(req)
        self.check()

    def retract(self, req: Req) -> None:
        self.kv.release(req, insert=False)
        req.reset_for_retract()
        self.active.remove(req)
        self.check()

    def _record(self, req: Req, start: int, end: int) -> None:
        for pos in range(start, end):
            slot = int(self.pool.req_to_token[req.kv.req_pool_idx, pos])
            self.slot_kv[slot] = (req.extra_key, tuple(seq(req)[:pos + 1]))


def test_chunked_prefill_with_pages_is_published_page_by_page():
    world = World(page_size=4, size=64)
    req = request(list(range(100, 110)))
    world.admit([req], chunk=4)
    world.next_chunk(req, 4)
    assert req.kv.prefix_len == 8 and req.kv.cache_protected_len == 4  # the first chunk was published
    world.next_chunk(req, 2)
    assert req.kv.prefix_len == 10 and req.kv.cache_protected_len == 8
    assert world.pool.req_to_token[req.kv.req_pool_idx, :10].tolist() == list(range(4, 14))
    world.prefill_done(req, 7)
    assert req.kv.cache_protected_len == 8 and world.check()["request_private"] == 12 - 8
    world.finish(req)
    assert world.check() == {"available": 56, "pending_free": 0, "evictable": 8, "protected": 0,
                             "request_private": 0, "size": 64}


def test_duplicate_prefix_rewrites_the_row_and_frees_the_copy():
    world = World(page_size=1, size=32)
    first, second = request(list(range(1, 9)) + [50]), request(list(range(1, 9)) + [60])
    world.admit([first, second])
    world.prefill_done(first, 70)
    world.prefill_done(second, 80)
    assert world.pool.req_to_token[second.kv.req_pool_idx, :9].tolist() == list(range(1, 9)) + [18]
    assert second.kv.cache_protected_len == 9 and world.alloc.available_size() == 32 - 10
    assert world.cache.total_size() == 10


def test_finish_inserts_committed_tokens_only():
    world = World(page_size=1, size=32)
    req = request([1, 2, 3, 4, 5, 6])
    world.admit([req])
    world.prefill_done(req, 7)
    world.decode([req], [8])
    world.decode([req], [9])
    world.finish(req)
    assert world.cache.total_size() == 8  # prompt 6 + outputs 7, 8; the last sample has no KV
    assert world.cache.match_prefix(RadixKey([1, 2, 3, 4, 5, 6, 7, 8, 9])).device_indices.numel() == 8


@pytest.mark.parametrize("page_size", [1, 4])
def test_finish_with_the_next_decode_in_flight_frees_the_overrun_slot(page_size):
    # The overlap loop: decode k+1 is allocated before decode k's result finishes the request.
    world = World(page_size=page_size, size=64)
    req = request(list(range(1, 4 * page_size + 3)))
    n = len(req.origin_input_ids)
    world.admit([req])
    world.prefill_done(req, 70)
    world.launch_decode([req])  # decode k feeds token 70 at position n
    world.kv.alloc_decode([req])  # decode k+1 is launched before k's result is back
    assert (req.kv.kv_committed_len, req.kv.kv_allocated_len) == (n, n + 2)
    world.kv.commit(req, n + 1)  # decode k's result: token 71, and the request is done
    req.output_ids.append(71)
    world.finish(req)
    assert world.cache.total_size() == (n + 1) // page_size * page_size  # what the normal loop inserts
    world.cache.evict(10**9)
    assert world.alloc.available_size() == world.alloc.size


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("namespace", [None, ("tenant", 1)])
def test_full_lifecycle(page_size, namespace, device="cpu"):
    world = World(page_size=page_size, size=1024, device=device)
    system = list(range(1000, 1000 + 3 * page_size + 1))
    a = request(system + [1, 2, 3], namespace)
    world.admit([a])
    world.prefill_done(a, 10)
    world.decode([a], [11])
    b = request(system + [4, 5], namespace)  # hits a's published prompt
    world.admit([b])
    assert b.kv.cache_protected_len == len(system) // page_size * page_size
    world.prefill_done(b, 20)
    c, d = (request(list(range(5000, 5000 + 2 * page_size + 2)), namespace),
            request(list(range(5000, 5000 + 2 * page_size + 2)), namespace))  # duplicates in one batch
    world.admit([c, d])
    world.prefill_done(c, 30)
    world.prefill_done(d, 31)
    rows = world.pool.req_to_token
    assert torch.equal(rows[c.kv.req_pool_idx, :2 * page_size], rows[d.kv.req_pool_idx, :2 * page_size])
    e = request(list(range(7000, 7000 + 5 * page_size + 3)), namespace)
    world.admit([e], chunk=page_size + page_size // 2 + 1)
    while len(e.fill_ids) < len(seq(e)):
        world.next_chunk(e, page_size + 1)
    world.prefill_done(e, 40)
    world.decode([a, b, c, d, e], [12, 21, 32, 33, 41])
    world.retract(b)
    assert b.kv.req_pool_idx is None and b.output_ids == [20, 21]
    world.finish(d)
    world.decode([a, c, e], [13, 34, 42])
    world.admit([b])  # re-prefills origin + output and hits its own published prompt
    assert b.kv.cache_protected_len >= len(system) // page_size * page_size
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
    req = request(list(range(30)))
    world.admit([req], chunk=8)
    world.next_chunk(req, 8)
    assert req.kv.prefix_len == 16 and req.kv.cache_protected_len == 0  # the row alone carries the prefix
    while len(req.fill_ids) < len(seq(req)):
        world.next_chunk(req, 8)
    world.prefill_done(req, 99)
    world.decode([req], [98])
    world.finish(req)
    assert world.alloc.available_size() == world.alloc.size and world.cache.total_size() == 0


@pytest.mark.parametrize("page_size", [1, 4])
def test_memory_pressure_evicts_only_the_shortfall(page_size):
    world = World(page_size=page_size, size=64)
    for i in range(6):
        req = request(list(range(100 * i, 100 * i + 12)))
        world.admit([req])
        world.prefill_done(req, 1, finished=True)
    available, evictable = world.alloc.available_size(), world.cache.evictable_size()
    need = 30 + (page_size if page_size > 1 else 0)  # the paged path reserves one page per request
    assert need - available > 0, "the scenario must force an eviction"
    big = request(list(range(9000, 9030)))
    world.admit([big])
    evicted = evictable - world.cache.evictable_size()
    assert need - available <= evicted < need - available + 12  # the shortfall, overshooting < one node
    world.prefill_done(big, 5, finished=True)
    assert world.check()["protected"] == 0


def test_release_without_a_row_only_unlocks_and_a_failed_allocation_returns_rows():
    world = World(page_size=1, size=16, rows=2)
    seed = request([1, 2, 3, 4])
    world.admit([seed])
    world.prefill_done(seed, 5, finished=True)
    queued = request([1, 2, 3, 9])
    queued.init_next_round_input()
    assert world.kv.match_prefix(queued) == 3
    world.kv.lock(queued)
    assert world.cache.protected_size() == 3
    world.kv.release(queued, insert=False)  # aborted between admission and allocation
    assert world.cache.protected_size() == 0 and queued.kv.last_node is None and not queued.kv.locked
    huge = request(list(range(100, 140)))
    huge.init_next_round_input()
    with pytest.raises(RuntimeError, match="out of KV memory"):
        world.kv.alloc_extend([huge], [len(huge.fill_ids)])
    assert huge.kv.req_pool_idx is None and world.pool.available_size() == 2
    world.check()


def test_only_the_manager_writes_a_request_handle():
    """The KV fields live on the handle; the request has no attribute of its own that could drift from it."""
    req = request([1, 2, 3])
    for name in ("req_pool_idx", "prefix_indices", "last_node", "cache_protected_len", "kv_committed_len",
                 "kv_allocated_len"):
        assert not hasattr(req, name) and hasattr(req.kv, name)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("page_size", [1, 16])
def test_full_lifecycle_on_cuda(page_size):
    test_full_lifecycle(page_size, ("tenant", 2), device="cuda")
