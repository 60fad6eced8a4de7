"""The hybrid KV memory of sliding-window models: two pools behind one slot id, a radix tree with tombstones.

Allocator (`SWATokenToKVPoolAllocator`): a window slot per full slot, freed with it; window-only frees and
transfers. Tree (`SWARadixCache`): matches back off to where the window KV the next token reads is present
(against `longest_hybrid_prefix`, by hypothesis too), window locks cover the last W - 1 tokens and survive
splits, window eviction tombstones only unlocked window KV, inserting a copy revives tombstones. Lifecycle
(`KVManager`): a decoding request frees its own out-of-window KV, locks keep what running requests read,
chunked prefill and retraction work, and both pools are conserved after every step (check_conservation).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_lifecycle import World, request, seq

from radixserve.mem_cache.conservation import ConservationError, check_conservation
from radixserve.mem_cache.kv_manager import WINDOW_SLIDE_TOKENS, KVManager
from radixserve.mem_cache.memory_pool import SLOT_DTYPE, ReqToTokenPool
from radixserve.mem_cache.radix_key import RadixKey
from radixserve.mem_cache.reference import longest_hybrid_prefix
from radixserve.mem_cache.swa_memory import SWATokenToKVPoolAllocator
from radixserve.mem_cache.swa_radix_cache import SWARadixCache, usable_window_prefix


def tree_world(window: int, page_size: int = 1, size: int = 256, window_size: int = 256):
    alloc = SWATokenToKVPoolAllocator(size, page_size, window_size)
    return alloc, SWARadixCache(None, alloc, page_size, window)


def insert(tree: SWARadixCache, tokens: list[int], namespace=None) -> torch.Tensor:
    """Publish `tokens` as a request would: fresh slots, the tree's duplicates freed. Returns the tree's slots."""
    alloc = tree.token_to_kv_pool_allocator
    n = len(tokens) // tree.page_size * tree.page_size
    value = alloc.alloc(-(-n // tree.page_size) * tree.page_size)[:n]
    cached = tree.insert(RadixKey(tokens[:n], namespace), value)
    alloc.free(value[:cached])
    return tree.match_prefix(RadixKey(tokens[:n], namespace)).device_indices


def check(tree: SWARadixCache) -> dict:
    return check_conservation(tree.token_to_kv_pool_allocator, tree, None, [])


# ---------------------------------------------------------------------------------------------- allocator
@pytest.mark.parametrize("page_size", [1, 4])
def test_allocator_maps_frees_and_undoes_a_short_window_pool(page_size):
    alloc = SWATokenToKVPoolAllocator(64, page_size, window_size=10)
    full = alloc.alloc(8)
    window = alloc.full_to_window[full.long()]
    assert (window > 0).all() and len(set(window.tolist())) == 8 and alloc.window_available_size() == 2
    free_before = alloc.available_size()
    assert alloc.alloc(4) is None  # 4 full slots are free, 2 window slots are not: nothing is taken
    assert alloc.available_size() == free_before and alloc.window_available_size() == 2
    assert alloc.free_window(full[:3]) == 3 and alloc.window_available_size() == 5
    assert alloc.window_present(full).tolist() == [False] * 3 + [True] * 5
    alloc.free(full[4:5])  # a page (or a slot): the window KV of every slot of it goes too
    assert alloc.window_available_size() == (9 if page_size == 4 else 6)
    assert alloc.available_size() == free_before + page_size


def test_transfer_moves_window_kv_only_where_the_target_lacks_it():
    alloc = SWATokenToKVPoolAllocator(32, 1, window_size=32)
    a, b = alloc.alloc(3), alloc.alloc(3)
    alloc.free_window(b[:2])
    kept = alloc.full_to_window[a[:2].long()].clone()
    assert alloc.transfer_window(a, b) == 2
    assert torch.equal(alloc.full_to_window[b[:2].long()], kept) and not alloc.window_present(a[:2]).any()
    assert alloc.window_present(a[2:]).all() and alloc.window_present(b).all()


def test_usable_window_prefix_backs_off_past_tombstones():
    present = torch.tensor([True] * 10)
    assert usable_window_prefix(present, 1, 4) == 10
    present[7] = False  # position 7 is in the window of m = 8..10
    assert usable_window_prefix(present, 1, 4) == 7
    assert usable_window_prefix(present, 4, 4) == 4
    present[2] = False
    assert usable_window_prefix(present, 1, 4) == 7 and usable_window_prefix(present, 1, 6) == 2
    assert usable_window_prefix(present, 1, 1) == 10


# ---------------------------------------------------------------------------------------------- the tree
def _tombstone(tree: SWARadixCache, node) -> None:
    """Free one node's window KV through the tree's books (evict_window picks its own victims)."""
    freed = tree.token_to_kv_pool_allocator.free_window(node.value)
    node.window_len -= freed
    tree.window_evictable_size_ -= freed


def _two_nodes(window: int):
    alloc, tree = tree_world(window)
    insert(tree, list(range(1, 13)))
    tree.match_prefix(RadixKey(list(range(1, 7))))  # splits it: [1..6] -> [7..12]
    upper = next(iter(tree.root_node.children.values()))
    return tree, upper, next(iter(upper.children.values()))


def test_match_returns_the_longest_prefix_whose_window_is_present():
    tree, upper, lower = _two_nodes(window=4)
    _tombstone(tree, lower)
    check(tree)
    assert len(tree.match_prefix(RadixKey(list(range(1, 13)))).device_indices) == 6
    tree, upper, lower = _two_nodes(window=4)
    _tombstone(tree, upper)  # tombstones before the last window do not matter
    assert len(tree.match_prefix(RadixKey(list(range(1, 13)))).device_indices) == 12
    match = tree.match_prefix(RadixKey(list(range(1, 9))))  # its window reaches back into the tombstones
    assert len(match.device_indices) == 0 and match.last_node is tree.root_node
    assert tree.total_size() == 12  # the full KV stays for matches that end elsewhere
    check(tree)


def test_window_locks_cover_the_last_window_and_survive_splits():
    alloc, tree = tree_world(window=5)
    insert(tree, list(range(1, 4)))  # [1..3]
    insert(tree, list(range(1, 13)))  # [1..3] -> [4..12]
    leaf = tree.match_prefix(RadixKey(list(range(1, 13)))).last_node
    tree.inc_lock_ref(leaf)
    mark = tree.inc_window_lock(leaf)  # splits the leaf to lock its last W - 1 = 4 tokens only
    upper = leaf.parent
    assert len(leaf.key) == 4 and leaf.window_lock_ref == 1 and upper.window_lock_ref == 0
    assert tree.window_protected_size() == 4 and tree.window_evictable_size() == 8
    assert tree.evict_window(100) == 8 and upper.window_len == 0  # only the unlocked window KV goes
    tree.match_prefix(RadixKey(list(range(1, 11))))  # splits the locked leaf: its mark moves up
    assert leaf.window_lock_ref == 1 and leaf.parent.window_lock_ref == 1 and leaf.window_mark is None
    tree.dec_window_lock(leaf, mark)
    tree.dec_lock_ref(leaf)
    assert tree.window_protected_size() == 0 and tree.protected_size() == 0
    check(tree)


def test_eviction_frees_both_pools_and_insert_revives_tombstones():
    alloc, tree = tree_world(window=4, size=64, window_size=64)
    tokens = list(range(1, 17))
    insert(tree, tokens)
    assert tree.evict_window(100) == 16 and len(tree.match_prefix(RadixKey(tokens)).device_indices) == 0
    check(tree)
    insert(tree, tokens)  # a request recomputed the prefix: its window KV moves into the tree's node
    assert len(tree.match_prefix(RadixKey(tokens)).device_indices) == 16
    assert tree.window_evictable_size() == 16 and alloc.available_size() == 64 - 16
    check(tree)
    assert tree.evict(100) == 16
    assert alloc.available_size() == 64 and alloc.window_available_size() == 64
    check(tree)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_matches_agree_with_the_hybrid_oracle(data):
    page_size = data.draw(st.sampled_from([1, 2, 4]))
    window = data.draw(st.integers(1, 9))
    alloc, tree = tree_world(window, page_size, size=2048, window_size=2048)
    paths = []
    alphabet = st.lists(st.integers(1, 4), min_size=0, max_size=24)
    for _ in range(data.draw(st.integers(1, 6))):
        tokens = data.draw(alphabet)
        namespace = data.draw(st.sampled_from([None, "b"]))
        insert(tree, tokens, namespace)
        paths.append((tokens[: len(tokens) // page_size * page_size], namespace))
        if data.draw(st.booleans()):
            tree.evict_window(data.draw(st.integers(1, 12)))
        check(tree)
    for _ in range(4):
        query, namespace = data.draw(alphabet), data.draw(st.sampled_from([None, "b"]))
        cached = [(t, ns, _flags(tree, t, ns)) for t, ns in paths]
        expected = longest_hybrid_prefix(query, namespace, cached, page_size, window)
        assert len(tree.match_prefix(RadixKey(query, namespace)).device_indices) == expected
        check(tree)


def _flags(tree: SWARadixCache, tokens: list[int], namespace) -> list[bool]:
    """Per token of a cached path: whether the tree's slot for it has window KV (read without the back-off)."""
    from radixserve.mem_cache.radix_cache import RadixCache

    slots = RadixCache.match_prefix(tree, RadixKey(tokens, namespace)).device_indices
    return tree.token_to_kv_pool_allocator.window_present(slots).tolist()


# ---------------------------------------------------------------------------------------------- lifecycle
class HybridWorld(World):
    """test_lifecycle's scheduler stand-in over the hybrid pool; also checks the window KV a request reads."""

    def __init__(self, window: int, page_size: int = 1, size: int = 512, window_size: int = 512, rows: int = 8,
                 disable: bool = False) -> None:
        self.window = window
        self.pool = ReqToTokenPool(rows, 400, "cpu")
        self.alloc = SWATokenToKVPoolAllocator(size, page_size, window_size)
        self.cache = SWARadixCache(self.pool, self.alloc, page_size, window, disable=disable)
        self.kv = KVManager(self.pool, self.alloc, self.cache)
        self.active, self.slot_kv, self.window_kv = [], {}, {}

    def check(self) -> dict:
        report = super().check()
        for req in self.active:
            kv = req.kv
            for pos in range(max(0, kv.kv_committed_len - self.window + 1), kv.kv_allocated_len):
                slot = int(self.pool.req_to_token[kv.req_pool_idx, pos])
                window_slot = int(self.alloc.full_to_window[slot])
                assert self.window_kv[window_slot] == (req.extra_key, tuple(seq(req)[:pos + 1])), (req, pos)
        return report

    def _record(self, req, start: int, end: int) -> None:
        super()._record(req, start, end)
        for pos in range(start, end):
            slot = int(self.pool.req_to_token[req.kv.req_pool_idx, pos])
            self.window_kv[int(self.alloc.full_to_window[slot])] = (req.extra_key, tuple(seq(req)[:pos + 1]))


@pytest.mark.parametrize("page_size", [1, 4])
def test_decode_frees_its_own_out_of_window_kv_and_the_tree_keeps_the_rest(page_size):
    window = 8
    world = HybridWorld(window, page_size)
    a = request(list(range(100, 120)))  # 20-token prompt
    world.admit([a])
    world.prefill_done(a, 1)
    steps = window + 2 * WINDOW_SLIDE_TOKENS
    for i in range(steps):
        world.decode([a], [2 + i])
    own = a.kv.kv_allocated_len - a.kv.cache_protected_len
    private_window = world.check()["window_request_private"]
    assert private_window < own and private_window <= window + WINDOW_SLIDE_TOKENS
    world.finish(a)
    # the published sequence: its prompt's window KV is cached (evictable), the decoded tokens' only at the end
    full = seq(a)[: a.kv.kv_committed_len] if a.kv.req_pool_idx else seq(a)[:-1]
    b = request(full + [999])
    world.admit([b])
    assert b.kv.cache_protected_len == len(full) // page_size * page_size  # the end's window is there
    world.prefill_done(b, 5)
    c = request(list(range(100, 120)) + [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17] + [998])
    world.admit([c])  # ends inside the freed decode span: backs off to a point whose window is intact
    assert c.kv.cache_protected_len == 20  # the prompt: its last window is cached, the outputs after it are not
    world.prefill_done(c, 6)
    world.finish(b)
    world.finish(c)
    assert world.check()["window_protected"] == 0


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_verify_steps_rejected_tail_frees_its_window_kv(page_size):
    """A speculative verify step allocates its draft tokens' slots and gives back the rejected ones (release_tail);
    with pages, the kept page's slots past the kept tokens stay with the request and are handed out again by the
    next allocation, so their window KV must be freed at once (it leaked, window slot by window slot, before)."""
    world = HybridWorld(window=8, page_size=page_size)
    a = request(list(range(100, 109)))  # 9 tokens: its decode positions start inside a page
    world.admit([a])
    world.prefill_done(a, 1)
    for step in range(6):
        kv = a.kv
        keep = kv.kv_allocated_len + 1  # one accepted token of a 4-token draft
        world.kv.alloc_extend([a], [kv.kv_allocated_len + 1 + 4])
        world.kv.release_tail(a, keep)
        world._record(a, keep - 1, keep)
        a.output_ids.append(10 + step)
        world.kv.commit(a, keep)
        world.check()
    world.finish(a)
    assert world.check()["window_protected"] == 0


def test_chunked_prefill_keeps_only_the_last_window_locked():
    window = 6
    world = HybridWorld(window, page_size=1, size=256, window_size=256)
    req = request(list(range(10, 50)))  # 40 tokens in chunks of 8
    world.admit([req], chunk=8)
    while len(req.fill_ids) < len(seq(req)):
        world.next_chunk(req, 8)
        report = world.check()
        assert report["window_protected"] <= window - 1 + 8
    world.prefill_done(req, 3)
    report = world.check()
    assert report["window_protected"] <= window - 1 + 8 and report["window_evictable"] >= 40 - 2 * window - 8
    world.cache.evict_window(10**6)  # what no lock covers may go; the request still reads its window
    world.decode([req], [4])
    world.finish(req)


def test_window_pool_pressure_tombstones_then_admits_and_retraction_frees_both():
    window = 4
    world = HybridWorld(window, page_size=1, size=512, window_size=40)
    a = request(list(range(1, 31)))
    world.admit([a])
    world.prefill_done(a, 1)
    world.finish(a)  # 30 window slots cached, evictable
    b = request(list(range(200, 230)))  # needs 30 window slots: a's are tombstoned, not its full KV
    world.admit([b])
    assert world.cache.total_size() >= 30 and world.alloc.window_available_size() + world.cache.window_evictable_size() >= 0
    world.prefill_done(b, 2)
    world.retract(b)
    report = world.check()
    assert report["window_protected"] == 0 and report["protected"] == 0
    assert len(world.cache.match_prefix(RadixKey(list(range(1, 31)) + [1])).device_indices) < 30


def test_conservation_catches_a_leaked_and_a_stray_window_slot():
    alloc, tree = tree_world(window=4, size=32, window_size=32)
    insert(tree, [1, 2, 3, 4, 5])
    slots = alloc.alloc(2)
    with pytest.raises(ConservationError):
        check(tree)  # two full and window slots nobody owns
    alloc.free(slots)
    check(tree)
    node = next(iter(tree.root_node.children.values()))
    alloc.full_to_window[node.value[0].long()] = 0  # a window slot dropped behind the tree's back
    with pytest.raises(ConservationError):
        check(tree)
    assert SLOT_DTYPE == alloc.full_to_window.dtype


# ---------------------------------------------------------------------------------------------- through the engine
ENGINE_CASES = [
    pytest.param({"page_size": 1, "disable_overlap_schedule": False}, id="page1-overlap"),
    pytest.param({"page_size": 1, "disable_overlap_schedule": True}, id="page1-normal"),
    pytest.param({"page_size": 4, "disable_overlap_schedule": False}, id="page4-overlap"),
    pytest.param({"page_size": 1, "disable_overlap_schedule": False, "speculative_algorithm": "ngram"},
                 id="page1-ngram"),
]


@pytest.mark.parametrize("options", ENGINE_CASES)
def test_engine_on_a_squeezed_window_pool_matches_transformers(options, tmp_path):
    """Tiny Gemma 3 (window 8) with the window pool at its floor (a chunk + a window + the slide slack): shared
    prefixes, prompts 5x the window, decodes past it. Greedy tokens equal transformers' generate, prefixes are
    reused, and both pools are conserved."""
    from test_model_gemma3 import _prompts, make_tiny_gemma3

    from radixserve import Engine

    hf_model = make_tiny_gemma3(tmp_path)
    system = _prompts([24], seed=11)[0]
    tails = _prompts([3, 17, 5, 30], seed=12)
    prompts = [system + t for t in tails] + _prompts([40, 9], seed=13)

    def greedy(prompt: list[int], n: int) -> list[int]:
        with torch.inference_mode():
            out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                                    pad_token_id=0)
        return out[0, len(prompt):].tolist()

    long_answer = greedy(prompts[0], 40)
    # NOTE: the next turn ends inside the first answer, whose early tokens left the window and lost their
    # window KV: its match must back off to where the window is intact
    follow_up = prompts[0] + long_answer[:10] + [5, 6, 7]
    expected = [greedy(p, 12) for p in [follow_up] + prompts[1:]]
    params = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
    with Engine(model_path=str(tmp_path), dtype="float32", device="cpu", max_total_tokens=1024,
                chunked_prefill_size=8, swa_full_tokens_ratio=0.01, log_level="warning", **options) as engine:
        first = engine.generate(input_ids=prompts[0], sampling_params={**params, "max_new_tokens": 40})
        turn = engine.generate(input_ids=follow_up, sampling_params=params)
        rest = engine.generate(input_ids=prompts[1:], sampling_params=params)
        state = engine.get_internal_state()
    assert first["output_ids"] == long_answer
    assert [r["output_ids"] for r in [turn, *rest]] == expected
    assert len(prompts[0]) - 8 <= turn["meta_info"]["cached_tokens"] < len(follow_up) - 8
    assert max(r["meta_info"]["cached_tokens"] for r in rest[:3]) >= 16  # the system prompt, page-aligned
    report = state["kv_conservation"]
    assert report is not None and "error" not in report, state
    assert report["window_size"] <= 48 and report["window_protected"] == 0  # the floor, not the ratio
    assert state["protected_tokens"] == 0 and state["num_running_reqs"] == 0


def test_the_same_kv_bytes_run_twice_the_long_requests_at_once(tmp_path):
    """Tiny Gemma 3 with Gemma 3's layer pattern (5 window layers of W = 8, then a full one): twelve 200-token
    prompts in a KV budget of 1,000 tokens of every layer. One pool runs a few at once; the hybrid pool (window
    pool at a quarter of the full one) spends the same bytes on 2,666 full-layer tokens and runs at least twice
    as many at once, with the same tokens out."""
    from test_model_gemma3 import _prompts, make_tiny_gemma3

    from radixserve import Engine

    make_tiny_gemma3(tmp_path, layer_types=["sliding_attention"] * 5 + ["full_attention"])
    prompts = _prompts([200] * 12, seed=21)
    params = {"temperature": 0.0, "max_new_tokens": 32, "ignore_eos": True}
    runs = {}
    for name, options in {"one pool": {"max_total_tokens": 1000, "disable_hybrid_swa_memory": True},
                          "hybrid": {"max_total_tokens": 6000 * 4 // 9, "swa_full_tokens_ratio": 0.25}}.items():
        # NOTE: the normal loop: which step admits whom then depends on nothing but the pools (under overlap it
        # also depends on when results come back, and so does the peak)
        with Engine(model_path=str(tmp_path), dtype="float32", device="cpu", chunked_prefill_size=256,
                    disable_overlap_schedule=True, log_level="warning", **options) as engine:
            outs = engine.generate(input_ids=prompts, sampling_params=params)
            runs[name] = ([o["output_ids"] for o in outs], engine.get_internal_state())
    (single, single_state), (hybrid, hybrid_state) = runs["one pool"], runs["hybrid"]
    assert hybrid == single
    assert "window_pool_tokens" not in single_state and hybrid_state["window_pool_tokens"] == 2666 // 4
    for state in (single_state, hybrid_state):
        assert state["kv_conservation"] is not None and "error" not in state["kv_conservation"], state
    peaks = single_state["peak_running_reqs"], hybrid_state["peak_running_reqs"]
    assert peaks[1] >= 2 * peaks[0], peaks
    print("peak running requests, one pool vs hybrid:", peaks)


def test_pretty_print_shows_each_nodes_window_kv():
    tree, upper, lower = _two_nodes(window=4)
    _tombstone(tree, upper)
    text = tree.pretty_print()
    assert "6 tok lock_ref=0 evictable window=0/6" in text and "window=6/6" in text
