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


def longest_hybrid_prefix(query_tokens: Sequence[int], query_namespace: Hashable,
                          cached_paths: Iterable[tuple[Sequence[int], Hashable, Sequence[bool]]], page_size: int,
                          window: int) -> int:
    """The match a hybrid (sliding-window) model can reuse: the longest whole-page prefix m of `query_tokens`
    that is cached (full-attention KV) and whose window KV is there for every position the next token's window
    layers read, max(0, m - window + 1) .. m - 1.

    Each cached path carries, per token, whether its window KV is still present (False: freed, a tombstone).
    Paths that share a prefix are the same tree nodes, so a position's window KV counts as present if any path
    through it has it. With every flag True this is `longest_cached_prefix`. The design it specifies is in
    docs/radix_cache.md ("Hybrid models"); the tree that answers it is not built yet."""
    if window <= 0:
        raise ValueError("window must be positive")
    paths = [(tokens, namespace, flags) for tokens, namespace, flags in cached_paths]
    full = longest_cached_prefix(query_tokens, query_namespace, [(t, n) for t, n, _ in paths], page_size)
    present = [False] * full
    for tokens, namespace, flags in paths:
        if namespace != query_namespace:
            continue
        for i in range(min(full, len(tokens))):
            if tokens[i] != query_tokens[i]:
                break
            present[i] = present[i] or bool(flags[i])
    for m in range(full, 0, -page_size):
        if all(present[max(0, m - window + 1) : m]):
            return m
    return 0
