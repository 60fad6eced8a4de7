"""Which waiting requests run next, and how many fit.

`SchedulePolicy.calc_priority` orders the waiting queue (lpm, dfs-weight or fcfs), marks requests
that would recompute a long prefix an earlier waiting request is about to compute (in-batch prefix
deduplication), and moves requests that waited too long to the front. `PrefillAdder` then admits
requests in that order under three budgets: prefill tokens of this batch, the chunk size, and the
total KV (free + evictable, minus a reserve for the running requests' future decode tokens).
"""

from __future__ import annotations

import time
from collections import defaultdict
from enum import Enum, auto
from typing import Any

from radixserve import envs
from radixserve.managers.schedule_batch import Req
from radixserve.mem_cache.kv_manager import WINDOW_SLIDE_TOKENS, KVManager
from radixserve.mem_cache.radix_cache import RadixCache, RadixKey

# SGLang's constants.
LPM_FALLBACK_QUEUE_LEN = 128  # lpm matches every waiting request; above this many, use fcfs for the step
IN_BATCH_CHECK_THRESHOLD = 32  # only requests whose real cache hit is at most this are checked ...
IN_BATCH_DEPRIORITIZE_THRESHOLD = 32  # ... and wait a round if an earlier one shares this many tokens
CLIP_MAX_NEW_TOKENS = 4096  # cap on the decode reserve of one request
# Ours: a request that has waited this long goes first, whatever its prefix match.
STARVATION_TIMEOUT_S = envs.STARVATION_TIMEOUT_S  # read when a policy is built


class SchedulePolicy:
    """Orders the waiting queue in place. Cache-aware policies fall back to fcfs without a cache.

    They match every waiting request against the tree (through the KV manager): that is the step's
    one prefix match of each request the adder then admits."""

    def __init__(self, policy: str, kv_manager: KVManager, starvation_timeout_s: float | None = None) -> None:
        if policy not in ("lpm", "dfs-weight", "fcfs"):
            raise ValueError(f"unknown schedule policy {policy!r}; valid: lpm, dfs-weight, fcfs")
        self.policy = policy
        self.kv_manager = kv_manager
        self.tree_cache = kv_manager.tree_cache
        self.starvation_timeout_s = (
            STARVATION_TIMEOUT_S.get() if starvation_timeout_s is None else starvation_timeout_s)
        self.deprioritized: set[str] = set()  # rids that wait a round (in-batch prefix dedup)
        self._scratch = RadixCache(page_size=1)

    def effective_policy(self, queue_len: int) -> str:
        if self.policy == "fcfs" or self.tree_cache.disable:
            return "fcfs"
        if self.policy == "lpm" and queue_len > LPM_FALLBACK_QUEUE_LEN:
            return "fcfs"  # NOTE: matching every request of a long queue costs more than it wins
        return self.policy

    def calc_priority(self, waiting_queue: list[Req], now: float | None = None,
                      in_flight: list[Req] = ()) -> str:
        """Sort `waiting_queue` in place; returns the policy actually used for this step.

        `in_flight`: requests of a prefill whose KV is not in the tree yet (the overlap loop schedules
        step k+1 before inserting step k); waiting requests that share their prefix wait a round too.
        """
        policy = self.effective_policy(len(waiting_queue))
        self.deprioritized = set()
        if policy != "fcfs":
            self._compute_prefix_matches(waiting_queue, in_flight)
            if policy == "lpm":
                waiting_queue.sort(key=self._lpm_key)
            else:
                waiting_queue[:] = self._dfs_weight_order(waiting_queue)
        self._promote_starving(waiting_queue, time.monotonic() if now is None else now)
        return policy

    def _lpm_key(self, req: Req) -> float:
        # NOTE: sort is stable, so equal matches keep arrival order.
        return float("inf") if req.rid in self.deprioritized else -req.num_matched_prefix_tokens

    def _compute_prefix_matches(self, waiting_queue: list[Req], in_flight: list[Req] = ()) -> None:
        self._scratch.reset()
        for req in in_flight:
            self._scratch.insert(RadixKey(req.fill_ids, req.extra_key))
        for req in waiting_queue:
            req.init_next_round_input()
            req.note_match(self.kv_manager.match_prefix(req))
            if req.num_matched_prefix_tokens > IN_BATCH_CHECK_THRESHOLD:
                continue
            key = RadixKey(req.fill_ids, req.extra_key)
            in_batch = len(self._scratch.match_prefix(key).device_indices)
            if in_batch >= IN_BATCH_DEPRIORITIZE_THRESHOLD:
                self.deprioritized.add(req.rid)
            else:
                self._scratch.insert(key)

    def _dfs_weight_order(self, waiting_queue: list[Req]) -> list[Req]:
        """Group by matched node; visit heavier subtrees first; a node's own requests after its subtree."""
        by_node: dict[Any, list[Req]] = defaultdict(list)
        for req in waiting_queue:
            by_node[req.kv.last_node].append(req)
        weight: dict[Any, int] = defaultdict(int)
        for node, reqs in by_node.items():
            while node is not None:
                weight[node] += len(reqs)
                node = node.parent
        ordered: list[Req] = []
        self._dfs(self.tree_cache.root_node, weight, by_node, ordered)
        seen = {id(r) for r in ordered}
        ordered.extend(r for r in waiting_queue if id(r) not in seen)  # matched nodes evicted meanwhile
        return ordered

    def _dfs(self, root: Any, weight: dict, by_node: dict, out: list[Req]) -> None:
        stack: list[tuple[Any, bool]] = [(root, False)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                out.extend(by_node.get(node, ()))
                continue
            stack.append((node, True))
            children = [c for c in node.children.values() if weight.get(c, 0) > 0]
            children.sort(key=lambda c: weight[c])  # NOTE: lightest pushed first, so heaviest pops first
            stack.extend((c, False) for c in children)

    def _promote_starving(self, waiting_queue: list[Req], now: float) -> None:
        starving = [r for r in waiting_queue if now - r.wait_since >= self.starvation_timeout_s]
        if not starving:
            return
        starving.sort(key=lambda r: r.wait_since)
        for req in starving:
            self.deprioritized.discard(req.rid)
        ids = {id(r) for r in starving}
        waiting_queue[:] = starving + [r for r in waiting_queue if id(r) not in ids]


class AddReqResult(Enum):
    CONTINUE = auto()  # room for more
    NO_TOKEN = auto()  # the KV pool is exhausted
    OTHER = auto()  # the prefill-token or chunk budget is exhausted


class PrefillAdder:
    """Admits requests into one prefill batch under token budgets.

    Admission takes a lock on each admitted request's matched prefix (through the KV manager), so the
    budget it was checked against cannot be evicted underneath it.
    """

    def __init__(self, kv_manager: KVManager, running_reqs: list[Req], new_token_ratio: float,
                 max_prefill_tokens: int, chunked_prefill_size: int | None) -> None:
        self.kv_manager = kv_manager
        self.page_size = kv_manager.page_size
        self.rem_input_tokens = max_prefill_tokens
        self.rem_chunk_tokens = chunked_prefill_size if chunked_prefill_size and chunked_prefill_size > 0 else None
        self.running_empty = not running_reqs
        # NOTE: reserve room for the running requests' future decode tokens, scaled by the ratio.
        self.rem_total_token_offset = sum(
            min(max(r.max_new_tokens - len(r.output_ids), 0), CLIP_MAX_NEW_TOKENS) * new_token_ratio
            for r in running_reqs)
        self.cur_rem_token_offset = 0
        # NOTE: a hybrid model's window pool has its own budget: a request takes a window slot per new token,
        # and while it decodes at most W + WINDOW_SLIDE_TOKENS of its own (older ones are freed as it goes).
        self.window = kv_manager.sliding_window
        self.window_reserve = (self.window or 0) + WINDOW_SLIDE_TOKENS
        self.rem_window_offset = sum(self._window_growth(r) for r in running_reqs) if self.window is not None else 0
        self.cur_window_offset = 0
        self.can_run_list: list[Req] = []
        self.new_chunked_req: Req | None = None
        self.log_hit_tokens = 0
        self.log_input_tokens = 0

    @property
    def rem_total_tokens(self) -> float:
        return self.kv_manager.free_and_evictable() - self.rem_total_token_offset

    @property
    def cur_rem_tokens(self) -> int:
        return self.kv_manager.free_and_evictable() - self.cur_rem_token_offset

    def _window_growth(self, req: Req) -> int:
        """Window slots a running request may still take: up to W + WINDOW_SLIDE_TOKENS of its own."""
        kv = req.kv
        own = kv.kv_allocated_len - max(kv.cache_protected_len, kv.window_freed_len)
        return min(max(req.max_new_tokens - len(req.output_ids), 0), max(0, self.window_reserve - own))

    @property
    def rem_window_tokens(self) -> int:
        return self.kv_manager.window_free_and_evictable() - self.rem_window_offset

    @property
    def cur_window_tokens(self) -> int:
        return self.kv_manager.window_free_and_evictable() - self.cur_window_offset

    def _chunk_room(self) -> int | None:
        """New tokens one request may prefill now: the chunk budget, and on a hybrid model the window room."""
        if self.window is None:
            return self.rem_chunk_tokens
        room = max(self.cur_window_tokens, 0)
        return room if self.rem_chunk_tokens is None else min(self.rem_chunk_tokens, room)

    def ceil_paged(self, n: int) -> int:
        return -(-n // self.page_size) * self.page_size

    def budget_state(self) -> AddReqResult:
        if self.rem_total_tokens <= 0 or self.cur_rem_tokens <= 0:
            return AddReqResult.NO_TOKEN
        if self.window is not None and self.cur_window_tokens <= 0:
            return AddReqResult.NO_TOKEN
        if self.rem_input_tokens <= 0 or (self.rem_chunk_tokens is not None and self.rem_chunk_tokens <= 0):
            return AddReqResult.OTHER
        return AddReqResult.CONTINUE

    def _update_prefill_budget(self, prefix_len: int, extend_len: int, max_new: int) -> None:
        extend_len = self.ceil_paged(extend_len)
        self.rem_total_token_offset += extend_len + max_new + self.page_size
        self.cur_rem_token_offset += extend_len + self.page_size
        if self.window is not None:
            self.rem_window_offset += extend_len + min(max_new, self.window_reserve)
            self.cur_window_offset += extend_len
        self.rem_input_tokens -= extend_len
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= extend_len
        self.log_hit_tokens += prefix_len
        self.log_input_tokens += extend_len

    def add_chunked_req(self, req: Req) -> Req | None:
        """Admit the next chunk of the in-flight chunked request, first; returns it if still truncated."""
        rem = min(self.rem_chunk_tokens or req.extend_input_len, self.rem_total_tokens)
        if self.window is not None:
            rem = min(rem, self.cur_window_tokens)
        if rem <= 0:
            rem = self.rem_chunk_tokens or req.extend_input_len  # NOTE: it must progress, or it holds its KV forever
        prefix_len = req.kv.prefix_len
        truncated = req.extend_input_len > rem
        new_len = req.extend_input_len
        if truncated:
            end = (prefix_len + int(rem)) // self.page_size * self.page_size
            new_len = max(end - prefix_len, self.page_size)
        req.cut_round(prefix_len + new_len)
        self.can_run_list.append(req)
        max_new = 0 if truncated else min(req.max_new_tokens, CLIP_MAX_NEW_TOKENS)
        self._update_prefill_budget(0, new_len, max_new)
        return req if truncated else None

    def add_one_req(self, req: Req) -> AddReqResult:
        """Admit `req` (after its prefix match), whole or as a first chunk, or refuse it."""
        max_new = min(max(req.max_new_tokens - len(req.output_ids), 0), CLIP_MAX_NEW_TOKENS)
        prefix_len = req.kv.prefix_len
        total_tokens = req.extend_input_len + max_new + self.page_size
        lone = self.running_empty and not self.can_run_list
        if total_tokens >= self.rem_total_tokens and not lone:
            return AddReqResult.NO_TOKEN
        # NOTE: locking the prefix moves it from evictable to protected, shrinking the budget.
        with self.kv_manager.locked_while(req):
            if total_tokens >= self.rem_total_tokens and not (lone and self._fits_now(req)):
                return AddReqResult.NO_TOKEN
            input_tokens = self.ceil_paged(req.extend_input_len)
            if self.rem_chunk_tokens is None and self.can_run_list and input_tokens >= self.rem_input_tokens:
                return AddReqResult.OTHER
            if self.window is not None and not lone and not self._window_fits(input_tokens, req):
                return AddReqResult.NO_TOKEN
            chunk_room = self._chunk_room()
            if chunk_room is None or input_tokens <= chunk_room:
                self.can_run_list.append(req)
                self.kv_manager.lock(req)
                self._update_prefill_budget(prefix_len, input_tokens, min(req.max_new_tokens, CLIP_MAX_NEW_TOKENS))
            else:
                trunc_len = chunk_room // self.page_size * self.page_size
                if trunc_len <= 0:
                    return AddReqResult.OTHER
                req.cut_round(prefix_len + trunc_len)
                self.can_run_list.append(req)
                self.new_chunked_req = req
                self.kv_manager.lock(req)
                self._update_prefill_budget(prefix_len, trunc_len, 0)
        return self.budget_state()

    def _window_fits(self, input_tokens: int, req: Req) -> bool:
        """Hybrid: the window pool has room for this prefill now and for its decode window later."""
        later = min(max(req.max_new_tokens - len(req.output_ids), 0), self.window_reserve)
        now = input_tokens if self.rem_chunk_tokens is None else min(input_tokens, self.rem_chunk_tokens)
        return now <= self.cur_window_tokens and now + later <= self.rem_window_tokens

    def _fits_now(self, req: Req) -> bool:
        """The lone-request rule: with nothing running, admit what fits now even without a decode reserve.

        Without it, a request whose max_new_tokens exceeds the pool would block the queue forever;
        with it, the request runs and, if it outgrows the pool alone, is aborted at decode.
        """
        need = self.ceil_paged(min(req.extend_input_len, self.rem_chunk_tokens or req.extend_input_len))
        return need + self.page_size <= self.cur_rem_tokens


class NewTokenRatio:
    """The fraction of `max_new_tokens` reserved for running requests: decays each decode step, jumps on retract."""

    def __init__(self, schedule_conservativeness: float = 1.0) -> None:
        self.init = min(0.7 * schedule_conservativeness, 1.0)
        self.min = self.init * 0.14
        self.decay = (self.init - self.min) / 600
        self.value = self.init

    def on_decode_step(self) -> None:
        self.value = max(self.value - self.decay, self.min)

    def on_retract(self, remaining: list[Req], retract_decode_steps: int) -> None:
        decoded = sum(len(r.output_ids) for r in remaining)
        wanted = sum(r.max_new_tokens for r in remaining)
        self.value = min(1.0, (decoded + retract_decode_steps * len(remaining)) / (wanted + 1))

    def reset(self) -> None:
        self.value = self.init
