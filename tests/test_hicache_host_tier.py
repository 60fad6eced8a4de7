"""The host-memory tier of the hierarchical cache (host_tier.py) in front of the file backend: its byte bound and
LRU, device evictions landing in it, host-first loads (bit-identical in the pool's dtype, bounded error in
bfloat16), the fall-through to storage, per-tier counters, the flags, the page format's versions, and an end to end
on the embedded model. Conservation is checked after every step."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from test_hicache_storage_tier import DIM, FINGERPRINT, HEADS, LAYERS, FakeReq, Stack, expected, random_kv

from radixserve.managers.scheduler_metrics import SchedulerStats
from radixserve.mem_cache.hicache import HiCacheController, make_host_tier, storage_page_tokens
from radixserve.mem_cache.host_tier import HostKVTier, host_tier_bytes
from radixserve.mem_cache.kv_manager import KVManager
from radixserve.mem_cache.memory_pool import MHATokenToKVPool
from radixserve.mem_cache.radix_key import RadixKey
from radixserve.mem_cache.storage import page_format
from radixserve.mem_cache.storage.file_backend import FileStorageBackend
from radixserve.server_args import ServerArgs

T = storage_page_tokens(1)  # 32
PAGE_BYTES = 2 * LAYERS * T * HEADS * DIM * 4


class HostStack(Stack):
    """A Stack whose controller has a host tier of `host_bytes` (pages in `host_dtype`)."""

    def __init__(self, folder, host_bytes: int, host_dtype: torch.dtype | None = None, policy: str = "write_back",
                 pool_tokens: int = 512) -> None:
        super().__init__(folder, 1, policy, pool_tokens)
        self.host = HostKVTier(host_bytes, torch.float32, host_dtype)
        self.stats = SchedulerStats()
        self.hicache = HiCacheController(self.backend, self.kv_pool, self.alloc, self.tree, FINGERPRINT, T, policy,
                                         self.stats, self.host)
        self.manager = KVManager(self.rows, self.alloc, self.tree, None, self.hicache)

    def evict_all(self) -> None:
        self.tree.evict(self.tree.evictable_size())
        self.conserved()
        assert self.tree.evictable_size() == 0

    def loaded_kv(self, req: FakeReq, n: int) -> torch.Tensor:
        match = self.tree.match_prefix(RadixKey(req.fill_ids, None))
        return self.kv_at(match.device_indices[:n])


def _page(value: float) -> torch.Tensor:
    return torch.full((2, LAYERS, T, HEADS, DIM), value)


def test_the_byte_bound_and_lru_order():
    host = HostKVTier(3 * PAGE_BYTES, torch.float32)
    for i in range(3):
        assert host.put(f"k{i}", _page(i))
    assert host.usage() == 3 * PAGE_BYTES and len(host) == 3
    assert host.get("k0") is not None  # k0 is now the most recently used: k1 goes first
    assert host.put("k3", _page(3))
    assert "k1" not in host and {"k0", "k2", "k3"} <= {k for k in ("k0", "k1", "k2", "k3") if k in host}
    assert host.usage() == 3 * PAGE_BYTES and host.stats.evicted == 1
    assert host.get("k1") is None and host.stats.misses == 1
    assert not host.put("huge", torch.zeros(PAGE_BYTES))  # one page over the whole bound is refused
    assert host.usage() <= host.capacity_bytes
    page = _page(7.0)
    host.put("k7", page)
    page.fill_(0)  # NOTE: the tier keeps a copy, never the caller's tensor
    assert host.get("k7").eq(7.0).all()
    with pytest.raises(ValueError, match="hicache_size"):
        HostKVTier(0, torch.float32)


def test_a_device_eviction_lands_in_host_and_loads_back_bit_identical(tmp_path):
    stack = HostStack(tmp_path, 64 * PAGE_BYTES)
    req, kv = FakeReq(list(range(100, 100 + 4 * T + 5))), random_kv(4 * T + 5)
    assert stack.run(req, kv) == 0
    assert len(stack.host) == 0  # write_back: nothing stored until evicted
    stack.evict_all()
    assert len(stack.host) == 4 and stack.backend.stats.pages_written == 4  # evicted pages: host and storage
    req2 = FakeReq(list(req.fill_ids))
    assert stack.run(req2, kv) == 4 * T
    hc = stack.hicache
    assert hc.host_loaded_tokens == 4 * T and hc.storage_loaded_tokens == 0
    assert stack.host.stats.hits == 4 and stack.backend.stats.hits == 0  # never read from disk
    assert torch.equal(stack.loaded_kv(req2, 4 * T), expected(kv, 4 * T))  # NOTE: bit-identical in the pool dtype
    # the per-tier counters reach the scheduler's stats (what /metrics exports)
    assert stack.stats.hicache_host_loaded_tokens == 4 * T and stack.stats.hicache_host_hits == 4
    assert stack.stats.hicache_storage_loaded_tokens == 0 and stack.stats.hicache_load_seconds > 0
    assert stack.stats.hicache_store_seconds > 0 and stack.stats.hicache_host_usage_bytes == 4 * PAGE_BYTES


def test_the_match_carries_per_tier_lengths_and_a_partial_page(tmp_path):
    stack = HostStack(tmp_path, 64 * PAGE_BYTES, policy="write_through")
    kv = random_kv(3 * T + 1)
    stack.run(FakeReq(list(range(3 * T + 1))), kv)
    stack.evict_all()
    stack.host.delete(stack.hicache._keys(list(range(3 * T)), None)[2])  # page 2 only on disk now
    stack.run(FakeReq(list(range(T + 10)) + [9999] * 5), kv)  # the tree holds page 0 and 10 tokens of page 1 again
    stack.conserved()
    match = stack.tree.match_prefix(RadixKey(list(range(3 * T)), None))
    assert len(match.device_indices) == T + 10
    got = stack.hicache.extend_match(list(range(3 * T)), None, match)
    stack.conserved()
    assert len(got.device_indices) == 3 * T  # the load stops at the end of the head: 3 * T tokens
    assert got.host_hit_length == T - 10 and got.storage_hit_length == T
    assert torch.equal(stack.kv_at(got.device_indices), expected(kv, 3 * T))


def test_a_host_miss_falls_through_to_storage_and_is_promoted(tmp_path):
    first = HostStack(tmp_path, 64 * PAGE_BYTES, policy="write_through")
    req, kv = FakeReq(list(range(5, 5 + 3 * T + 1))), random_kv(3 * T + 1)
    first.run(req, kv)
    # a fresh 'process' with an empty host tier over the same directory: the pages come from disk
    second = HostStack(tmp_path, 64 * PAGE_BYTES, policy="write_through")
    assert second.run(FakeReq(list(req.fill_ids)), kv) == 3 * T
    assert second.hicache.storage_loaded_tokens == 3 * T and second.hicache.host_loaded_tokens == 0
    assert second.host.stats.misses == 3 and len(second.host) == 3  # promoted on the way
    second.evict_all()
    assert second.run(FakeReq(list(req.fill_ids)), kv) == 3 * T
    assert second.hicache.host_loaded_tokens == 3 * T and second.backend.stats.hits == 3  # no new disk read
    assert torch.equal(second.loaded_kv(req, 3 * T), expected(kv, 3 * T))


def test_a_small_host_tier_keeps_only_its_bound_and_storage_serves_the_rest(tmp_path):
    stack = HostStack(tmp_path, 2 * PAGE_BYTES)
    req, kv = FakeReq(list(range(50, 50 + 5 * T + 1))), random_kv(5 * T + 1)
    stack.run(req, kv)
    stack.evict_all()
    assert len(stack.host) == 2 and stack.host.usage() <= 2 * PAGE_BYTES
    assert stack.run(FakeReq(list(req.fill_ids)), kv) == 5 * T
    hc = stack.hicache
    assert hc.host_loaded_tokens + hc.storage_loaded_tokens == 5 * T and hc.storage_loaded_tokens >= 3 * T
    assert stack.host.usage() <= 2 * PAGE_BYTES
    assert torch.equal(stack.loaded_kv(req, 5 * T), expected(kv, 5 * T))


def test_bfloat16_host_pages_load_with_a_bounded_error(tmp_path):
    stack = HostStack(tmp_path, 64 * PAGE_BYTES, host_dtype=torch.bfloat16)
    req, kv = FakeReq(list(range(7, 7 + 2 * T + 1))), random_kv(2 * T + 1)
    stack.run(req, kv)
    stack.evict_all()
    assert stack.host.usage() == 2 * PAGE_BYTES // 2  # half the bytes of float32
    assert stack.run(FakeReq(list(req.fill_ids)), kv) == 2 * T and stack.hicache.host_loaded_tokens == 2 * T
    got, want = stack.loaded_kv(req, 2 * T), expected(kv, 2 * T)
    # NOTE: bf16 keeps 8 significant bits: a relative error of at most 2**-8 (round to nearest), never bit-equal
    assert not torch.equal(got, want)
    assert ((got - want).abs() <= want.abs() * 2 ** -8 + 1e-30).all()


def test_flags_size_the_host_tier_and_bad_values_name_the_field():
    assert host_tier_bytes(0, 0, 10**9) == 0 and host_tier_bytes(2, 0, 10**9) == 2 * 10**9
    assert host_tier_bytes(0, 1.5, 10**9) == 15 * 10**8 and host_tier_bytes(1, 4, 10**9) == 10**9
    pool = MHATokenToKVPool(512, 1, torch.float32, HEADS, DIM, LAYERS)
    assert make_host_tier(ServerArgs(), pool) is None  # off by default
    host = make_host_tier(ServerArgs(enable_hierarchical_cache=True, hicache_ratio=2.0, hicache_host_dtype="bfloat16"),
                          pool)
    assert host.capacity_bytes == 2 * 512 * 2 * HEADS * DIM * LAYERS * 4 and host.dtype == torch.bfloat16
    for bad, field in (({"hicache_size": -1}, "hicache_size"), ({"hicache_ratio": -0.5}, "hicache_ratio"),
                       ({"hicache_host_dtype": "int8"}, "hicache_host_dtype"),
                       ({"hicache_size": 1.0, "enable_hierarchical_cache": False}, "hicache_size")):
        with pytest.raises(ValueError, match=field):
            ServerArgs(**bad)


def test_the_per_tier_counters_are_exported_to_metrics():
    from prometheus_client import CollectorRegistry, generate_latest

    from radixserve.frontend.tokenizer_metrics import (
        SCHEDULER_COUNTERS,
        SCHEDULER_GAUGES,
        _SchedulerCollector,
    )

    state = SchedulerStats(hicache_host_loaded_tokens=64, hicache_storage_loaded_tokens=32, hicache_host_hits=2,
                           hicache_host_misses=1, hicache_load_seconds=0.25, hicache_host_usage_bytes=4096).as_dict()
    for key in [k for k in (*SCHEDULER_COUNTERS, *SCHEDULER_GAUGES) if k.startswith("hicache_")]:
        assert key in state, key  # NOTE: a metric whose key the stats lack would read 0 forever
    registry = CollectorRegistry()
    registry.register(_SchedulerCollector(lambda: state, lambda: True))
    text = generate_latest(registry).decode()
    for line in ("radixserve:hicache_host_loaded_tokens_total 64.0", "radixserve:hicache_storage_loaded_tokens_total 32.0",
                 "radixserve:hicache_host_hits_total 2.0", "radixserve:hicache_load_seconds_total 0.25",
                 "radixserve:hicache_host_usage_bytes 4096.0"):
        assert line in text, line


def test_pages_of_format_v1_still_verify_and_v2_is_written(tmp_path):
    store = FileStorageBackend(tmp_path, 1 << 30)
    payload = os.urandom(4096)
    header_v1 = page_format.HEADER.pack(page_format.MAGIC_V1, len(payload),
                                        page_format.checksum(payload, page_format.MAGIC_V1))
    (Path(tmp_path) / ("a" * 40 + ".kv")).write_bytes(header_v1 + payload)
    assert store.exists("a" * 40) and bytes(store.get("a" * 40)) == payload
    assert store.set("b" * 40, payload)
    raw = (Path(tmp_path) / ("b" * 40 + ".kv")).read_bytes()
    assert raw[:8] == b"RSKVPG02" and bytes(store.get("b" * 40)) == payload
    # a v1 header over a payload checksummed as v2 (or any mix) never verifies
    mixed = page_format.HEADER.pack(page_format.MAGIC_V1, len(payload), page_format.checksum(payload))
    assert not page_format.verify_parts(mixed, payload)
    flipped = bytearray(raw)
    flipped[page_format.HEADER_BYTES + 77] ^= 0x10
    assert page_format.verify_page(bytes(flipped)) is None and page_format.verify_page(raw) == payload


def test_end_to_end_the_second_round_is_served_from_host(loaded, tmp_path):
    """Two ~600-token prompts evict each other from a 1024-token pool (write_back: an evicted prompt goes to the
    host tier and the disk); the second round loads each from the host tier, as much as the free slots hold (a
    load never evicts), with greedy tokens identical to the first round's (computed, float32: the pool's dtype)."""
    from test_model_support import assert_engine_conserved

    from radixserve import Engine

    greedy = {"max_new_tokens": 8, "temperature": 0.0}
    prompts = [[(i * 7919) % 40000 + 100 for i in range(600)], [(i * 104729) % 40000 + 100 for i in range(600)]]
    with Engine(loaded_model=loaded, dtype="float32", device="cpu", max_total_tokens=1024, log_level="warning",
                enable_hierarchical_cache=True, hicache_storage_dir=str(tmp_path), hicache_ratio=2.0,
                hicache_write_policy="write_back") as engine:
        first = [engine.generate(input_ids=p, sampling_params=greedy) for p in prompts]
        assert_engine_conserved(engine)
        hc = engine.scheduler.kv_manager.hicache
        assert hc.host is not None and len(hc.host) >= 600 // 32  # the first prompt, evicted by the second
        before = 0
        for prompt, then in zip(prompts, first, strict=True):
            again = engine.generate(input_ids=prompt, sampling_params=greedy)
            assert_engine_conserved(engine)
            assert again["output_ids"] == then["output_ids"]
            loaded_now = hc.host_loaded_tokens - before
            before = hc.host_loaded_tokens
            # NOTE: ~417 slots are free when it is matched (the other prompt holds the rest): 13 whole pages
            assert loaded_now >= 12 * 32 and again["meta_info"]["cached_tokens"] >= loaded_now
            split = again["meta_info"]["cached_tokens_details"]
            assert split["host"] == loaded_now and split["storage"] == 0
            assert sum(split.values()) == again["meta_info"]["cached_tokens"]
        assert hc.storage_loaded_tokens == 0 and hc.backend.stats.hits == 0  # never read from disk
        state = engine.get_internal_state()  # NOTE: what /metrics exports
        assert state["hicache_host_loaded_tokens"] == hc.host_loaded_tokens
        assert state["hicache_host_hits"] == hc.host.stats.hits and state["hicache_load_seconds"] > 0


def test_kv_events_follow_pages_into_and_out_of_the_tiers(tmp_path):
    """With a KV event sink: the device tree's blocks (GPU), write_back's copies into host (CPU) and storage
    (STORAGE), the host bound dropping the oldest page (its blocks removed, CPU), and a load promoting a storage page
    into host again; the stored blocks of every medium carry the same hashes."""
    from radixserve.mem_cache.kv_events import BlockEncoder, KVEventSink

    stack, sink, encoder = HostStack(tmp_path, 2 * PAGE_BYTES), KVEventSink(None), BlockEncoder(1)
    stack.tree.kv_events = sink
    stack.hicache = HiCacheController(stack.backend, stack.kv_pool, stack.alloc, stack.tree, FINGERPRINT, T,
                                      "write_back", stack.stats, stack.host, sink)
    stack.manager = KVManager(stack.rows, stack.alloc, stack.tree, None, stack.hicache)
    req, kv = FakeReq(list(range(100, 100 + 3 * T + 1))), random_kv(3 * T + 1)
    stack.run(req, kv)
    (stored,) = encoder.encode(sink.take(0.01))
    device = stored[1]
    assert stored[0] == "BlockStored" and stored[-1] == "GPU" and len(device) == 3 * T + 1  # blocks of 1 token
    stack.evict_all()  # write_back: 3 pages to host (bound 2: page 0 dropped again) and to storage
    events = encoder.encode(sink.take(0.01))
    cpu = [e for e in events if e[0] == "BlockStored" and e[-1] == "CPU"]
    disk = [e for e in events if e[0] == "BlockStored" and e[-1] == "STORAGE"]
    assert [e[1] for e in cpu] == [e[1] for e in disk] == [device[i * T:(i + 1) * T] for i in range(3)]
    assert ["BlockRemoved", device[:T], "CPU"] in events  # the host bound dropped page 0
    assert ["BlockRemoved", device, "GPU"] in events
    assert len(stack.host) == 2 and stack.run(FakeReq(list(req.fill_ids)), kv) == 3 * T
    events = encoder.encode(sink.take(0.01))
    # NOTE: page 0 came from storage and was promoted into host (dropping page 1, the least recently used)
    assert ["BlockStored", device[:T], None, req.fill_ids[:T], 1, None, "CPU"] in events
    assert ["BlockRemoved", device[T:2 * T], "CPU"] in events
    stack.conserved()
