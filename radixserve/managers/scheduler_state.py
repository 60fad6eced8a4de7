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
        **s.sessions.report(),  # NOTE: session_pinned_tokens are part of protected_tokens (tree-owned, locked)
    }


def _window_pool(s: Scheduler) -> dict[str, int]:
    """Each tier past the device pool (tiers.py; a hybrid model's `window` pool): its size, free, cached evictable,
    locked, as `<tier>_pool_tokens`, `<tier>_available_tokens`, ...; and a hybrid tree's `sliding_window`.

    NOTE: the device tier's figures are the top-level `max_total_num_tokens`, `available_tokens`, ... above;
    a plain model has no further tier, so adds nothing."""
    out: dict[str, int] = {}
    for tier in s.tree_cache.tiers()[1:]:
        out |= {f"{tier.name}_pool_tokens": tier.capacity, f"{tier.name}_available_tokens": tier.free,
                f"{tier.name}_evictable_tokens": tier.evictable, f"{tier.name}_protected_tokens": tier.protected}
    if s.tree_cache.sliding_window is not None:
        out["sliding_window"] = s.tree_cache.sliding_window
    return out


def _pool_fingerprint(s: Scheduler) -> tuple:
    stats = s.stats
    return (stats.num_prefill_batches, stats.num_decode_batches, stats.num_requests, stats.num_aborts,
            s.token_to_kv_pool_allocator.available_size(), s.tree_cache.evictable_size(),
            s.tree_cache.protected_size(), s.req_to_token_pool.available_size(), len(s.queue), s.is_idle(),
            len(s.sessions.sessions))


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
                                    [r.kv for r in active], scheduler.sessions.pinned_nodes())
        holds, error = True, None
    except ConservationError as e:
        report, holds, error = e.report, False, str(e)
    except Exception as e:  # noqa: BLE001 - a diagnostic must never take the scheduler down
        logger.exception("KV accounting failed")
        report, holds, error = {}, False, f"{type(e).__name__}: {e}"
    return {**report, "holds": holds, "error": error, "active_requests": len(active),
            "req_rows_in_use": pool.size - pool.available_size(), "idle": scheduler.is_idle()}


