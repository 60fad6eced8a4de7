"""The scheduler's internal state as the front end's /get_server_info and /metrics read it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radixserve.managers.scheduler import Scheduler


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
    }
