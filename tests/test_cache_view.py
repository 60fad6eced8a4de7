"""Watching the tree without a server: the event log, pretty_print, the bounded snapshot, the explorer's
filtering by API key, and the lesson's runnable example."""

from __future__ import annotations

import base64
import io
import json

import pytest

from radixserve.entrypoints.cache_explorer import parse_query, presented_key, public, visible_to
from radixserve.entrypoints.http_errors import ApiError
from radixserve.examples.lesson import WordTokenizer
from radixserve.examples.lesson import main as lesson_main
from radixserve.frontend.tokenizer_manager import api_key_id, cache_namespace
from radixserve.mem_cache.allocator import TokenToKVPoolAllocator
from radixserve.mem_cache.cache_events import CacheEventLog
from radixserve.mem_cache.cache_view import NamespaceLabels, format_events, tree_snapshot
from radixserve.mem_cache.radix_cache import RadixCache, RadixKey


def recording_cache(page_size: int = 1, **kwargs) -> RadixCache:
    cache = RadixCache(page_size=page_size, **kwargs)
    cache.events = CacheEventLog(capacity=64)
    return cache


def kinds(cache: RadixCache, since: int = 0) -> list[str]:
    return [e.kind for e in cache.events.since(since)[0]]


# ---------------------------------------------------------------------------------------------- events

def test_no_log_by_default_records_nothing():
    cache = RadixCache()
    cache.insert(RadixKey([1, 2, 3]))
    assert cache.events is None and tree_snapshot(cache)["recording"] is False


def test_the_log_records_each_operation_with_its_nodes():
    alloc = TokenToKVPoolAllocator(64)
    cache = RadixCache(token_to_kv_pool_allocator=alloc)
    cache.events = CacheEventLog()
    cache.insert(RadixKey([1, 2, 3, 4]), alloc.alloc(4))
    first = cache.match_prefix(RadixKey([1, 2, 3, 4])).last_node
    result = cache.match_prefix(RadixKey([1, 2, 9]))  # splits [1, 2, 3, 4] after 2 tokens
    cache.match_prefix(RadixKey([7, 7]))  # a miss is not logged
    cache.inc_lock_ref(result.last_node)
    cache.dec_lock_ref(result.last_node)
    assert kinds(cache) == ["insert", "match", "split", "match", "lock", "unlock"]
    events = cache.events.since(0)[0]
    split = events[2]
    assert split.node == result.last_node.id and split.detail == first.id and split.tokens == 2
    assert (events[3].node, events[3].tokens, events[3].detail) == (result.last_node.id, 2, 3)
    assert (events[4].tokens, events[4].detail) == (2, 1) and (events[5].tokens, events[5].detail) == (2, 0)


def test_evict_logs_its_victims_in_eviction_order():
    alloc = TokenToKVPoolAllocator(64)
    cache = RadixCache(token_to_kv_pool_allocator=alloc)
    cache.events = CacheEventLog()
    cache.insert(RadixKey([1, 2, 3]), alloc.alloc(3))
    cache.insert(RadixKey([1, 2, 4, 5]), alloc.alloc(4))
    cache.insert(RadixKey([9, 9], "tenant"), alloc.alloc(2))
    cache.match_prefix(RadixKey([1, 2, 4, 5]))  # most recent: evicted last
    old, young = (cache.match_prefix(RadixKey(k)).last_node for k in ([1, 2, 3], [1, 2, 4, 5]))
    tenant = cache.match_prefix(RadixKey([9, 9], "tenant")).last_node
    cache.match_prefix(RadixKey([1, 2, 4, 5]))
    parent = old.parent
    seq = cache.events.seq
    assert cache.evict(100) == 7
    (event,) = cache.events.since(seq)[0]
    asked, victims = event.detail
    assert event.kind == "evict" and asked == 100 and event.tokens == 7
    # least recently used first; the parent [1, 2] only once both its children were gone
    assert [v[0] for v in victims] == [old.id, tenant.id, young.id, parent.id]
    assert [v[1] for v in victims] == [1, 2, 2, 2] and victims[1][2] == "tenant"
    assert victims[0][3] == parent.id and victims[3][3] == cache.root_node.id
    snapshot = tree_snapshot(cache, since=seq)
    assert "evict 7 tok (asked 100)" in format_events(snapshot)


def test_the_ring_is_bounded_and_since_counts_what_was_lost():
    cache = recording_cache()
    for i in range(100):
        cache.insert(RadixKey([i, i]))
    log = cache.events
    assert len(log) == 64 and log.seq == 100
    events, lost = log.since(10, limit=20)
    assert [e.seq for e in events] == list(range(81, 101)) and lost == 70
    assert log.since(100) == ([], 0)
    cache.reset()
    assert kinds(cache, 100) == ["reset"]


# ---------------------------------------------------------------------------------------------- printing

def test_pretty_print_shows_namespaces_apart(capsys):
    cache = RadixCache()
    for ns in (None, "lora_finance", (("api", api_key_id("k")), ("salt", "tenant-a"))):
        cache.insert(RadixKey([1, 2, 3], ns))
    text = cache.pretty_print()
    lines = [line for line in text.splitlines() if "[1, 2, 3]" in line]
    assert len(lines) == 3 and len(set(lines)) == 3  # the same tokens, three different nodes
    assert any("[shared]" in line for line in lines) and any("[str#" in line for line in lines)
    assert any("[api+salt#" in line for line in lines)
    assert "tenant-a" not in text and "lora_finance" not in text  # only kinds and hashes by default
    assert "'lora_finance'" in cache.pretty_print(reveal_namespace=True)
    capsys.readouterr()


def test_pretty_print_shows_locks_evictability_age_and_tokens_full_or_elided():
    cache = RadixCache()
    cache.insert(RadixKey(list(range(1, 31))))
    node = cache.match_prefix(RadixKey(list(range(1, 31)))).last_node
    cache.inc_lock_ref(node)
    text = cache.pretty_print()
    assert "lock_ref=1 protected" in text and "age=" in text and "hits=1" in text
    assert "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, ... +20]" in text
    assert ", ".join(map(str, range(1, 31))) + "]" in cache.pretty_print(max_tokens=None)
    cache.dec_lock_ref(node)
    assert "lock_ref=0 evictable" in cache.pretty_print()


def test_pretty_print_decodes_with_a_tokenizer_and_lists_recent_events():
    words = WordTokenizer(["<pad>", "the", "radix", "tree", "cache"])
    cache = recording_cache()
    cache.insert(RadixKey([1, 2, 3]))
    cache.insert(RadixKey([1, 2, 4]))
    text = cache.pretty_print(tokenizer=words, events=5)
    assert "'the radix'" in text and "'tree'" in text and "'cache'" in text
    assert "recent events:" in text and "split" in text


def test_pretty_print_of_the_bigram_view_counts_pairs():
    cache = RadixCache(is_eagle=True)
    cache.insert(RadixKey([5, 6, 7]))
    text = cache.pretty_print()
    assert "bigram" in text and "2 pairs" in text and "[5, 6, 7]" in text


# ---------------------------------------------------------------------------------------------- snapshot

def test_snapshot_is_bounded_breadth_first():
    cache = recording_cache()
    for i in range(50):
        cache.insert(RadixKey([i] + list(range(100))))
    snapshot = tree_snapshot(cache, max_nodes=10, max_tokens=5, max_events=3)
    assert len(snapshot["nodes"]) == 10 and snapshot["truncated"]
    assert [n["depth"] for n in snapshot["nodes"]] == [0] + [1] * 9
    assert all(len(n["tokens"]) == 5 and n["elided"] == 96 for n in snapshot["nodes"][1:])
    assert len(snapshot["events"]) == 3 and snapshot["events_lost"] == 47
    json.dumps(snapshot)  # JSON-ready as is


def test_snapshot_names_secrets_by_kind_and_keyed_hash_only():
    key_id = api_key_id("sk-very-secret")
    ns = cache_namespace(key_id, "salt-of-tenant-a", None)
    cache = recording_cache()
    cache.insert(RadixKey([1, 2], ns))
    cache.insert(RadixKey([1, 2], cache_namespace(key_id, "salt-of-tenant-b", None)))
    snapshot = tree_snapshot(cache, NamespaceLabels(secret=b"s" * 16))
    dumped = json.dumps(public(snapshot))
    assert "salt-of-tenant" not in dumped and key_id not in dumped and "sk-very-secret" not in dumped
    labels = [snapshot["namespaces"][n["ns"]] for n in snapshot["nodes"][1:]]
    assert [label["kind"] for label in labels] == ["api+salt", "api+salt"]
    assert labels[0]["hash"] != labels[1]["hash"] and len(labels[0]["hash"]) == 8
    # keyed: another process (another secret) names the same namespace differently
    assert NamespaceLabels(secret=b"t" * 16).describe(ns)["hash"] != NamespaceLabels(secret=b"s" * 16).describe(ns)["hash"]


def test_each_api_key_sees_only_its_own_namespaces():
    alloc = TokenToKVPoolAllocator(64)
    cache = RadixCache(token_to_kv_pool_allocator=alloc)
    cache.events = CacheEventLog()
    mine, theirs = cache_namespace(api_key_id("a"), None, None), cache_namespace(api_key_id("b"), "s", None)
    cache.insert(RadixKey([1, 2, 3], mine), alloc.alloc(3))
    cache.insert(RadixKey([1, 2, 3], theirs), alloc.alloc(3))
    cache.insert(RadixKey([4], ("health", "probe")), alloc.alloc(1))
    cache.evict(100)
    cache.insert(RadixKey([1, 2, 3], theirs), alloc.alloc(3))
    snapshot = visible_to(tree_snapshot(cache), api_key_id("a"))
    assert [n["parent"] for n in snapshot["nodes"]] == [None] and snapshot["hidden_nodes"] == 1
    evict = next(e for e in snapshot["events"] if e["kind"] == "evict")
    assert {snapshot["namespaces"][v["ns"]]["kind"] for v in evict["victims"]} == {"api", "tuple"}
    assert evict["tokens"] == 4  # 3 of key a + the shared probe, not key b's 3
    assert all(snapshot["namespaces"][e["ns"]]["kind"] != "another key's" for e in snapshot["events"])


def test_explorer_accepts_the_key_as_bearer_or_basic_password():
    basic = base64.b64encode(b"anyone:sk-1").decode()
    assert presented_key("Bearer sk-1") == b"sk-1" and presented_key(f"Basic {basic}") == b"sk-1"
    assert presented_key("Basic " + base64.b64encode(b"sk-1:").decode()) == b"sk-1"
    assert presented_key("Basic not-base64!") is None and presented_key("sk-1") is None


def test_explorer_query_limits_are_checked():
    assert parse_query({}) == {"max_nodes": 400, "max_tokens": 48, "since": 0, "max_events": 300}
    assert parse_query({"since": "12", "max_nodes": "5"})["max_nodes"] == 5
    for bad in ({"max_nodes": "0"}, {"max_tokens": "x"}, {"since": "-1"}, {"max_events": "99999"}):
        with pytest.raises(ApiError) as err:
            parse_query(bad)
        assert err.value.status == 400 and err.value.param == next(iter(bad))


# ---------------------------------------------------------------------------------------------- the lesson

def test_the_lessons_example_runs_and_agrees_with_the_reference():
    out = io.StringIO()
    checks = lesson_main(out)
    text = out.getvalue()
    assert checks >= 12 and f"All {checks} answers agree with the reference model." in text
    assert "[str='lora_finance'] 4 tok lock_ref=1 protected" in text  # the worked example's locked page
    assert "match [1, 2, 3, 4, 5, 6, 7, 9] in 'lora_medical': 0 cached" in text
    assert "evicted, in order:" in text and "bigram" in text
