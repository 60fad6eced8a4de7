"""RadixCache operations and edge cases (match, split, insert, locks, eviction, a disabled cache) at page sizes
1, 4, 16, with and without extra_key."""

import pytest
import torch

from radixserve.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from radixserve.mem_cache.memory_pool import SLOT_DTYPE
from radixserve.mem_cache.radix_cache import RadixCache, RadixKey

CASES = [(ps, ns) for ps in (1, 4, 16) for ns in (None, "ns")]


def toks(ps: int, *pages: int) -> list[int]:
    """Tokens of the given pages; page p is ps distinct tokens p*1000 .. p*1000+ps-1."""
    return [p * 1000 + i for p in pages for i in range(ps)]


@pytest.fixture(params=CASES, ids=[f"ps{ps}-{ns}" for ps, ns in CASES])
def case(request):
    ps, ns = request.param
    return ps, ns, RadixCache(page_size=ps)


def key(tokens, ns):
    return RadixKey(tokens, ns)


def values(n: int, start: int = 100) -> torch.Tensor:
    return torch.arange(start, start + n, dtype=SLOT_DTYPE)


def test_empty_cache_and_short_keys_return_root(case):
    ps, ns, cache = case
    for tokens in ([], toks(ps, 1), toks(ps, 1)[: ps - 1] if ps > 1 else []):
        result = cache.match_prefix(key(tokens, ns))
        assert len(result.device_indices) == 0 and result.last_node is cache.root_node
    cache.insert(key(toks(ps, 1, 2), ns), values(2 * ps))
    short = cache.match_prefix(key(toks(ps, 1)[: ps - 1], ns))
    assert len(short.device_indices) == (ps - 1 if ps == 1 else 0)


def test_insert_then_match_returns_the_values(case):
    ps, ns, cache = case
    tokens = toks(ps, 1, 2, 3)
    assert cache.insert(key(tokens, ns), values(3 * ps)) == 0
    assert cache.total_size() == cache.evictable_size() == 3 * ps
    result = cache.match_prefix(key(tokens, ns))
    assert result.device_indices.tolist() == values(3 * ps).tolist()
    assert result.device_indices.dtype == SLOT_DTYPE
    assert result.last_node.parent is cache.root_node


def test_insert_returns_already_present_prefix_and_keeps_tree_values(case):
    ps, ns, cache = case
    cache.insert(key(toks(ps, 1, 2), ns), values(2 * ps, 100))
    prefix_len = cache.insert(key(toks(ps, 1, 2, 3), ns), values(3 * ps, 500))
    assert prefix_len == 2 * ps
    got = cache.match_prefix(key(toks(ps, 1, 2, 3), ns)).device_indices.tolist()
    assert got == values(2 * ps, 100).tolist() + values(ps, 500 + 2 * ps).tolist()
    assert cache.insert(key(toks(ps, 1, 2, 3), ns), values(3 * ps, 900)) == 3 * ps
    assert cache.total_size() == 3 * ps


def test_insert_drops_the_unaligned_tail(case):
    ps, ns, cache = case
    tokens = toks(ps, 1, 2) + [7] * (ps - 1)
    cache.insert(key(tokens, ns), values(len(tokens)))
    assert cache.total_size() == len(tokens) // ps * ps


def test_insert_value_none_stores_token_ids_and_short_value_is_an_error(case):
    ps, ns, cache = case
    tokens = toks(ps, 4, 5)
    assert cache.insert(key(tokens, ns)) == 0
    assert cache.match_prefix(key(tokens, ns)).device_indices.tolist() == tokens
    with pytest.raises(ValueError):
        cache.insert(key(toks(ps, 6, 7), ns), values(ps))


def test_match_inside_an_edge_splits_it(case):
    ps, ns, cache = case
    cache.insert(key(toks(ps, 1, 2, 3, 4, 5), ns), values(5 * ps))
    nodes_before = cache.node_count()
    result = cache.match_prefix(key(toks(ps, 1, 2), ns))
    assert result.device_indices.tolist() == values(2 * ps).tolist()
    upper = result.last_node
    assert len(upper.key) == 2 * ps and len(upper.children) == 1
    (lower,) = upper.children.values()
    assert len(lower.key) == 3 * ps and lower.parent is upper
    assert cache.node_count() == nodes_before + 1
    assert cache.total_size() == cache.evictable_size() == 5 * ps
    assert cache.evictable_leaves == {lower}


def test_divergence_in_first_page_matches_nothing(case):
    ps, ns, cache = case
    cache.insert(key(toks(ps, 1, 2), ns), values(2 * ps))
    query = toks(ps, 1, 2)
    query[ps - 1] = -5  # last token of the first page differs
    result = cache.match_prefix(key(query, ns))
    assert len(result.device_indices) == (ps - 1 if ps == 1 else 0)
    assert result.last_node is cache.root_node


def test_divergence_inside_a_later_page_rounds_down(case):
    ps, ns, cache = case
    cache.insert(key(toks(ps, 1, 2), ns), values(2 * ps))
    query = toks(ps, 1, 2)
    query[ps + ps // 2] = -5
    result = cache.match_prefix(key(query, ns))
    expected = ps + ps // 2 if ps == 1 else ps
    assert len(result.device_indices) == expected
    assert len(result.last_node.key) == expected


def test_split_copies_locks_priority_and_hits_and_keeps_counters(case):
    ps, ns, cache = case
    cache.insert(key(toks(ps, 1, 2, 3), ns), values(3 * ps), priority=5)
    leaf = cache.match_prefix(key(toks(ps, 1, 2, 3), ns)).last_node
    cache.inc_lock_ref(leaf)
    counters = (cache.evictable_size(), cache.protected_size())
    upper = cache.match_prefix(key(toks(ps, 1), ns)).last_node
    assert (upper.lock_ref, upper.priority, upper.hit_count) == (1, 5, leaf.hit_count)
    assert (cache.evictable_size(), cache.protected_size()) == counters
    assert upper.creation_time > leaf.creation_time


def test_match_refreshes_access_time_but_not_hit_count(case):
    ps, ns, cache = case
    cache.insert(key(toks(ps, 1, 2), ns), values(2 * ps))
    node = cache.match_prefix(key(toks(ps, 1, 2), ns)).last_node
    before_time, before_hits = node.last_access_time, node.hit_count
    cache.match_prefix(key(toks(ps, 1, 2), ns))
    assert node.last_access_time > before_time and node.hit_count == before_hits
    cache.insert(key(toks(ps, 1, 2), ns), values(2 * ps), priority=3)
    assert node.hit_count == before_hits + 1 and node.priority == 3
    cache.insert(key(toks(ps, 1, 2), ns), values(2 * ps), priority=1, chunked=True)
    assert node.hit_count == before_hits + 1 and node.priority == 3


def test_lock_moves_tokens_between_counters_along_the_path(case):
    ps, ns, cache = case
    cache.insert(key(toks(ps, 1, 2), ns), values(2 * ps))
    cache.insert(key(toks(ps, 1, 2, 5, 6), ns), values(4 * ps))
    cache.insert(key(toks(ps, 1, 2, 7), ns), values(3 * ps))
    leaf = cache.match_prefix(key(toks(ps, 1, 2, 5, 6), ns)).last_node
    assert cache.evictable_size() == 5 * ps
    assert cache.inc_lock_ref(leaf) == -4 * ps
    assert (cache.evictable_size(), cache.protected_size()) == (ps, 4 * ps)
    assert cache.inc_lock_ref(leaf) == 0  # a second holder moves nothing
    assert cache.dec_lock_ref(leaf) == 0
    assert cache.dec_lock_ref(leaf) == 4 * ps
    assert (cache.evictable_size(), cache.protected_size()) == (5 * ps, 0)
    with pytest.raises(ValueError):
        cache.dec_lock_ref(leaf)
    assert cache.inc_lock_ref(cache.root_node) == 0


def test_lock_of_a_foreign_or_evicted_node_is_refused(case):
    ps, ns, cache = case
    other = RadixCache(page_size=ps)
    other.insert(key(toks(ps, 1), ns))
    foreign = other.match_prefix(key(toks(ps, 1), ns)).last_node
    with pytest.raises(ValueError):
        cache.inc_lock_ref(foreign)
    cache.insert(key(toks(ps, 2), ns))
    node = cache.match_prefix(key(toks(ps, 2), ns)).last_node
    cache.evict(ps)
    with pytest.raises(ValueError):
        cache.inc_lock_ref(node)


def test_evict_takes_whole_nodes_in_lru_order_and_may_overshoot(case):
    ps, ns, cache = case
    cache.insert(key(toks(ps, 1, 2), ns), values(2 * ps, 100))  # oldest
    cache.insert(key(toks(ps, 3, 4, 5), ns), values(3 * ps, 200))
    cache.insert(key(toks(ps, 6), ns), values(ps, 300))
    assert cache.evict(1) == 2 * ps
    assert cache.match_prefix(key(toks(ps, 1, 2), ns)).device_indices.numel() == 0
    cache.match_prefix(key(toks(ps, 3, 4, 5), ns))  # now most recent
    assert cache.evict(1) == ps
    assert cache.match_prefix(key(toks(ps, 3, 4, 5), ns)).device_indices.numel() == 3 * ps
    assert cache.evict(10**6) == 3 * ps and cache.total_size() == 0
    assert cache.evict(5) == 0 and cache.evict(0) == 0


def test_evict_climbs_to_parents_and_spares_locked_paths(case):
    ps, ns, cache = case
    cache.insert(key(toks(ps, 1, 2), ns))
    cache.insert(key(toks(ps, 1, 2, 3), ns))
    cache.insert(key(toks(ps, 1, 2, 4), ns))
    cache.insert(key(toks(ps, 9), ns))
    locked = cache.match_prefix(key(toks(ps, 1, 2, 3), ns)).last_node
    cache.inc_lock_ref(locked)
    assert cache.evict(10**6) == 2 * ps  # [4] and [9]; [1,2] and [3] are locked
    assert cache.total_size() == cache.protected_size() == 3 * ps
    cache.dec_lock_ref(locked)
    assert cache.evict(10**6) == 3 * ps  # leaf [3], then its parent [1,2] once it is a leaf
    assert cache.node_count() == 0 and not cache.evictable_leaves


def test_evict_frees_slots_into_the_allocator(case):
    ps, ns, _ = case
    allocator = TokenToKVPoolAllocator(64) if ps == 1 else PagedTokenToKVPoolAllocator(64, ps)
    cache = RadixCache(token_to_kv_pool_allocator=allocator, page_size=ps)
    slots = allocator.alloc(2 * ps)
    cache.insert(key(toks(ps, 1, 2), ns), slots)
    assert allocator.available_size() == 64 - 2 * ps
    assert cache.evict(1) == 2 * ps
    assert allocator.available_size() == 64


@pytest.mark.parametrize("policy", ["lru", "lfu", "fifo", "priority", "slru"])
def test_policies_choose_their_victim(policy):
    cache = RadixCache(eviction_policy=policy)
    cache.insert(RadixKey([1]), priority=9)   # oldest, highest priority
    cache.insert(RadixKey([2]), priority=0)
    cache.insert(RadixKey([3]), priority=5)
    cache.insert(RadixKey([2]))               # [2] now has 2 hits and is the most recent insert
    cache.match_prefix(RadixKey([1]))         # [1] most recently accessed
    victims = []
    for _ in range(3):
        before = {n.key.token_ids[0] for n in cache._iter_nodes()}
        cache.evict(1)
        victims.append((before - {n.key.token_ids[0] for n in cache._iter_nodes()}).pop())
    expected = {"lru": [3, 2, 1], "lfu": [3, 1, 2], "fifo": [1, 2, 3], "priority": [2, 3, 1], "slru": [3, 1, 2]}
    assert victims == expected[policy]


def test_unknown_policy_lists_the_valid_ones():
    with pytest.raises(ValueError, match="lru.*"):
        RadixCache(eviction_policy="random")
    with pytest.raises(ValueError):
        RadixCache(page_size=0)


def test_disabled_cache_caches_nothing(case):
    ps, ns, _ = case
    cache = RadixCache(page_size=ps, disable=True)
    assert cache.insert(key(toks(ps, 1, 2), ns)) == 0
    result = cache.match_prefix(key(toks(ps, 1, 2), ns))
    assert result.device_indices.numel() == 0 and result.last_node is cache.root_node
    assert cache.inc_lock_ref(cache.root_node) == 0 and cache.dec_lock_ref(cache.root_node) == 0
    assert cache.evict(100) == 0
    assert (cache.total_size(), cache.evictable_size(), cache.protected_size()) == (0, 0, 0)


def test_reset_and_pretty_print(case, capsys):
    ps, ns, cache = case
    cache.insert(key(toks(ps, 1, 2), ns))
    cache.insert(key(toks(ps, 1, 3), ns))
    text = cache.pretty_print()
    assert f"#tokens: {3 * ps}" in text and "lock_ref=1" in text
    assert capsys.readouterr().out.strip() == text
    cache.reset()
    assert (cache.total_size(), cache.evictable_size(), cache.protected_size()) == (0, 0, 0)
    assert cache.match_prefix(key(toks(ps, 1, 2), ns)).device_indices.numel() == 0


def test_all_values_flatten_and_empty_match_results_are_slot_ids(case):
    ps, ns, cache = case
    assert cache.all_values_flatten().numel() == 0
    cache.insert(key(toks(ps, 1), ns), values(ps, 10))
    cache.insert(key(toks(ps, 2), ns), values(ps, 50))
    assert sorted(cache.all_values_flatten().tolist()) == values(ps, 10).tolist() + values(ps, 50).tolist()
    assert cache.match_prefix(key([], ns)).device_indices.dtype == SLOT_DTYPE
