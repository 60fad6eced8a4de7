"""The scheduler's internal state as the front ends read it (/get_server_info, /metrics, Engine.get_internal_state).

`StateReport` is a part of `Scheduler`: counters, pool sizes, the conservation check's terms when idle, and the
KV accounting (`kv_accounting`), recomputed only when the pool or the counters moved.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radixserve.managers.scheduler import Scheduler

logger = logging.getLogger(__name__)


class StateReport:
    """NOTE: the full accounting walks the pool (tens of ms on a large one), and liveness probes ask for the
    state every second while idle; it is recomputed only when the pool or the counters moved."""

    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler
        self._last_key: tuple | None = None
        self._last: dict[str, Any] = {}

    def __call__(self) -> dict[str, Any]:
        s = self._scheduler
        key = _pool_fingerprint(s)
        if key != self._last_key:
            self._last_key, self._last = key, kv_accounting(s)
        return internal_state(s) | {"kv_accounting": self._last, "failed_steps": s.failed_steps}


def internal_state(s: Scheduler) -> dict[str, Any]:
    """Counters, pool sizes and, when idle, the conservation check's terms (or its error)."""
    return {
        "kv_conservation": s.check_memory(strict=False) if s.is_idle() else None,
        **s.stats.as_dict(),
        "cache_hit_rate": s.stats.cache_hit_rate,
        "num_waiting_reqs": len(s.queue),
        "num_running_reqs": len(s.active_requests()),
        "available_tokens": s.token_to_kv_pool_allocator.available_size(),
        "evictable_tokens": s.tree_cache.evictable_size(),
        "protected_tokens": s.tree_cache.protected_size(),
        "max_total_num_tokens": s.max_total_num_tokens,
        "token_usage": 1 - s.free_and_evictable() / s.max_total_num_tokens,
        "page_size": s.page_size,
        "context_len": s.context_len,
        "max_running_requests": s.max_running_requests,
        "new_token_ratio": s.new_token_ratio.value,
        "disable_radix_cache": s.tree_cache.disable,
        "schedule_policy": s.policy.policy,
        "cache_epoch": s.cache_epoch,
        **s.grammars.cache_info(),
        **_window_pool(s),
    }


def _window_pool(s: Scheduler) -> dict[str, int]:
    """A hybrid (sliding-window) model's window pool: free, cached evictable, locked; nothing for other models."""
    tree, alloc = s.tree_cache, s.token_to_kv_pool_allocator
    if not hasattr(tree, "window_evictable_size"):
        return {}
    return {"window_pool_tokens": alloc.window_size, "window_available_tokens": alloc.window_available_size(),
            "window_evictable_tokens": tree.window_evictable_size(),
            "window_protected_tokens": tree.window_protected_size(), "sliding_window": tree.sliding_window}


def _pool_fingerprint(s: Scheduler) -> tuple:
    stats = s.stats
    return (stats.num_prefill_batches, stats.num_decode_batches, stats.num_requests, stats.num_aborts,
            s.token_to_kv_pool_allocator.available_size(), s.tree_cache.evictable_size(),
            s.tree_cache.protected_size(), s.req_to_token_pool.available_size(), len(s.queue), s.is_idle())


def kv_accounting(scheduler: Scheduler) -> dict[str, Any]:
    """available + pending_free + evictable + protected + request_private == size, checked page by page.

    NOTE: runs on the scheduler thread (it answers GetInternalStateReq between steps), so it sees a
    consistent pool; `holds` is what the identity and single ownership say right now.
    """
    from radixserve.mem_cache.conservation import ConservationError, check_conservation

    pool = scheduler.req_to_token_pool
    active = scheduler.active_requests()
    try:
        report = check_conservation(scheduler.token_to_kv_pool_allocator, scheduler.tree_cache, pool,
                                    [r.kv for r in active])
        holds, error = True, None
    except ConservationError as e:
        report, holds, error = e.report, False, str(e)
    except Exception as e:  # noqa: BLE001 - a diagnostic must never take the scheduler down
        logger.exception("KV accounting failed")
        report, holds, error = {}, False, f"{type(e).__name__}: {e}"
    return {**report, "holds": holds, "error": error, "active_requests": len(active),
            "req_rows_in_use": pool.size - pool.available_size(), "idle": scheduler.is_idle()}


