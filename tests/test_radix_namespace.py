"""The namespace (extra_key) is a security boundary: same tokens in another namespace never match,
and no namespace can be forged by picking a value that collides with another's string form."""

import pytest
import torch

from radixserve.mem_cache.radix_cache import RadixCache, RadixKey

TOKENS = list(range(1, 33))

# Pairs that a string-concatenating or str()-ing implementation would confuse.
COLLIDING_PAIRS = [
    (("a", "b"), "a:b"),
    (("a", "b"), "ab"),
    (("a:b", "c"), ("a", "b:c")),
    (("a", ""), "a"),
    (("a",), "a"),
    ("1", 1),
    (b"a", "a"),
    ("None", None),
    ("", None),
    ((("a", "b"), "c"), ("a", ("b", "c"))),
    ("('a', 'b')", ("a", "b")),
    ("a", "a "),
]


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("victim,attacker", COLLIDING_PAIRS + [(b, a) for a, b in COLLIDING_PAIRS])
def test_colliding_namespaces_never_share(page_size, victim, attacker):
    cache = RadixCache(page_size=page_size)
    cache.insert(RadixKey(TOKENS, victim))
    result = cache.match_prefix(RadixKey(TOKENS, attacker))
    assert result.device_indices.numel() == 0 and result.last_node is cache.root_node
    # positive control: the victim's own namespace hits, so the miss above is not vacuous
    assert cache.match_prefix(RadixKey(TOKENS, victim)).device_indices.numel() == len(TOKENS)
    # the attacker's insert does not reuse the victim's KV either
    assert cache.insert(RadixKey(TOKENS, attacker)) == 0
    assert cache.total_size() == 2 * len(TOKENS)


@pytest.mark.parametrize("page_size", [1, 4])
def test_namespaces_partition_the_root(page_size):
    cache = RadixCache(page_size=page_size)
    for ns in ("key1", "key2", None, ("key1",)):
        cache.insert(RadixKey(TOKENS, ns))
    assert len(cache.root_node.children) == 4
    for node in cache._iter_nodes():
        assert node.parent is cache.root_node or node.key.extra_key == node.parent.key.extra_key
    assert cache.match_prefix(RadixKey(TOKENS, "nonexistent")).device_indices.numel() == 0


def test_same_prefix_in_two_namespaces_keeps_separate_values():
    cache = RadixCache()
    cache.insert(RadixKey([1, 2, 3], "key1"), value=torch.tensor([10, 20, 30]))
    cache.insert(RadixKey([1, 2, 3], "key2"), value=torch.tensor([40, 50, 60]))
    cache.insert(RadixKey([1, 2, 3]), value=torch.tensor([70, 80, 90]))
    assert cache.match_prefix(RadixKey([1, 2, 3], "key1")).device_indices.tolist() == [10, 20, 30]
    assert cache.match_prefix(RadixKey([1, 2, 3], "key2")).device_indices.tolist() == [40, 50, 60]
    assert cache.match_prefix(RadixKey([1, 2, 3])).device_indices.tolist() == [70, 80, 90]


def test_a_first_token_equal_to_a_namespace_tuple_cannot_collide():
    # page 1: a plain child key is an int, a namespaced one is a 2-tuple; page 2: plain is a tuple of ints
    cache = RadixCache(page_size=2)
    cache.insert(RadixKey([5, 1, 2, 3]))
    assert cache.match_prefix(RadixKey([1, 2, 3, 4], 5)).device_indices.numel() == 0
    cache1 = RadixCache(page_size=1)
    cache1.insert(RadixKey([7, 8], "x"))
    assert cache1.match_prefix(RadixKey([7, 8])).device_indices.numel() == 0


def test_ambiguous_namespace_types_are_refused():
    # True == 1 == 1.0 as dict keys: allowing them would merge namespaces silently
    for bad in (True, 1.0, ("a", False)):
        with pytest.raises(TypeError):
            RadixKey(TOKENS, bad)
