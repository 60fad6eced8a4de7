"""Property tests: random insert / match / lock / unlock / evict sequences against the semantic model (`longest_cached_prefix`).

After every step `match_prefix` must agree with `longest_cached_prefix` over the paths inserted
and not evicted (length and slot values), and the tree's invariants must hold.
"""

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixserve.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from radixserve.mem_cache.conservation import check_conservation
from radixserve.mem_cache.radix_cache import RadixCache, RadixKey
from radixserve.mem_cache.reference import longest_cached_prefix

NAMESPACES = [None, "a", ("a",), "b"]
POOL_SIZE = 768


def sequence_strategy(page_size: int):
    """Sequences built from a few shared blocks (so paths share prefixes), maybe perturbed, maybe unaligned."""
    block = st.integers(0, 3).map(lambda b: [b * 100 + i for i in range(page_size)])
    return st.tuples(
        st.lists(block, min_size=0, max_size=5),
        st.one_of(st.none(), st.tuples(st.integers(0, 5 * page_size), st.integers(0, 2))),
        st.integers(0, page_size - 1),
    ).map(lambda parts: _assemble(*parts))


def _assemble(blocks, perturb, tail_len):
    tokens = [t for b in blocks for t in b]
    if perturb is not None and perturb[0] < len(tokens):
        tokens[perturb[0]] = -1 - perturb[1]
    return tokens + [7] * tail_len


class RadixMachine(RuleBasedStateMachine):
    page_size = 1

    @initialize(policy=st.sampled_from(["lru", "lfu", "fifo", "priority"]))
    def setup(self, policy):
        ps = self.page_size
        self.alloc = TokenToKVPoolAllocator(POOL_SIZE) if ps == 1 else PagedTokenToKVPoolAllocator(POOL_SIZE, ps)
        self.cache = RadixCache(token_to_kv_pool_allocator=self.alloc, page_size=ps, eviction_policy=policy)
        self.alive: list[tuple[tuple[int, ...], object]] = []  # (cached tokens, namespace)
        # (ns, tokens up to the end of position i's page, i) -> slot: pages, not tokens, are shared
        self.slot_of: dict[tuple[object, tuple[int, ...], int], int] = {}
        self.locks: list[tuple[object, tuple[int, ...], int]] = []  # (node, tokens, namespace index)

    # ------------------------------------------------------------------ model
    def expected_len(self, tokens, ns) -> int:
        return longest_cached_prefix(tokens, ns, self.alive, self.page_size)

    def token_id(self, ns, tokens, i) -> tuple:
        """Identity of the cached token at position i: its namespace, its whole page's prefix, i."""
        return (ns, tuple(tokens[: (i // self.page_size + 1) * self.page_size]), i)

    def cached_prefixes(self) -> set:
        return {self.token_id(ns, path, i) for path, ns in self.alive for i in range(len(path))}

    # ------------------------------------------------------------------ rules
    @rule(data=st.data(), ns=st.sampled_from(NAMESPACES), priority=st.integers(0, 3))
    def insert(self, data, ns, priority):
        ps = self.page_size
        tokens = data.draw(sequence_strategy(ps))
        aligned = len(tokens) // ps * ps
        if self.cache.evict(aligned + ps - self.alloc.available_size()):
            self.refresh_alive()
        slots = self.alloc.alloc(aligned)
        if slots is None:
            return
        expected = self.expected_len(tokens, ns)
        prefix_len = self.cache.insert(RadixKey(tokens, ns), slots, priority=priority)
        assert prefix_len == expected
        self.alloc.free(slots[:prefix_len])  # the caller frees its duplicates
        for i in range(prefix_len, aligned):
            self.slot_of[self.token_id(ns, tokens, i)] = int(slots[i])
        if aligned:
            self.alive.append((tuple(tokens[:aligned]), ns))

    @rule(data=st.data(), ns=st.sampled_from(NAMESPACES))
    def match(self, data, ns):
        tokens = data.draw(sequence_strategy(self.page_size))
        self.check_match(tokens, ns)

    @precondition(lambda self: self.alive)
    @rule(data=st.data(), cut=st.integers(0, 100))
    def match_known_prefix(self, data, cut):
        path, ns = data.draw(st.sampled_from(self.alive))
        self.check_match(list(path[: len(path) * cut // 100]), ns)

    @precondition(lambda self: self.alive)
    @rule(data=st.data(), cut=st.integers(1, 100))
    def lock(self, data, cut):
        path, ns = data.draw(st.sampled_from(self.alive))
        tokens = list(path[: max(1, len(path) * cut // 100)])
        result = self.check_match(tokens, ns)
        evictable = self.cache.evictable_size()
        delta = self.cache.inc_lock_ref(result.last_node)
        assert self.cache.evictable_size() == evictable + delta and delta <= 0
        self.locks.append((result.last_node, tuple(tokens[: len(result.device_indices)]), ns))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data):
        index = data.draw(st.integers(0, len(self.locks) - 1))
        node, _, _ = self.locks.pop(index)
        protected = self.cache.protected_size()
        delta = self.cache.dec_lock_ref(node)
        assert delta >= 0 and self.cache.protected_size() == protected - delta

    @rule(num_tokens=st.integers(0, 200))
    def evict(self, num_tokens):
        before = self.cached_prefixes()
        evictable, total = self.cache.evictable_size(), self.cache.total_size()
        largest_node = max((len(n.key) for n in self.cache._iter_nodes()), default=0)
        evicted = self.cache.evict(num_tokens)
        if evicted:
            self.refresh_alive()
        assert len(before) - len(self.cached_prefixes()) == evicted
        assert self.cache.total_size() == total - evicted
        assert evicted >= min(num_tokens, evictable)
        if evicted > num_tokens:  # overshoot only by part of the last whole node evicted
            assert evicted - num_tokens < largest_node
        for _, tokens, ns in self.locks:  # locked prefixes survive
            assert self.expected_len(list(tokens), ns) == len(tokens)

    # ------------------------------------------------------------------ helpers
    def check_match(self, tokens, ns):
        expected = self.expected_len(tokens, ns)
        result = self.cache.match_prefix(RadixKey(tokens, ns))
        assert len(result.device_indices) == expected
        want = [self.slot_of[self.token_id(ns, tokens, i)] for i in range(expected)]
        assert result.device_indices.tolist() == want
        if expected == 0:
            assert result.last_node is self.cache.root_node
        return result

    def refresh_alive(self):
        """After eviction, truncate each model path to what the tree still holds (checked above)."""
        alive = []
        for path, ns in self.alive:
            kept = self.cache.match_prefix(RadixKey(path, ns)).device_indices.numel()
            assert kept <= len(path)
            if kept:
                alive.append((path[:kept], ns))
        self.alive = alive

    # ------------------------------------------------------------------ invariants
    @invariant()
    def tree_invariants(self):
        cache, ps = self.cache, self.page_size
        nodes = list(cache._iter_nodes())
        evictable = sum(len(n.key) for n in nodes if n.lock_ref == 0)
        protected = sum(len(n.key) for n in nodes if n.lock_ref > 0)
        assert (cache.evictable_size(), cache.protected_size()) == (evictable, protected)
        assert evictable + protected == cache.total_size()
        holders = {}
        for node, _, _ in self.locks:
            while node is not cache.root_node:
                holders[node] = holders.get(node, 0) + 1
                node = node.parent
        for node in nodes:
            assert len(node.key) > 0 and len(node.key) % ps == 0 and len(node.value) == len(node.key)
            assert node.lock_ref == holders.get(node, 0)
            parent = node.parent
            if parent is not cache.root_node:
                assert node.lock_ref <= parent.lock_ref
                assert node.key.extra_key == parent.key.extra_key
            assert parent.children[node.key.child_key(ps)] is node
        assert len(cache.root_node.children) + sum(len(n.children) for n in nodes) == len(nodes)
        leaves = {n for n in nodes if n.lock_ref == 0 and not n.children}
        assert cache.evictable_leaves == leaves
        assert all(n.in_heap for n in leaves)

    @invariant()
    def slots_are_conserved(self):
        tree_slots = torch.cat([n.value for n in self.cache._iter_nodes()] or [torch.empty(0, dtype=torch.int64)])
        assert len(set(tree_slots.tolist())) == len(tree_slots)
        assert self.alloc.available_size() + self.cache.total_size() == self.alloc.size
        if not self.locks:
            check_conservation(self.alloc, self.cache, None, [])


def _machine_test(page_size: int):
    machine = type(f"RadixMachinePs{page_size}", (RadixMachine,), {"page_size": page_size})
    machine.TestCase.settings = settings(max_examples=50, stateful_step_count=40, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
    return machine.TestCase


TestRadixPs1 = _machine_test(1)
TestRadixPs4 = _machine_test(4)
TestRadixPs16 = _machine_test(16)

