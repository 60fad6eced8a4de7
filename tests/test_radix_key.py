"""RadixKey: length, iteration, indexing, page alignment, child keys and page-rounded matching."""

from array import array

import pytest
import torch

from radixserve.mem_cache.radix_key import RadixKey, common_prefix_len, pack_tokens


def test_length_iteration_and_storage():
    key = RadixKey([1, 2, 3], extra_key="ns")
    assert len(key) == 3 and list(key) == [1, 2, 3]
    assert key.token_ids == (1, 2, 3) and key.extra_key == "ns"
    assert len(RadixKey([])) == 0 and list(RadixKey([42])) == [42]
    assert RadixKey(torch.tensor([5, 6])).token_ids == (5, 6)


def test_integer_indexing_returns_one_token_keys():
    key = RadixKey([10, 20, 30], extra_key="x")
    assert key[0] == RadixKey([10], "x")
    assert key[-1] == RadixKey([30], "x")
    assert key[2] == RadixKey([30], "x")
    with pytest.raises(IndexError):
        key[10]
    with pytest.raises(IndexError):
        key[-4]


def test_slices_keep_the_namespace():
    key = RadixKey([1, 2, 3, 4, 5], extra_key="extra")
    assert key[1:4] == RadixKey([2, 3, 4], "extra")
    assert len(key[2:2]) == 0 and key[2:2].extra_key == "extra"
    assert key[:] == key
    with pytest.raises(ValueError):
        key[::2]


def test_repr_names_key_and_truncates():
    assert "RadixKey" in repr(RadixKey([1, 2], "test")) and "extra_key='test'" in repr(RadixKey([1], "test"))
    assert "..." in repr(RadixKey(range(20))) and "..." not in repr(RadixKey(range(10)))


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_page_aligned(page_size):
    key = RadixKey(range(2 * page_size + 3), "ns")
    aligned = key.page_aligned(page_size)
    expected = 2 * page_size + (3 if page_size == 1 else 0)
    assert len(aligned) == expected and aligned.extra_key == "ns"
    assert RadixKey(range(page_size - 1)).page_aligned(page_size).token_ids == (
        tuple(range(page_size - 1)) if page_size == 1 else ())


def test_child_key_page_one_and_paged_with_and_without_namespace():
    key = RadixKey([7, 8, 9, 10, 11])
    assert key.child_key(1) == 7
    assert key.child_key(4) == (7, 8, 9, 10)
    ns_key = RadixKey([7, 8, 9, 10, 11], extra_key="a")
    assert ns_key.child_key(1) == ("a", 7)
    assert ns_key.child_key(4) == ("a", (7, 8, 9, 10))


def test_match_page_one():
    base = RadixKey([1, 2, 3, 4])
    assert base.match(RadixKey([1, 2, 3, 4])) == 4
    assert base.match(RadixKey([1, 2, 9, 9])) == 2
    assert RadixKey([9, 2, 3]).match(RadixKey([1, 2, 3])) == 0
    assert base.match(RadixKey([1, 2, 3])) == 3
    assert base.match(RadixKey([])) == 0


def test_match_paged_rounds_down():
    eight = list(range(1, 9))
    assert RadixKey(eight).match(RadixKey(eight[:6] + [99, 8]), 4) == 4
    assert RadixKey(eight).match(RadixKey([1, 99] + eight[2:]), 4) == 0
    assert RadixKey(eight).match(RadixKey(eight[:4] + [99] + eight[5:]), 4) == 4
    assert RadixKey(eight).match(RadixKey(eight), 4) == 8
    assert RadixKey([1, 2, 3]).match(RadixKey([1, 2, 3]), 4) == 0


@pytest.mark.parametrize("page_size", [1, 4, 64])
@pytest.mark.parametrize("diverge", [1, 2, 63, 64, 65, 127, 128, 511, 512, 513, 1234, 1999])
def test_match_long_keys(page_size, diverge):
    base = list(range(2000))
    other = list(base)
    other[diverge] = -1
    assert RadixKey(base).match(RadixKey(other), page_size) == diverge // page_size * page_size
    assert RadixKey(base).match(RadixKey(base), 64) == 1984


def test_match_refuses_different_namespaces():
    with pytest.raises(ValueError):
        RadixKey([1, 2], "a").match(RadixKey([1, 2], "b"))
    with pytest.raises(ValueError):
        RadixKey([1, 2], "a").match(RadixKey([1, 2]))


def test_common_prefix_len_with_offset():
    def packed(*tokens):
        return pack_tokens(tokens)

    edge = packed(5, 6, 7, 8)
    assert common_prefix_len(edge, packed(1, 5, 6, 7, 8, 9), 1) == 4
    assert common_prefix_len(edge, packed(1, 5, 6, 0), 1) == 2
    assert common_prefix_len(edge, packed(1, 5), 1) == 1
    assert common_prefix_len(edge, packed(1), 1) == 0
    # a difference in the high byte of a token is still a different token
    assert common_prefix_len(packed(1, 2**40 + 3), packed(1, 3), 0) == 1


def test_token_containers_and_range():
    assert RadixKey(array("q", [1, 2, 3])) == RadixKey([1, 2, 3]) == RadixKey((1, 2, 3))
    assert RadixKey(x for x in (4, 5)).token_ids == (4, 5)
    assert RadixKey([-1, 2**62]).token_ids == (-1, 2**62)
    with pytest.raises(ValueError):
        RadixKey([2**64])
    with pytest.raises(TypeError):
        RadixKey(b"\x01\x02")


def test_namespace_types_are_restricted():
    for good in (None, "", "tenant", b"raw", 7, ("lora", 3, ("salt", b"x"))):
        RadixKey([1], extra_key=good)
    for bad in (True, 1.0, ["a"], {"a": 1}, ("a", None), ("a", 1.5)):
        with pytest.raises(TypeError):
            RadixKey([1], extra_key=bad)
