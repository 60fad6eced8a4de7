"""The benchmark workloads, as token ids and the text they decode to (deterministic for a seed).

Prompts are random sequences of whole-word tokens (" the", " river", ...), so the text form
re-tokenizes to (nearly) the same ids on a server that only accepts text.

- W1 shared prefix: 32 requests = one 1,000-token prefix + a unique 40-token question; 32 new tokens.
- W2 no sharing: 32 unique 500-token prompts; 32 new tokens.
- W3 multi-turn: 8 conversations of 4 turns; turn k+1 = turn k's prompt + its answer + ~100 new
  tokens, sent when turn k is done; 32 new tokens.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

_WORD = re.compile(r"^ [a-z]{3,9}$")


@dataclass(frozen=True)
class Prompt:
    input_ids: tuple[int, ...]
    text: str

    def __add__(self, other: Prompt) -> Prompt:
        return Prompt(self.input_ids + other.input_ids, self.text + other.text)

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass(frozen=True)
class Conversation:
    """`turns[0]` is the first prompt; `turns[k]` is what the user adds after the k-th answer."""

    turns: tuple[Prompt, ...]


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    max_new_tokens: int
    prompts: tuple[Prompt, ...] = ()  # independent requests, all sent at once
    conversations: tuple[Conversation, ...] = ()  # sequential turns, conversations in parallel

    @property
    def num_requests(self) -> int:
        return len(self.prompts) + sum(len(c.turns) for c in self.conversations)


def next_turn(previous: Prompt, answer_ids: list[int], answer_text: str, addition: Prompt) -> Prompt:
    """The prompt of the next turn: the previous prompt, the answer it got, and the user's addition."""
    return Prompt(previous.input_ids + tuple(answer_ids) + addition.input_ids,
                  previous.text + answer_text + addition.text)


class PromptFactory:
    """Random whole-word token sequences from a tokenizer's vocabulary."""

    def __init__(self, tokenizer: Any, seed: int) -> None:
        self.tokenizer = tokenizer
        self.rng = random.Random(seed)
        self.word_ids = word_token_ids(tokenizer)

    def make(self, num_tokens: int) -> Prompt:
        ids = tuple(self.rng.choice(self.word_ids) for _ in range(num_tokens))
        return Prompt(ids, self.tokenizer.decode(list(ids)))


def word_token_ids(tokenizer: Any, limit: int = 4000) -> list[int]:
    """Ids of tokens that are one lowercase word with a leading space, e.g. " river"."""
    vocab = tokenizer.get_vocab()
    ids = sorted(i for i in vocab.values() if _WORD.match(tokenizer.decode([i])))
    if len(ids) < 100:
        raise ValueError(f"only {len(ids)} whole-word tokens in this vocabulary; cannot build prompts")
    return ids[:limit]


def build_w1(tokenizer: Any, num_requests: int = 32, prefix_len: int = 1000, question_len: int = 40,
             max_new_tokens: int = 32, seed: int = 1) -> Workload:
    make = PromptFactory(tokenizer, seed).make
    prefix = make(prefix_len)
    prompts = tuple(prefix + make(question_len) for _ in range(num_requests))
    return Workload("W1", f"shared prefix: {num_requests} x ({prefix_len} shared + {question_len} unique) tokens",
                    max_new_tokens, prompts=prompts)


def build_w2(tokenizer: Any, num_requests: int = 32, prompt_len: int = 500, max_new_tokens: int = 32,
             seed: int = 2) -> Workload:
    make = PromptFactory(tokenizer, seed).make
    prompts = tuple(make(prompt_len) for _ in range(num_requests))
    return Workload("W2", f"no sharing: {num_requests} unique {prompt_len}-token prompts", max_new_tokens,
                    prompts=prompts)


def build_w3(tokenizer: Any, num_conversations: int = 8, num_turns: int = 4, turn_len: int = 100,
             max_new_tokens: int = 32, seed: int = 3) -> Workload:
    make = PromptFactory(tokenizer, seed).make
    conversations = tuple(Conversation(tuple(make(turn_len) for _ in range(num_turns)))
                          for _ in range(num_conversations))
    return Workload("W3", f"multi-turn: {num_conversations} conversations x {num_turns} turns, "
                          f"+{turn_len} tokens per turn", max_new_tokens, conversations=conversations)


BUILDERS = {"w1": build_w1, "w2": build_w2, "w3": build_w3}


def build_workloads(tokenizer: Any, names: list[str] | tuple[str, ...] = ("w1", "w2", "w3"),
                    scale: float = 1.0) -> list[Workload]:
    """The named workloads; `scale` < 1 shrinks every length and count (for smoke tests)."""
    out = []
    for name in names:
        builder = BUILDERS[name.lower()]
        if scale == 1.0:
            out.append(builder(tokenizer))
            continue
        shrink = lambda n: max(2, round(n * scale))  # noqa: E731
        if builder is build_w1:
            out.append(build_w1(tokenizer, shrink(32), shrink(1000), shrink(40), shrink(32)))
        elif builder is build_w2:
            out.append(build_w2(tokenizer, shrink(32), shrink(500), shrink(32)))
        else:
            out.append(build_w3(tokenizer, shrink(8), 4, shrink(100), shrink(32)))
    return out


@dataclass(frozen=True)
class Probes:
    """Single-purpose probes of the peer benchmark (benchmarks/bench_peers.py), beside W1/W2/W3."""

    cold: Prompt  # a prompt sharing nothing with anything cached: cold prefill speed
    warm: tuple[Prompt, Prompt]  # two prompts sharing a long prefix: the second one's TTFT is a cache hit
    decode: tuple[Prompt, ...]  # short unique prompts for decode speed (alone: batch 1; all: batch N)


def build_probes(tokenizer: Any, cold_len: int = 1024, prefix_len: int = 1000, question_len: int = 40,
                 decode_prompts: int = 32, decode_prompt_len: int = 100, seed: int = 4) -> Probes:
    make = PromptFactory(tokenizer, seed).make
    cold = make(cold_len)
    prefix = make(prefix_len)
    warm = (prefix + make(question_len), prefix + make(question_len))
    return Probes(cold, warm, tuple(make(decode_prompt_len) for _ in range(decode_prompts)))
