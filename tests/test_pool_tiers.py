"""The prefix-cache tier seam (radixserve/mem_cache/tiers.py): pools and trees say what they are.

Allocators declare `is_hybrid` and their tiers (`device`, and `window` for a hybrid pool) with each tier's capacity
and free slots; KV pools declare `is_hybrid` and `full_to_window`; trees declare `sliding_window`, report one
`KVTier` per tier with their evictable and protected slots, and a match's per-tier hit counts. The conservation
check, the scheduler's state report and the cache view loop over those tiers, and no module under radixserve/
probes for a hybrid pool with hasattr/getattr any more (an AST scan below).
"""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import pytest
import torch
from test_hybrid_kv import HybridWorld
from test_lifecycle import World, request

from radixserve.managers.scheduler_state import _window_pool
from radixserve.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from radixserve.mem_cache.cache_view import tree_snapshot
from radixserve.mem_cache.conservation import ConservationError, check_conservation
from radixserve.mem_cache.memory_pool import MHATokenToKVPool
from radixserve.mem_cache.radix_cache import MatchResult, RadixCache
from radixserve.mem_cache.radix_key import RadixKey
from radixserve.mem_cache.swa_memory import SWAKVPool, SWATokenToKVPoolAllocator
from radixserve.mem_cache.swa_radix_cache import SWARadixCache
from radixserve.mem_cache.tiers import DEVICE_TIER, WINDOW_TIER, KVTier, PrefixCache

PACKAGE = Path(__file__).resolve().parent.parent / "radixserve"


def _publish(tree: RadixCache, tokens: list[int]) -> None:
    """Insert `tokens` with fresh slots, freeing what the tree already held (as a finishing request does)."""
    alloc = tree.token_to_kv_pool_allocator
    value = alloc.alloc(len(tokens))
    alloc.free(value[: tree.insert(RadixKey(tokens), value)])


# ---------------------------------------------------------------------------------------------- allocators, pools
@pytest.mark.parametrize("alloc", [TokenToKVPoolAllocator(32), PagedTokenToKVPoolAllocator(32, 4)],
                         ids=["token", "paged"])
def test_a_plain_allocator_has_one_device_tier(alloc):
    assert alloc.is_hybrid is False and alloc.tier_names == (DEVICE_TIER,)
    taken = alloc.alloc(8)
    assert alloc.tier_capacity(DEVICE_TIER) == 32 and alloc.tier_free(DEVICE_TIER) == 24 == alloc.available_size()
    alloc.free(taken)
    assert alloc.tier_free(DEVICE_TIER) == 32
    with pytest.raises(KeyError, match="no KV tier 'window'.*tiers: device"):
        alloc.tier_capacity(WINDOW_TIER)


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_hybrid_allocator_has_a_device_and_a_window_tier(page_size):
    alloc = SWATokenToKVPoolAllocator(64, page_size, window_size=20)
    assert alloc.is_hybrid is True and alloc.tier_names == (DEVICE_TIER, WINDOW_TIER)
    full = alloc.alloc(8)
    assert (alloc.tier_capacity(DEVICE_TIER), alloc.tier_free(DEVICE_TIER)) == (64, 56)
    assert (alloc.tier_capacity(WINDOW_TIER), alloc.tier_free(WINDOW_TIER)) == (20, 12)
    alloc.free_window(full[:3])  # window KV only: the device tier does not move
    assert (alloc.tier_free(DEVICE_TIER), alloc.tier_free(WINDOW_TIER)) == (56, 15)
    with pytest.raises(KeyError, match="'host'"):
        alloc.tier_free("host")


def test_kv_pools_declare_whether_attention_translates_window_slots():
    plain = MHATokenToKVPool(16, 1, torch.float32, 1, 4, 2)
    assert plain.is_hybrid is False and plain.full_to_window is None
    alloc = SWATokenToKVPoolAllocator(16, 1, window_size=8)
    hybrid = SWAKVPool(16, 8, 1, torch.float32, 1, 4, [4, None], alloc.full_to_window)
    assert hybrid.is_hybrid is True and hybrid.full_to_window is alloc.full_to_window
    assert hybrid.k_buffer[0].shape[0] == 9 and hybrid.k_buffer[1].shape[0] == 17  # window layer: the small pool


# ---------------------------------------------------------------------------------------------- trees
def test_a_plain_tree_reports_its_device_tier():
    tree = RadixCache(None, TokenToKVPoolAllocator(64))
    assert tree.sliding_window is None and tree.is_hybrid is False and isinstance(tree, PrefixCache)
    _publish(tree, list(range(1, 11)))
    node = tree.match_prefix(RadixKey(list(range(1, 7)))).last_node  # splits: [1..6] -> [7..10]
    tree.inc_lock_ref(node)
    (device,) = tree.tiers()
    assert device == KVTier(DEVICE_TIER, 64, 54, evictable=4, protected=6)
    assert device.used == 10 and device.as_dict()["used"] == 10
    assert tree.node_tier_fields(node) == {}
    assert RadixCache().tiers() == []  # a tree with no pools (tests) has no tiers


def test_a_hybrid_tree_reports_both_tiers_with_window_locks():
    alloc = SWATokenToKVPoolAllocator(64, 1, window_size=32)
    tree = SWARadixCache(None, alloc, 1, sliding_window=4)
    assert tree.sliding_window == 4 and tree.is_hybrid is True and isinstance(tree, PrefixCache)
    _publish(tree, list(range(1, 13)))
    leaf = tree.match_prefix(RadixKey(list(range(1, 13)))).last_node
    tree.inc_lock_ref(leaf)
    mark = tree.inc_window_lock(leaf)  # protects the window KV of the last W - 1 = 3 tokens only
    device, window = tree.tiers()
    assert device == KVTier(DEVICE_TIER, 64, 52, evictable=0, protected=12)
    assert window == KVTier(WINDOW_TIER, 32, 20, evictable=9, protected=3)
    assert (window.evictable, window.protected) == (tree.window_evictable_size(), tree.window_protected_size())
    assert tree.node_tier_fields(leaf) == {"window": 3, "window_locks": 1}
    tree.dec_window_lock(leaf, mark)
    tree.dec_lock_ref(leaf)
    assert tree.tiers()[1] == KVTier(WINDOW_TIER, 32, 20, evictable=12, protected=0)
    assert check_conservation(alloc, tree, None, [])["window_evictable"] == 12


def test_a_hybrid_tree_refuses_a_plain_allocator():
    with pytest.raises(ValueError, match="hybrid allocator"):
        SWARadixCache(None, TokenToKVPoolAllocator(32), 1, sliding_window=4)
    with pytest.raises(ValueError, match="hybrid allocator"):
        SWARadixCache(None, None, 1, sliding_window=4)


# ---------------------------------------------------------------------------------------------- match results
def test_match_results_count_hits_per_tier():
    tree = RadixCache(None, TokenToKVPoolAllocator(64))
    _publish(tree, [5, 6, 7, 8])
    match = tree.match_prefix(RadixKey([5, 6, 7, 9]))
    assert match.device_hit_length == 3 == len(match.device_indices)
    assert (match.host_hit_length, match.storage_hit_length) == (0, 0)  # no host or storage tier
    assert match.last_device_node is match.last_node
    miss = tree.match_prefix(RadixKey([1, 2]))
    assert (miss.device_hit_length, miss.host_hit_length, miss.storage_hit_length) == (0, 0, 0)
    built = MatchResult(match.device_indices, match.last_node)  # the old two-field form still builds one
    assert built.host_hit_length == 0 and built.storage_hit_length == 0
    filled = built._replace(host_hit_length=4, storage_hit_length=8)
    assert (filled.device_hit_length, filled.host_hit_length, filled.storage_hit_length) == (3, 4, 8)


def test_a_hybrid_match_counts_only_the_usable_device_hit():
    alloc = SWATokenToKVPoolAllocator(64, 1, window_size=64)
    tree = SWARadixCache(None, alloc, 1, sliding_window=4)
    tokens = list(range(1, 13))
    _publish(tree, tokens)
    assert tree.match_prefix(RadixKey(tokens)).device_hit_length == 12
    assert tree.evict_window(3) == 12  # the one node's window KV goes whole (a tombstone); its full KV stays
    match = tree.match_prefix(RadixKey(tokens))
    assert tree.total_size() == 12 and match.device_hit_length == 0 == len(match.device_indices)
    assert (match.host_hit_length, match.storage_hit_length) == (0, 0)


# ---------------------------------------------------------------------------------------------- reports loop over tiers
def _tier_terms(report: dict, tiers: list[KVTier]) -> None:
    """The conservation report and the tiers agree, tier by tier."""
    device = tiers[0]
    assert (report["available"], report["evictable"], report["protected"], report["size"]) == (
        device.free, device.evictable, device.protected, device.capacity)
    for tier in tiers[1:]:
        assert (report[f"{tier.name}_available"], report[f"{tier.name}_evictable"],
                report[f"{tier.name}_protected"], report[f"{tier.name}_size"]) == (
            tier.free, tier.evictable, tier.protected, tier.capacity)


@pytest.mark.parametrize("hybrid", [False, True], ids=["plain", "hybrid"])
def test_running_requests_keep_the_tiers_and_the_conservation_report_in_step(hybrid):
    world = HybridWorld(window=8, page_size=1, size=256, window_size=256) if hybrid else World(1, size=256)
    a, b = request(list(range(100, 130))), request(list(range(100, 120)) + [7, 8, 9])
    world.admit([a])
    world.prefill_done(a, 1)
    _tier_terms(world.check(), world.cache.tiers())
    world.admit([b])  # shares a's first 20 tokens
    world.prefill_done(b, 2)
    for step in range(12):
        world.decode([a, b], [3 + step, 40 + step])
        _tier_terms(world.check(), world.cache.tiers())
    world.finish(a)
    world.finish(b)
    report = world.check()  # NOTE: conservation after the requests: nothing held, nothing leaked
    _tier_terms(report, world.cache.tiers())
    assert report["protected"] == 0 and ("window_protected" in report) == hybrid
    assert [t.name for t in world.cache.tiers()] == ([DEVICE_TIER, WINDOW_TIER] if hybrid else [DEVICE_TIER])


class _HostTierAllocator(TokenToKVPoolAllocator):
    """A pool declaring a tier no conservation check knows (as a host tier would before its check is written)."""

    tier_names: ClassVar[tuple[str, ...]] = (DEVICE_TIER, "host")


def test_conservation_refuses_a_tier_it_has_no_check_for():
    alloc = _HostTierAllocator(16)
    with pytest.raises(ConservationError, match="no conservation check for KV tier 'host'"):
        check_conservation(alloc, RadixCache(None, alloc), None, [])


def test_state_report_lists_each_tier_past_the_device_pool():
    plain = RadixCache(None, TokenToKVPoolAllocator(64))
    assert _window_pool(SimpleNamespace(tree_cache=plain)) == {}
    alloc = SWATokenToKVPoolAllocator(64, 1, window_size=24)
    tree = SWARadixCache(None, alloc, 1, sliding_window=4)
    _publish(tree, list(range(1, 9)))
    assert _window_pool(SimpleNamespace(tree_cache=tree)) == {
        "window_pool_tokens": 24, "window_available_tokens": 16, "window_evictable_tokens": 8,
        "window_protected_tokens": 0, "sliding_window": 4}


def test_cache_view_shows_window_fields_only_for_a_hybrid_tree():
    plain = RadixCache(None, TokenToKVPoolAllocator(64))
    _publish(plain, [1, 2, 3])
    assert all("window" not in node for node in tree_snapshot(plain)["nodes"])
    tree = SWARadixCache(None, SWATokenToKVPoolAllocator(64, 1, window_size=24), 1, sliding_window=4)
    _publish(tree, [1, 2, 3])
    nodes = tree_snapshot(tree)["nodes"]
    assert [(n["len"], n["window"], n["window_locks"]) for n in nodes] == [(0, 0, 0), (3, 3, 0)]


# ---------------------------------------------------------------------------------------------- no probes left
# NOTE: attributes only a hybrid pool, a hybrid tree or a hybrid model runner has (or the declared interface itself):
# reading any of them through hasattr/getattr is a probe for the pool kind, which the interface replaces.
PROBED = {"full_to_window", "window", "window_size", "window_available_size", "window_evictable_size",
          "window_protected_size", "window_count", "window_present", "free_window", "transfer_window",
          "evict_window", "inc_window_lock", "dec_window_lock", "sliding_window", "swa_window", "is_hybrid",
          "tier_names", "tiers", "tier_capacity", "tier_free", "tier_lock_sizes", "node_tier_fields"}


def _probes(source: str, name: str) -> list[str]:
    """`name:line hasattr/getattr(..., 'attr')` for each probe of an attribute in PROBED."""
    found = []
    for node in ast.walk(ast.parse(source, name)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("hasattr", "getattr")
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value in PROBED):
            found.append(f"{name}:{node.lineno} {node.func.id}(..., {node.args[1].value!r})")
    return found


def test_the_scan_finds_probes_and_only_probes():
    source = ("table = getattr(fb.token_to_kv_pool, 'full_to_window', None)\n"
              "if hasattr(tree, 'window_evictable_size'): pass\n"
              "device = getattr(alloc, 'device', None)\n"
              "table = pool.full_to_window\n")
    assert _probes(source, "m.py") == ["m.py:1 getattr(..., 'full_to_window')",
                                       "m.py:2 hasattr(..., 'window_evictable_size')"]


def test_no_module_probes_for_a_hybrid_pool():
    found = [probe for path in sorted(PACKAGE.rglob("*.py"))
             for probe in _probes(path.read_text(), str(path.relative_to(PACKAGE.parent)))]
    assert found == [], "probes for a hybrid pool: read the declared interface (mem_cache/tiers.py) instead:\n" + \
        "\n".join(found)
