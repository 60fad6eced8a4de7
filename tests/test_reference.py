"""longest_cached_prefix, the semantic model of a page-aligned, namespace-aware match."""

import pytest

from radixserve.mem_cache.reference import longest_cached_prefix

CACHE = [
    ([1, 2, 3, 4, 5, 9], "base"),
    ([1, 2, 3, 4, 6, 7, 8, 9], "adapter-A"),
]


def test_three_basic_assertions():
    assert longest_cached_prefix([1, 2, 3, 4, 5, 8], "base", CACHE, 4) == 4
    assert longest_cached_prefix([1, 2, 3, 4, 6, 7], "adapter-A", CACHE, 2) == 6
    assert longest_cached_prefix([1, 2, 3, 4], "adapter-B", CACHE, 2) == 0


def test_query_shorter_than_the_cached_path():
    assert longest_cached_prefix([1, 2, 3], "adapter-A", CACHE, 1) == 3
    assert longest_cached_prefix([1, 2, 3], "adapter-A", CACHE, 2) == 2
    assert longest_cached_prefix([1, 2, 3], "adapter-A", CACHE, 4) == 0  # shorter than a page
    assert longest_cached_prefix([], "base", CACHE, 1) == 0


def test_a_worked_example():
    path = [([1, 2, 3, 4, 5, 6, 7, 8], "lora_finance")]
    query = [1, 2, 3, 4, 5, 6, 7, 9]
    assert longest_cached_prefix(query, "lora_finance", path, 4) == 4  # 7 common, floor to a page
    assert longest_cached_prefix(query, "lora_medical", path, 4) == 0


def test_best_of_several_paths_and_structured_namespaces():
    paths = [([1, 2], ("t", "x")), ([1, 2, 3, 4], "t:x"), ([1, 2, 3], ("t", "x"))]
    assert longest_cached_prefix([1, 2, 3, 4], ("t", "x"), paths, 1) == 3
    assert longest_cached_prefix([1, 2, 3, 4], "t:x", paths, 1) == 4
    assert longest_cached_prefix([1, 2, 3, 4], None, paths + [([1], None)], 1) == 1


@pytest.mark.parametrize("page_size", [0, -1])
def test_non_positive_page_size_is_an_error(page_size):
    with pytest.raises(ValueError, match="page_size"):
        longest_cached_prefix([1], None, [], page_size)
