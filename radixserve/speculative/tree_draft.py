"""Drafts from the radix tree: what followed the request's whole sequence in another request of its namespace.

When the same prompt (a retried agent step, a fan-out of `n` choices, a benchmark replay, a system prompt plus
the same question) was answered before, the tree holds that answer after the prompt. The walk below follows the
request's tokens down the tree under the request's own `extra_key`, reading only: it neither splits an edge
nor touches access times, so drafting never changes what is cached or what is evicted first. Past the end of
the request's tokens it follows the most recently used child. Keys of another namespace are other children, so
one tenant's or adapter's text never becomes another's draft.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from radixserve.mem_cache.radix_key import RadixKey, common_prefix_len, unpack_tokens

TOKEN_BYTES = 8


def tree_continuation(tree: Any, tokens: Sequence[int], extra_key: Any, max_tokens: int) -> list[int]:
    """Up to `max_tokens` tokens the tree holds right after `tokens` (namespace `extra_key`); [] when the tree does
    not hold all of `tokens` on one path. The tree's EAGLE bigram view is not walked."""
    if tree.disable or tree.is_eagle or max_tokens <= 0 or not tokens:
        return []
    packed = RadixKey(tokens, extra_key).packed
    end = len(packed) // TOKEN_BYTES
    node, pos = tree.root_node, 0
    while pos < end:
        child = _child_at(tree, node, packed, pos, end, extra_key)
        if child is None:
            return []
        edge = child.key.packed
        matched = common_prefix_len(edge, packed, pos)
        if pos + matched == end:  # NOTE: the request's tokens end on this edge: the rest of it follows them
            return _follow(child, list(unpack_tokens(edge[matched * TOKEN_BYTES:])), max_tokens)
        if matched * TOKEN_BYTES < len(edge):
            return []  # the request diverged from every cached sequence
        node, pos = child, pos + matched
    return _follow(node, [], max_tokens)


def _child_at(tree: Any, node: Any, packed: bytes, pos: int, end: int, extra_key: Any) -> Any:
    ps = tree.page_size
    if end - pos >= ps:
        return node.children.get(tree._child_key(packed, pos, extra_key))
    # NOTE: less than a page left: the child keyed by a page that starts with those tokens, in this namespace
    rest = packed[pos * TOKEN_BYTES:]
    return next((c for c in node.children.values() if c.key.extra_key == extra_key and c.key.packed.startswith(rest)),
                None)


def _follow(node: Any, out: list[int], max_tokens: int) -> list[int]:
    while len(out) < max_tokens and node.children:
        node = max(node.children.values(), key=lambda c: c.last_access_time)
        out.extend(unpack_tokens(node.key.packed[: (max_tokens - len(out)) * TOKEN_BYTES]))
    return out[:max_tokens]
