"""The hybrid-model match oracle (`longest_hybrid_prefix`): hand scenarios and properties (hypothesis)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.mem_cache.reference import longest_cached_prefix, longest_hybrid_prefix


def test_tombstoned_window_kv_shortens_the_match():
    tokens = list(range(20))
    flags = [False] * 12 + [True] * 8  # window KV freed for positions 0..11 (left every running window)
    paths = [(tokens, None, flags)]
    # a query of the whole path: m = 20 needs positions 16..19 (window 5): present
    assert longest_hybrid_prefix(tokens + [99], None, paths, 1, window=5) == 20
    # the query diverges at 15: m = 15 needs 11..14, and 11 is a tombstone; m = 13 needs 9..12: also not
    assert longest_hybrid_prefix(tokens[:15] + [99], None, paths, 1, window=5) == 0
    # a window of 1 needs no earlier token: any cached prefix will do
    assert longest_hybrid_prefix(tokens[:15] + [99], None, paths, 1, window=1) == 15
    # pages of 4: 15 -> 12, whose window 8..11 is freed
    assert longest_hybrid_prefix(tokens[:15] + [99], None, paths, 4, window=5) == 0


def test_shared_nodes_count_window_kv_of_any_path_and_namespaces_stay_apart():
    a = ([1, 2, 3, 4, 5, 6], None, [False, False, True, True, True, True])
    b = ([1, 2, 3, 4, 7, 8], None, [False, False, False, False, True, True])  # same nodes for 1..4
    assert longest_hybrid_prefix([1, 2, 3, 4, 7, 8, 9], None, [a, b], 1, window=3) == 6
    assert longest_hybrid_prefix([1, 2, 3, 4, 9], None, [b], 1, window=3) == 0
    assert longest_hybrid_prefix([1, 2, 3, 4, 9], None, [a, b], 1, window=3) == 4
    assert longest_hybrid_prefix([1, 2, 3, 4, 9], "other", [a, b], 1, window=3) == 0


paths_st = st.lists(st.tuples(st.lists(st.integers(0, 3), min_size=1, max_size=12), st.sampled_from([None, "ns"]),
                              st.lists(st.booleans(), min_size=12, max_size=12)), max_size=4)


@settings(max_examples=200, deadline=None)
@given(paths=paths_st, query=st.lists(st.integers(0, 3), max_size=14), page=st.sampled_from([1, 2, 4]),
       window=st.integers(1, 6))
def test_properties(paths, query, page, window):
    m = longest_hybrid_prefix(query, None, paths, page, window)
    full = longest_cached_prefix(query, None, [(t, n) for t, n, _ in paths], page)
    assert 0 <= m <= full and m % page == 0
    every = longest_hybrid_prefix(query, None, [(t, n, [True] * 12) for t, n, _ in paths], page, window)
    assert every == full  # with no tombstone the hybrid match is the plain match
    none = longest_hybrid_prefix(query, None, [(t, n, [False] * 12) for t, n, _ in paths], page, window)
    assert none == (full if window == 1 else 0)  # window 1 reads no earlier token
    if m:  # the answer's window is present on some path through the query's prefix
        for pos in range(max(0, m - window + 1), m):
            assert any(n is None and list(t[: pos + 1]) == list(query[: pos + 1]) and f[pos] for t, n, f in paths)
