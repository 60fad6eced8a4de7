"""The disk tier behind a real KVManager, tree, allocator and KV pool (no model): write policies, loads, keys,
free-slot limits and conservation after every step."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from radixserve.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from radixserve.mem_cache.conservation import check_conservation
from radixserve.mem_cache.hicache import HiCacheController, make_hicache, storage_page_tokens
from radixserve.mem_cache.kv_manager import KVManager, ReqKV
from radixserve.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from radixserve.mem_cache.radix_cache import RadixCache
from radixserve.mem_cache.radix_key import RadixKey
from radixserve.mem_cache.storage.file_backend import FileStorageBackend
from radixserve.server_args import ServerArgs

LAYERS, HEADS, DIM, POOL = 2, 2, 4, 512
FINGERPRINT = b"f" * 20


@dataclass(eq=False)
class FakeReq:
    """A KVRequest: its whole prompt is `fill_ids`."""

    fill_ids: list[int]
    extra_key: Any = None
    kv: ReqKV = field(default_factory=ReqKV)
    output_ids: list[int] = field(default_factory=list)
    priority: int = 0

    @property
    def origin_input_ids(self) -> list[int]:
        return self.fill_ids

    @property
    def prefix_match_limit(self) -> int:
        return len(self.fill_ids) - 1


class Stack:
    """One 'process': pool, allocator, tree, manager and the disk tier over `folder`."""

    def __init__(self, folder, page_size: int = 1, policy: str = "write_through", pool_tokens: int = POOL) -> None:
        self.rows = ReqToTokenPool(4, 1024)
        self.alloc = (TokenToKVPoolAllocator(pool_tokens) if page_size == 1
                      else PagedTokenToKVPoolAllocator(pool_tokens, page_size))
        self.kv_pool = MHATokenToKVPool(pool_tokens, page_size, torch.float32, HEADS, DIM, LAYERS)
        self.tree = RadixCache(self.rows, self.alloc, page_size=page_size)
        self.backend = FileStorageBackend(folder, 1 << 30)
        self.hicache = HiCacheController(self.backend, self.kv_pool, self.alloc, self.tree, FINGERPRINT,
                                         storage_page_tokens(page_size), policy)
        self.manager = KVManager(self.rows, self.alloc, self.tree, None, self.hicache)

    def conserved(self, active: list[ReqKV] = ()) -> None:
        check_conservation(self.alloc, self.tree, self.rows, list(active))

    def run(self, req: FakeReq, kv_of: dict[int, torch.Tensor]) -> int:
        """Match, lock, allocate, 'compute' (write each position's KV from `kv_of`, a token -> KV function of the
        position), finish and hand the KV to the tree; returns the matched length."""
        matched = self.manager.match_prefix(req)
        self.manager.lock(req)
        self.manager.alloc_extend([req], [len(req.fill_ids)])
        row = self.rows.req_to_token[req.kv.req_pool_idx, : len(req.fill_ids)].long()
        for pos in range(matched, len(req.fill_ids)):
            for layer in range(LAYERS):
                self.kv_pool.k_buffer[layer][row[pos]] = kv_of[pos][0, layer]
                self.kv_pool.v_buffer[layer][row[pos]] = kv_of[pos][1, layer]
        self.conserved([req.kv])
        self.manager.commit(req, len(req.fill_ids))
        self.manager.release(req, insert=True)
        self.conserved()
        return matched

    def kv_at(self, slots: torch.Tensor) -> torch.Tensor:
        idx = slots.long()
        return torch.stack([torch.stack([self.kv_pool.k_buffer[layer][idx] for layer in range(LAYERS)]),
                            torch.stack([self.kv_pool.v_buffer[layer][idx] for layer in range(LAYERS)])])


def random_kv(n: int) -> dict[int, torch.Tensor]:
    gen = torch.Generator().manual_seed(n)
    return {pos: torch.randn(2, LAYERS, HEADS, DIM, generator=gen) for pos in range(n)}


def expected(kv_of: dict[int, torch.Tensor], n: int) -> torch.Tensor:
    return torch.stack([kv_of[pos] for pos in range(n)], dim=2)  # [2, layers, n, heads, dim]


@pytest.mark.parametrize("page_size", [1, 4])
def test_write_through_then_a_restart_loads_the_same_kv(tmp_path, page_size):
    tokens, kv_of = list(range(1000, 1100)), random_kv(100)
    first = Stack(tmp_path, page_size)
    assert first.run(FakeReq(tokens), kv_of) == 0
    assert first.backend.stats.pages_written == 3  # 96 of 100 tokens: whole 32-token pages only
    second = Stack(tmp_path, page_size)  # a restart: empty tree and pool, the same directory
    req = FakeReq(tokens + [5])
    assert second.manager.match_prefix(req) == 96 and second.hicache.loaded_tokens == 96
    torch.testing.assert_close(second.kv_at(req.kv.prefix_indices), expected(kv_of, 96), rtol=0, atol=0)
    second.conserved()  # NOTE: the loaded slots belong to the tree (evictable) before any lock
    assert second.tree.evictable_size() == 96
    assert second.run(req, {**kv_of, 100: kv_of[0]}) == 96
    assert second.manager.match_prefix(FakeReq(tokens + [5, 6])) == 101 // page_size * page_size  # a tree hit
    assert second.hicache.loaded_tokens == 96


def test_a_partial_tree_hit_is_extended_from_the_middle_of_a_page(tmp_path):
    tokens, kv_of = list(range(100)), random_kv(100)
    Stack(tmp_path).run(FakeReq(tokens), kv_of)
    second = Stack(tmp_path)
    second.run(FakeReq(tokens[:41]), kv_of)  # the tree holds 41 tokens (41 is not a page boundary)
    req = FakeReq(tokens + [1])
    assert second.manager.match_prefix(req) == 96
    torch.testing.assert_close(second.kv_at(req.kv.prefix_indices), expected(kv_of, 96), rtol=0, atol=0)
    second.conserved()


def test_the_match_never_covers_the_last_token(tmp_path):
    tokens, kv_of = list(range(100)), random_kv(100)
    Stack(tmp_path).run(FakeReq(tokens), kv_of)
    second = Stack(tmp_path)
    req = FakeReq(tokens[:96])  # the stored pages cover it whole; the last token must be computed
    assert second.manager.match_prefix(req) == 64


def test_other_namespaces_and_fingerprints_reuse_nothing(tmp_path):
    tokens, kv_of = list(range(100)), random_kv(100)
    Stack(tmp_path).run(FakeReq(tokens, extra_key="tenant-a"), kv_of)
    second = Stack(tmp_path)
    assert second.manager.match_prefix(FakeReq(tokens + [1], extra_key="tenant-b")) == 0
    assert second.manager.match_prefix(FakeReq(tokens + [1])) == 0
    assert second.manager.match_prefix(FakeReq(tokens + [1], extra_key="tenant-a")) == 96
    third = Stack(tmp_path)
    third.hicache.fingerprint = b"g" * 20
    assert third.manager.match_prefix(FakeReq(tokens + [1], extra_key="tenant-a")) == 0


def test_loads_only_into_free_slots(tmp_path):
    tokens, kv_of = list(range(100)), random_kv(100)
    Stack(tmp_path).run(FakeReq(tokens), kv_of)
    second = Stack(tmp_path, pool_tokens=128)
    held = second.alloc.alloc(128 - 40)  # 40 free slots: one page fits, not two
    req = FakeReq(tokens + [1])
    assert second.manager.match_prefix(req) == 32
    second.alloc.free(held)
    second.conserved()


def test_a_corrupt_page_ends_the_load_there(tmp_path):
    tokens, kv_of = list(range(100)), random_kv(100)
    first = Stack(tmp_path)
    first.run(FakeReq(tokens), kv_of)
    keys = first.hicache._keys(tokens, None)
    path = tmp_path / f"{keys[1]}.kv"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    second = Stack(tmp_path)
    assert second.manager.match_prefix(FakeReq(tokens + [1])) == 32
    assert second.backend.stats.corrupt == 1 and not path.exists()
    second.conserved()


def test_write_back_stores_on_eviction(tmp_path):
    tokens, kv_of = list(range(100)), random_kv(100)
    first = Stack(tmp_path, policy="write_back")
    first.run(FakeReq(tokens), kv_of)
    assert first.backend.stats.pages_written == 0
    assert first.manager.evict(POOL) >= 100  # NOTE: evicts the whole tree: the pages are stored first
    assert first.backend.stats.pages_written == 3
    first.conserved()
    second = Stack(tmp_path)
    req = FakeReq(tokens + [1])
    assert second.manager.match_prefix(req) == 96
    torch.testing.assert_close(second.kv_at(req.kv.prefix_indices), expected(kv_of, 96), rtol=0, atol=0)


def test_write_back_of_a_leaf_below_a_split(tmp_path):
    """Evicting a leaf whose pages begin in its parent's edge stores those pages with both nodes' slots."""
    kv_of = random_kv(100)
    first = Stack(tmp_path, policy="write_back")
    first.run(FakeReq(list(range(100))), kv_of)
    first.run(FakeReq(list(range(40)) + [7] * 60), {**kv_of, **{p: kv_of[0] for p in range(40, 100)}})
    first.manager.evict(POOL)
    second = Stack(tmp_path)
    req = FakeReq(list(range(100)) + [1])
    assert second.manager.match_prefix(req) == 96
    torch.testing.assert_close(second.kv_at(req.kv.prefix_indices), expected(kv_of, 96), rtol=0, atol=0)


def test_write_through_selective_stores_at_the_second_hit(tmp_path):
    tokens, kv_of = list(range(100)), random_kv(100)
    stack = Stack(tmp_path, policy="write_through_selective")
    stack.run(FakeReq(tokens), kv_of)
    assert stack.backend.stats.pages_written == 0
    stack.run(FakeReq(tokens + [1]), {**kv_of, 100: kv_of[0]})  # first hit of the 96-token match (3 pages)
    assert stack.backend.stats.pages_written == 0
    stack.run(FakeReq(tokens + [2]), {**kv_of, 100: kv_of[0]})  # second hit
    assert stack.backend.stats.pages_written == 3


def test_hybrid_pools_and_a_disabled_tree_are_refused():
    args = ServerArgs(enable_hierarchical_cache=True)
    hybrid = SimpleNamespace(sliding_window=512, disable=False, is_eagle=False)
    with pytest.raises(ValueError, match="sliding-window"):
        make_hicache(args, SimpleNamespace(), hybrid, SimpleNamespace(page_size=1))
    disabled = SimpleNamespace(sliding_window=None, disable=True, is_eagle=False)
    with pytest.raises(ValueError, match="radix cache"):
        make_hicache(args, SimpleNamespace(), disabled, SimpleNamespace(page_size=1))
    assert make_hicache(ServerArgs(), None, None, None) is None  # off by default


def test_radix_key_of_loaded_pages_is_the_requests(tmp_path):
    """Loaded nodes are filed under the request's namespace, as computed ones are."""
    tokens, kv_of = list(range(100)), random_kv(100)
    Stack(tmp_path).run(FakeReq(tokens, extra_key=("lora", "a")), kv_of)
    second = Stack(tmp_path)
    second.manager.match_prefix(FakeReq(tokens + [1], extra_key=("lora", "a")))
    assert len(second.tree.match_prefix(RadixKey(tokens, ("lora", "a"))).device_indices) == 96
    assert len(second.tree.match_prefix(RadixKey(tokens, None)).device_indices) == 0


def test_a_load_waits_for_forwards_in_flight_and_skips_if_that_fails(tmp_path):
    """Under the overlap loop a freed slot may still be written by the forward in flight: a load first waits."""
    tokens, kv_of = list(range(100)), random_kv(100)
    Stack(tmp_path).run(FakeReq(tokens), kv_of)
    second = Stack(tmp_path)
    calls = []
    second.hicache.before_pool_write = lambda: calls.append(second.alloc.available_size())
    assert second.manager.match_prefix(FakeReq(tokens + [1])) == 96
    assert calls == [POOL]  # called once, before any slot was taken

    def failed() -> None:
        raise RuntimeError("forward failed")

    third = Stack(tmp_path)
    third.hicache.before_pool_write = failed
    assert third.manager.match_prefix(FakeReq(tokens + [1])) == 0
    third.conserved()
