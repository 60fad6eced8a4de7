"""The EAGLE bigram view: keys of pairs (t[i], t[i+1]), against a bigram version of the lesson's model.

A draft head's KV at position i depends on t[i] and on t[i+1] (the next token is its input), so a
slot may be reused only when the pair matches. The property test runs random insert / match / lock /
evict sequences on `RadixCache(is_eagle=True)` against `longest_cached_bigram_prefix`; the lifecycle
test drives real pools and checks that every reused slot was computed with the same next token.
"""

import functools

import pytest
import test_lifecycle
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixserve.mem_cache import RadixCache, RadixKey, convert_to_bigram_key
from radixserve.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from radixserve.mem_cache.conservation import check_conservation
from radixserve.mem_cache.reference import longest_cached_bigram_prefix, longest_cached_prefix

NAMESPACES = [None, "lora_finance", ("lora_finance",), "lora_medical"]


# ---------------------------------------------------------------------------------------------- the key

def test_convert_to_bigram_key_pairs_consecutive_tokens():
    assert convert_to_bigram_key([1, 2, 3, 4]) == [(1, 2), (2, 3), (3, 4)]
    assert convert_to_bigram_key([7]) == [] and convert_to_bigram_key([]) == []


def test_bigram_key_is_a_view_of_pairs():
    key = RadixKey([1, 2, 3, 4, 5], "ns", is_bigram=True)
    assert len(key) == 4 and key.token_ids == ((1, 2), (2, 3), (3, 4), (4, 5)) and list(key) == list(key.token_ids)
    assert key.raw_token_ids == (1, 2, 3, 4, 5)
    assert key[1:3].token_ids == ((2, 3), (3, 4)) and key[1:3].raw_token_ids == (2, 3, 4)  # raw [1, 4)
    assert key[1:3].is_bigram and key[1:3].extra_key == "ns"
    assert key[-1].token_ids == ((4, 5),)
    assert key.page_aligned(3).token_ids == ((1, 2), (2, 3), (3, 4))
    assert RadixKey([1, 2, 3, 4, 5], "ns").to_bigram() == key and key.to_bigram() is key
    assert key != RadixKey([1, 2, 3, 4, 5], "ns")  # a view is not the token key
    assert len(RadixKey([9], is_bigram=True)) == 0 and RadixKey([], is_bigram=True).raw_token_ids == ()


def test_bigram_match_is_raw_common_prefix_minus_one_in_whole_pages():
    path = RadixKey([1, 2, 3, 4, 5, 6, 7, 8], is_bigram=True)
    query = RadixKey([1, 2, 3, 4, 5, 6, 7, 9], is_bigram=True)
    assert path.match(query) == 6  # 7 raw tokens agree: pairs (1,2) .. (6,7)
    assert path.match(query, page_size=4) == 4
    assert path.match(RadixKey([1, 2], is_bigram=True)) == 1
    assert path.match(RadixKey([2, 3], is_bigram=True)) == 0
    with pytest.raises(ValueError, match="bigram key with a token key"):
        path.match(RadixKey([1, 2]))


def test_bigram_child_keys_separate_pairs_and_namespaces():
    a, b = RadixKey([1, 2, 3], "x", is_bigram=True), RadixKey([1, 3, 3], "x", is_bigram=True)
    assert a.child_key(1) != b.child_key(1)  # same first token, different pair
    assert a.child_key(1) != RadixKey([1, 2, 3], "y", is_bigram=True).child_key(1)
    assert a.child_key(2) == RadixKey([1, 2, 3, 7], "x", is_bigram=True).child_key(2)


def test_pairs_are_packed_without_collisions_and_ids_outside_int32_are_refused():
    extremes = [-(2 ** 31), -1, 0, 1, 2 ** 31 - 1]
    pairs = {(a, b) for a in extremes for b in extremes}
    units = {RadixKey([a, b], is_bigram=True).packed for a, b in pairs}
    assert len(units) == len(pairs)
    for a, b in pairs:
        assert RadixKey([a, b], is_bigram=True).token_ids == ((a, b),)
    with pytest.raises(ValueError, match="int32"):
        RadixKey([1, 2 ** 31], is_bigram=True)


def test_the_lessons_example_in_the_bigram_view():
    cache = RadixCache(page_size=4, is_eagle=True)
    path = [1, 2, 3, 4, 5, 6, 7, 8]
    assert cache.insert(RadixKey(path, "lora_finance")) == 0
    assert cache.total_size() == 4  # 7 pairs, one whole page of pairs
    query = [1, 2, 3, 4, 5, 6, 7, 9]
    assert len(cache.match_prefix(RadixKey(query, "lora_finance")).device_indices) == 4
    assert longest_cached_bigram_prefix(query, "lora_finance", [(path, "lora_finance")], 4) == 4
    assert len(cache.match_prefix(RadixKey(query, "lora_medical")).device_indices) == 0
    # a token tree would reuse slot 3 with the query [1, 2, 3, 4, 9]: the bigram tree does not
    short = [1, 2, 3, 4, 9]
    assert longest_cached_prefix(short, None, [(path, None)], 1) == 4
    assert longest_cached_bigram_prefix(short, None, [(path, None)], 1) == 3


def test_a_token_tree_refuses_bigram_keys():
    with pytest.raises(ValueError, match="is_eagle"):
        RadixCache().match_prefix(RadixKey([1, 2, 3], is_bigram=True))


# ---------------------------------------------------------------------------------------------- property

def sequence_strategy(page_size: int):
    """Token sequences built from shared blocks (so paths share prefixes), maybe perturbed, maybe unaligned."""
    block = st.integers(0, 3).map(lambda b: [b * 100 + i for i in range(page_size)])
    perturb = st.one_of(st.none(), st.tuples(st.integers(0, 5 * page_size), st.integers(0, 2)))
    return st.tuples(st.lists(block, max_size=5), perturb, st.integers(0, page_size)).map(
        lambda parts: _assemble(*parts))


def _assemble(blocks, perturb, tail_len):
    tokens = [t for b in blocks for t in b]
    if perturb is not None and perturb[0] < len(tokens):
        tokens[perturb[0]] = -1 - perturb[1]
    return tokens + [7] * tail_len


class BigramMachine(RuleBasedStateMachine):
    """The tree against `longest_cached_bigram_prefix` over the raw paths inserted and not evicted."""

    page_size = 1

    @initialize(policy=st.sampled_from(["lru", "lfu", "fifo"]))
    def setup(self, policy):
        ps = self.page_size
        self.alloc = TokenToKVPoolAllocator(512) if ps == 1 else PagedTokenToKVPoolAllocator(512, ps)
        self.cache = RadixCache(token_to_kv_pool_allocator=self.alloc, page_size=ps, eviction_policy=policy,
                                is_eagle=True)
        self.alive: list[tuple[tuple[int, ...], object]] = []  # raw tokens whose pairs are cached
        self.slot_of: dict[tuple, int] = {}  # (ns, raw tokens through the page of pairs, pair index)
        self.locks: list[tuple[object, tuple[int, ...], object]] = []

    def expected(self, tokens, ns) -> int:
        return longest_cached_bigram_prefix(tokens, ns, self.alive, self.page_size)

    def slot_id(self, ns, tokens, i) -> tuple:
        return (ns, tuple(tokens[:(i // self.page_size + 1) * self.page_size + 1]), i)

    @rule(data=st.data(), ns=st.sampled_from(NAMESPACES))
    def insert(self, data, ns):
        ps = self.page_size
        tokens = data.draw(sequence_strategy(ps))
        pairs = max(len(tokens) - 1, 0) // ps * ps
        if self.cache.evict(pairs + ps - self.alloc.available_size()):
            self.refresh_alive()
        slots = self.alloc.alloc(pairs)
        if slots is None:
            return
        want = self.expected(tokens, ns)
        prefix_len = self.cache.insert(RadixKey(tokens, ns), slots)
        assert prefix_len == want
        self.alloc.free(slots[:prefix_len])
        for i in range(prefix_len, pairs):
            self.slot_of[self.slot_id(ns, tokens, i)] = int(slots[i])
        if pairs:
            self.alive.append((tuple(tokens[:pairs + 1]), ns))

    @rule(data=st.data(), ns=st.sampled_from(NAMESPACES))
    def match(self, data, ns):
        self.check_match(data.draw(sequence_strategy(self.page_size)), ns)

    @precondition(lambda self: self.alive)
    @rule(data=st.data(), cut=st.integers(0, 100))
    def match_known_prefix(self, data, cut):
        path, ns = data.draw(st.sampled_from(self.alive))
        self.check_match(list(path[:len(path) * cut // 100]), ns)

    @precondition(lambda self: self.alive)
    @rule(data=st.data(), cut=st.integers(1, 100))
    def lock(self, data, cut):
        path, ns = data.draw(st.sampled_from(self.alive))
        tokens = list(path[:max(2, len(path) * cut // 100)])
        result = self.check_match(tokens, ns)
        self.cache.inc_lock_ref(result.last_node)
        self.locks.append((result.last_node, tuple(tokens[:len(result.device_indices) + 1]), ns))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data):
        node, _, _ = self.locks.pop(data.draw(st.integers(0, len(self.locks) - 1)))
        self.cache.dec_lock_ref(node)

    @rule(num_tokens=st.integers(0, 200))
    def evict(self, num_tokens):
        evictable = self.cache.evictable_size()
        evicted = self.cache.evict(num_tokens)
        assert evicted >= min(num_tokens, evictable)
        if evicted:
            self.refresh_alive()
        for _, tokens, ns in self.locks:  # locked prefixes survive
            assert self.expected(list(tokens), ns) == len(tokens) - 1

    def check_match(self, tokens, ns):
        want = self.expected(tokens, ns)
        result = self.cache.match_prefix(RadixKey(tokens, ns))
        assert len(result.device_indices) == want
        assert result.device_indices.tolist() == [self.slot_of[self.slot_id(ns, tokens, i)] for i in range(want)]
        return result

    def refresh_alive(self):
        alive = []
        for path, ns in self.alive:
            kept = self.cache.match_prefix(RadixKey(path, ns)).device_indices.numel()
            if kept:
                alive.append((path[:kept + 1], ns))
        self.alive = alive

    @invariant()
    def tree_invariants(self):
        cache, ps = self.cache, self.page_size
        for node in cache._iter_nodes():
            assert node.key.is_bigram and len(node.key) % ps == 0 and len(node.value) == len(node.key) > 0
            assert node.parent.children[node.key.child_key(ps)] is node
            if node.parent is not cache.root_node:
                assert node.key.extra_key == node.parent.key.extra_key
        assert self.alloc.available_size() + cache.total_size() == self.alloc.size
        if not self.locks:
            check_conservation(self.alloc, cache, None, [])


def _machine_test(page_size: int):
    machine = type(f"BigramMachinePs{page_size}", (BigramMachine,), {"page_size": page_size})
    machine.TestCase.settings = settings(max_examples=40, stateful_step_count=40, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
    return machine.TestCase


TestBigramPs1 = _machine_test(1)
TestBigramPs4 = _machine_test(4)


# ---------------------------------------------------------------------------------------------- lifecycle

def _kv(req):
    """The request's KV fields (on the request itself, or on its KV handle where it has one)."""
    return getattr(req, "kv", None) or req


def _seq(req) -> list[int]:
    return list(req.origin_input_ids) + list(req.output_ids)


def _request(prompt: list[int], namespace=None):
    make = getattr(test_lifecycle, "request", None) or test_lifecycle.Req
    return make(prompt, namespace)


class DraftWorld(test_lifecycle.World):
    """The lifecycle world, but slots hold draft KV: position i's KV also depends on token i + 1.

    NOTE: it reuses test_lifecycle's stand-in scheduler and only builds its tree with `is_eagle`.
    """

    def __init__(self, page_size: int, is_eagle: bool, monkeypatch) -> None:
        monkeypatch.setattr(test_lifecycle, "RadixCache", functools.partial(RadixCache, is_eagle=is_eagle))
        super().__init__(page_size, size=256)
        assert self.cache.is_eagle == is_eagle
        self.next_of: dict[int, int] = {}  # slot -> the next token its draft KV was computed with

    def _record(self, req, start, end):
        super()._record(req, start, end)
        self._record_next(req, start, end)

    def _record_next(self, req, start, end):
        seq = _seq(req)
        for pos in range(start, min(end, len(seq) - 1)):
            self.next_of[int(self.pool.req_to_token[_kv(req).req_pool_idx, pos])] = seq[pos + 1]

    def prefill_done(self, req, token, finished=False):
        req.output_ids.append(token)
        self._record_next(req, len(_seq(req)) - 2, len(_seq(req)) - 1)  # the last prompt slot learns its next
        req.output_ids.pop()
        super().prefill_done(req, token, finished)

    def check(self):
        report = super().check()
        for req in self.active:
            seq, kv = _seq(req), _kv(req)
            for pos in range(min(kv.cache_protected_len, len(seq) - 1)):  # reused tree slots
                slot = int(self.pool.req_to_token[kv.req_pool_idx, pos])
                assert self.next_of.get(slot) == seq[pos + 1], f"slot {slot} reused with another next token"
        return report


@pytest.mark.parametrize("page_size", [1, 4])
def test_bigram_tree_reuses_a_draft_slot_only_with_its_next_token(page_size, monkeypatch):
    world = DraftWorld(page_size, is_eagle=True, monkeypatch=monkeypatch)
    shared = list(range(100, 100 + 2 * page_size))
    first = _request(shared + [1, 2, 3], "lora_finance")
    world.admit([first])
    world.prefill_done(first, 10)
    world.decode([first], [11])
    world.finish(first)
    second = _request(shared + [1, 9, 9], "lora_finance")  # the pair (1, 2) differs: slot of token 1 is not reused
    world.admit([second])
    assert _kv(second).cache_protected_len == len(shared)  # a token tree would reuse one more
    world.prefill_done(second, 20)
    world.finish(second)
    other = _request(shared + [1, 2, 3], "lora_medical")
    world.admit([other])
    assert _kv(other).cache_protected_len == 0
    world.prefill_done(other, 30, finished=True)
    assert world.check()["protected"] == 0
    world.cache.evict(10 ** 9)
    assert world.check()["available"] == world.alloc.size


def test_a_token_tree_would_reuse_a_draft_slot_with_the_wrong_next_token(monkeypatch):
    world = DraftWorld(1, is_eagle=False, monkeypatch=monkeypatch)
    first = _request([1, 2, 3, 4])
    world.admit([first])
    world.prefill_done(first, 5, finished=True)
    with pytest.raises(AssertionError, match="reused with another next token"):
        world.admit([_request([1, 2, 3, 9, 9])])


def test_bigram_cache_finished_req_frees_the_last_position(monkeypatch):
    world = DraftWorld(1, is_eagle=True, monkeypatch=monkeypatch)
    req = _request([1, 2, 3, 4, 5, 6])
    world.admit([req])
    world.prefill_done(req, 7)
    world.decode([req], [8])
    world.finish(req)
    # committed 7 tokens (prompt 6 + output 7): 6 pairs cached, the last position's slot freed
    assert world.cache.total_size() == 6 and world.alloc.available_size() == world.alloc.size - 6
    assert torch.equal(world.cache.match_prefix(RadixKey([1, 2, 3, 4, 5, 6, 7, 8])).device_indices,
                       world.cache.all_values_flatten().sort().values)
