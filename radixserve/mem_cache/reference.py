"""`longest_cached_prefix`: an executable semantic model of a page-aligned, namespace-aware prefix match.

`longest_cached_prefix` is what `RadixCache.match_prefix` must return (in length), computed the
slow, obvious way over a flat list of cached paths. No tree, no splits, no locks: the property
tests compare the real cache against it.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

from radixserve.mem_cache.radix_key import convert_to_bigram_key


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


def longest_cached_bigram_prefix(query_tokens: Sequence[int], query_namespace: Hashable,
                                 cached_paths: Iterable[tuple[Sequence[int], Hashable]], page_size: int) -> int:
    """The same question in the EAGLE bigram view: pairs (t[i], t[i+1]) are compared, in whole pages of pairs.

    The answer counts pairs, so it is a number of KV slots: slot i is reused only when the cached
    path has both t[i] and t[i+1] of the query.
    """
    paths = [(convert_to_bigram_key(tokens), namespace) for tokens, namespace in cached_paths]
    return longest_cached_prefix(convert_to_bigram_key(query_tokens), query_namespace, paths, page_size)
