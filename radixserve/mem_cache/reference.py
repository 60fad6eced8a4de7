"""The lesson's exercise: an executable semantic model of a page-aligned, namespace-aware prefix match.

`longest_cached_prefix` is what `RadixCache.match_prefix` must return (in length), computed the
slow, obvious way over a flat list of cached paths. No tree, no splits, no locks: the property
tests compare the real cache against it.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence


def longest_cached_prefix(query_tokens: Sequence[int], query_namespace: Hashable,
                          cached_paths: Iterable[tuple[Sequence[int], Hashable]], page_size: int) -> int:
    """Longest prefix of `query_tokens`, in whole pages, shared with a cached path of the same namespace."""
    if page_size <= 0:
        raise ValueError("page_size must be positive")
    best = 0
    for cached_tokens, cached_namespace in cached_paths:
        if cached_namespace != query_namespace:
            continue
        common = 0
        for left, right in zip(query_tokens, cached_tokens, strict=False):
            if left != right:
                break
            common += 1
        # NOTE: only whole pages can be reused; a partial page's KV is never shared.
        aligned = common // page_size * page_size
        best = max(best, aligned)
    return best
