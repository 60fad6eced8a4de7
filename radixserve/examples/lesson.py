"""The lesson's figure and worked example, replayed on a real `RadixCache`: `python -m radixserve.examples.lesson`.

Four parts, each printing the tree after every step (namespaces shown in clear, tokens as words):
the figure of a radix tree with lock counts and LRU eviction of unlocked leaves; the worked example
with page size 4 and two LoRA adapters (`lora_finance`, `lora_medical`); the exercise's three
assertions plus a query shorter than the cache; and the same worked example in the EAGLE bigram view.
Every length the tree returns is checked against `longest_cached_prefix` (or its bigram version);
a wrong answer raises, so the command exits with an error.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from radixserve.mem_cache.cache_events import CacheEventLog
from radixserve.mem_cache.radix_cache import RadixCache
from radixserve.mem_cache.radix_key import RadixKey
from radixserve.mem_cache.reference import longest_cached_bigram_prefix, longest_cached_prefix


class WordTokenizer:
    """Token id i is the i-th word of a tiny vocabulary; ids outside it print as tok<i>."""

    def __init__(self, words: Sequence[str]) -> None:
        self.words = list(words)
        self.ids = {w: i for i, w in enumerate(self.words)}

    def encode(self, text: str) -> list[int]:
        return [self.ids[w] for w in text.split()]

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(self.words[i] if 0 <= i < len(self.words) else f"tok{i}" for i in ids)


FIGURE_WORDS = WordTokenizer(["<pad>", "Hello", "World", "How", "are", "you?", "Explain", "CUDA", "kernels"])
NUMBERED = WordTokenizer([])  # tok1, tok2, ... as in the lesson's example


class Lesson:
    """One cache at a time; prints each step and checks answers against the reference model."""

    def __init__(self, out: Any = None) -> None:
        self.out = out or sys.stdout
        self.checks = 0

    def say(self, text: str = "") -> None:
        print(text, file=self.out)

    def new_cache(self, page_size: int, is_eagle: bool = False) -> RadixCache:
        cache = RadixCache(page_size=page_size, is_eagle=is_eagle)
        cache.events = CacheEventLog()
        self.paths: list[tuple[list[int], Any]] = []
        self.seen = 0
        return cache

    def show(self, cache: RadixCache, tokenizer: WordTokenizer) -> None:
        from radixserve.mem_cache.cache_view import NamespaceLabels, format_events, format_tree, tree_snapshot

        snapshot = tree_snapshot(cache, NamespaceLabels(reveal=True), max_nodes=None, max_tokens=None,
                                 since=self.seen, max_events=None)
        self.seen = snapshot["event_seq"]
        texts = {n["id"]: tokenizer.decode(n["tokens"]) for n in snapshot["nodes"]}
        for line in format_tree(snapshot, texts).splitlines():
            self.say("    " + line)
        if snapshot["events"]:
            self.say("    events: " + "; ".join(line.strip() for line in format_events(snapshot, 50).splitlines()))
        self.say()

    def insert(self, cache: RadixCache, tokens: list[int], namespace: Any) -> None:
        cache.insert(RadixKey(tokens, namespace))
        self.paths.append((tokens, namespace))

    def match(self, cache: RadixCache, tokens: list[int], namespace: Any, note: str = "") -> Any:
        result = cache.match_prefix(RadixKey(tokens, namespace))
        reference = longest_cached_bigram_prefix if cache.is_eagle else longest_cached_prefix
        expected = reference(tokens, namespace, self.paths, cache.page_size)
        got = len(result.device_indices)
        if got != expected:
            raise AssertionError(f"match_prefix returned {got} tokens, {reference.__name__} says {expected}")
        self.checks += 1
        self.say(f"  match {tokens} in {namespace!r}: {got} cached (reference: {expected}){note}")
        return result

    def check_victims(self, cache: RadixCache, nodes: list[Any]) -> None:
        """The evictions since the last `show` removed exactly these nodes, in this order (from the event log)."""
        events, _ = cache.events.since(self.seen)
        victims = [node_id for e in events if e.kind == "evict" for node_id, _, _, _ in e.detail[1]]
        want = [node.id for node in nodes]
        if victims != want:
            raise AssertionError(f"evicted nodes {victims}, expected {want} (least recently used first)")
        self.checks += 1
        self.say(f"  evicted, in order: {', '.join(f'#{v}' for v in victims)}")


def figure(lesson: Lesson) -> None:
    lesson.say("== Figure: a radix tree with lock counts, and LRU eviction of unlocked leaves (page size 1)")
    words = FIGURE_WORDS
    cache = lesson.new_cache(page_size=1)
    how, explain = words.encode("Hello World How are you?"), words.encode("Hello World Explain CUDA kernels")
    lesson.insert(cache, how, None)
    lesson.insert(cache, explain, None)
    lesson.say("  inserted 'Hello World How are you?' and 'Hello World Explain CUDA kernels':")
    lesson.show(cache, words)
    how_node, explain_node = lesson.match(cache, how, None).last_node, lesson.match(cache, explain, None).last_node
    hello_node = how_node.parent  # "Hello World", split off when the second sentence was inserted
    held = [how_node, explain_node, explain_node]
    for node in held:
        cache.inc_lock_ref(node)
    lesson.say("  three running requests lock their paths (one on 'How are you?', two on 'Explain CUDA "
               "kernels'): 'Hello World' has lock_ref 3, nothing is evictable")
    lesson.show(cache, words)
    assert cache.evict(100) == 0, "locked nodes must not be evicted"
    for node in held:
        cache.dec_lock_ref(node)
    lesson.match(cache, explain, None, note=" (touches this path: it becomes the most recent)")
    lesson.say("  all requests finished: every node is evictable; evict(3) takes the least recently used leaf")
    cache.evict(3)
    lesson.check_victims(cache, [how_node])
    lesson.show(cache, words)
    lesson.say("  evict(100): the other leaf, then its parent, which became an unlocked leaf")
    cache.evict(100)
    lesson.check_victims(cache, [explain_node, hello_node])
    lesson.show(cache, words)


def worked_example(lesson: Lesson, is_eagle: bool = False) -> None:
    view = " in the EAGLE bigram view (pairs of tokens)" if is_eagle else ""
    lesson.say(f"== Worked example: page size 4, adapters lora_finance and lora_medical{view}")
    cache = lesson.new_cache(page_size=4, is_eagle=is_eagle)
    path1 = [1, 2, 3, 4, 5, 6, 7, 8]
    query = [1, 2, 3, 4, 5, 6, 7, 9]
    lesson.insert(cache, path1, "lora_finance")
    lesson.say("  Path 1 = tok1..tok8 cached under lora_finance" + (" (7 pairs; one page of 4 kept)" if is_eagle else ""))
    lesson.show(cache, NUMBERED)
    agree = 6 if is_eagle else 7
    lesson.say(f"  Query = tok1..tok7 tok9: {agree} {'pairs' if is_eagle else 'tokens'} agree, "
               f"floor({agree} / 4) * 4 = 4 are reused")
    split = "" if is_eagle else " -> the edge is split at the page boundary"
    result = lesson.match(cache, query, "lora_finance", note=split)
    assert len(result.device_indices) == 4
    lesson.show(cache, NUMBERED)
    lesson.say("  the request locks its 4 cached tokens while its other tokens are computed:")
    cache.inc_lock_ref(result.last_node)
    lesson.show(cache, NUMBERED)
    cache.dec_lock_ref(result.last_node)
    lesson.say("  the same tokens under lora_medical share nothing (another namespace):")
    assert len(lesson.match(cache, query, "lora_medical").device_indices) == 0
    lesson.show(cache, NUMBERED)


def exercise(lesson: Lesson) -> None:
    lesson.say("== Exercise: the three assertions of longest_cached_prefix, on real trees, and a short query")
    cached = [([1, 2, 3, 4, 5, 9], "base"), ([1, 2, 3, 4, 6, 7, 8, 9], "adapter-A")]
    cases = [([1, 2, 3, 4, 5, 8], "base", 4, 4), ([1, 2, 3, 4, 6, 7], "adapter-A", 2, 6),
             ([1, 2, 3, 4], "adapter-B", 2, 0), ([1, 2, 3], "base", 4, 0), ([1, 2, 3, 4, 6], "adapter-A", 2, 4)]
    for query, namespace, page_size, want in cases:
        cache = lesson.new_cache(page_size)
        for tokens, ns in cached:
            lesson.insert(cache, tokens, ns)
        got = len(lesson.match(cache, query, namespace, note=f" (page size {page_size})").device_indices)
        assert got == want, (query, namespace, got, want)
    lesson.say("  the tree of the last case (page size 2):")
    lesson.show(cache, NUMBERED)


def main(out: Any = None) -> int:
    lesson = Lesson(out)
    figure(lesson)
    worked_example(lesson)
    exercise(lesson)
    worked_example(lesson, is_eagle=True)
    lesson.say(f"All {lesson.checks} answers agree with the reference model.")
    return lesson.checks


if __name__ == "__main__":
    main()
