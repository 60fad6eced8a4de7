"""SchedulePolicy and PrefillAdder through a KV manager over a pool-less radix cache (no model)."""

from __future__ import annotations

import time
from types import SimpleNamespace

from radixserve.managers.schedule_batch import Req
from radixserve.managers.schedule_policy import (
    LPM_FALLBACK_QUEUE_LEN,
    AddReqResult,
    NewTokenRatio,
    PrefillAdder,
    SchedulePolicy,
)
from radixserve.mem_cache.kv_manager import KVManager
from radixserve.mem_cache.radix_cache import RadixCache, RadixKey
from radixserve.sampling_params import SamplingParams


def req(rid: str, tokens: list[int], max_new: int = 8) -> Req:
    return Req(rid, tokens, SamplingParams(max_new_tokens=max_new))


class _Alloc(SimpleNamespace):
    page_size = 1

    def available_size(self) -> int:
        return self.free


def kv(tree: RadixCache, free: int = 0) -> KVManager:
    """A KV manager over `tree` whose allocator reports `free` slots (matching and locking need no pool)."""
    return KVManager(None, _Alloc(free=free), tree)


def matched(manager: KVManager, r: Req) -> Req:
    r.init_next_round_input()
    manager.match_prefix(r)
    return r


def test_lpm_orders_by_match_and_dedups_in_batch():
    tree = RadixCache()
    tree.insert(RadixKey(list(range(100))))
    queue = [req("miss", [500] * 50), req("hit10", list(range(10)) + [900] * 5),
             req("hit60", list(range(60)) + [901]), req("sib-a", [7] * 40 + [1]), req("sib-b", [7] * 40 + [2])]
    policy = SchedulePolicy("lpm", kv(tree))
    assert policy.calc_priority(queue) == "lpm"
    # sib-b shares 40 uncached tokens with the earlier sib-a: it waits a round (sorted last)
    assert [r.rid for r in queue] == ["hit60", "hit10", "miss", "sib-a", "sib-b"]
    assert policy.deprioritized == {"sib-b"}


def test_lpm_falls_back_to_fcfs_on_a_long_queue_and_without_cache():
    tree = RadixCache()
    tree.insert(RadixKey([1, 2, 3, 4]))
    queue = [req(f"r{i}", [9, 9, 9]) for i in range(LPM_FALLBACK_QUEUE_LEN)] + [req("hit", [1, 2, 3, 4, 5])]
    assert SchedulePolicy("lpm", kv(tree)).calc_priority(queue) == "fcfs"
    assert queue[-1].rid == "hit"
    assert SchedulePolicy("lpm", kv(tree)).calc_priority(queue[-3:]) == "lpm"
    assert SchedulePolicy("lpm", kv(RadixCache(disable=True))).calc_priority(queue[-3:]) == "fcfs"


def test_starving_request_goes_first_whatever_its_match():
    tree = RadixCache()
    tree.insert(RadixKey(list(range(50))))
    old, hit = req("old", [999] * 10), req("hit", list(range(50)) + [1])
    old.wait_since = time.monotonic() - 1000
    queue = [hit, old]
    SchedulePolicy("lpm", kv(tree), starvation_timeout_s=60).calc_priority(queue)
    assert [r.rid for r in queue] == ["old", "hit"]


def test_dfs_weight_visits_heavier_subtrees_first_post_order():
    tree = RadixCache()
    tree.insert(RadixKey([1] * 10 + [2] * 10))
    tree.insert(RadixKey([1] * 10 + [3] * 10))
    tree.insert(RadixKey([5] * 10))
    queue = [req("shallow", [1] * 10 + [9] * 40), req("five", [5] * 10 + [8]),
             req("deep-2a", [1] * 10 + [2] * 10 + [7]), req("deep-2b", [1] * 10 + [2] * 10 + [6]),
             req("deep-3", [1] * 10 + [3] * 10 + [4])]
    SchedulePolicy("dfs-weight", kv(tree)).calc_priority(queue)
    # subtree [1]*10 holds 4 requests: its children first (the [2] branch has 2), its own request last
    assert [r.rid for r in queue] == ["deep-2a", "deep-2b", "deep-3", "shallow", "five"]


def test_prefill_adder_budgets_chunk_and_decode_reserve():
    tree = RadixCache()
    running = [req("run", [1] * 10, max_new=100)]
    adder = PrefillAdder(kv(tree, free=300), running, new_token_ratio=0.5, max_prefill_tokens=1000,
                         chunked_prefill_size=64)
    assert adder.rem_total_tokens == 300 - 50  # half of the running request's 100 future tokens
    small, big = req("small", [2] * 20, max_new=10), req("big", [3] * 200, max_new=10)
    for r in (small, big):
        matched(adder.kv_manager, r)
    assert adder.add_one_req(small) == AddReqResult.CONTINUE
    assert adder.add_one_req(big) == AddReqResult.OTHER  # the chunk budget is spent by its first chunk
    assert adder.new_chunked_req is big and len(big.fill_ids) == 64 - 20
    assert [r.rid for r in adder.can_run_list] == ["small", "big"]
    tight = PrefillAdder(kv(tree, free=100), running, 0.5, 1000, 64)
    r = matched(tight.kv_manager, req("nofit", [4] * 30, max_new=40))
    assert tight.add_one_req(r) == AddReqResult.NO_TOKEN and not tight.can_run_list
    # 30 prompt + 40 new tokens never fit a 60-token budget; alone (nothing running) it is admitted anyway
    # because its prompt fits now: otherwise it would block the queue forever
    lone = PrefillAdder(kv(tree, free=60), [], 0.5, 1000, 64)
    second = matched(lone.kv_manager, req("second", [5] * 30, max_new=40))
    assert lone.add_one_req(r) == AddReqResult.NO_TOKEN  # admitted, and the pool is now spoken for
    assert lone.add_one_req(second) == AddReqResult.NO_TOKEN
    assert [x.rid for x in lone.can_run_list] == ["nofit"]


def test_new_token_ratio_decays_and_jumps_on_retract():
    ratio = NewTokenRatio(1.0)
    assert abs(ratio.value - 0.7) < 1e-9
    for _ in range(1000):
        ratio.on_decode_step()
    assert abs(ratio.value - 0.098) < 1e-9
    r = req("a", [1], max_new=100)
    r.output_ids = [5] * 30
    ratio.on_retract([r], 20)
    assert abs(ratio.value - 50 / 101) < 1e-9


def test_in_flight_prefill_takes_part_in_the_dedup():
    """Under overlap, step k+1 is scheduled before step k's prompt reaches the tree."""
    tree = RadixCache()
    shared = list(range(100, 150))
    policy = SchedulePolicy("lpm", kv(tree))
    first = matched(policy.kv_manager, req("first", shared + [1]))
    queue = [req("second", shared + [2]), req("other", [7] * 50)]
    policy.calc_priority(queue, in_flight=[first])
    assert policy.deprioritized == {"second"}
    policy.calc_priority(queue)
    assert policy.deprioritized == set()
