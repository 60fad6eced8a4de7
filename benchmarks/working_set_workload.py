"""The agent-session workload of benchmarks/bench_hicache_working_set.py, and its HTTP client.

A session is a tool loop on the embedded model's chat format, as token ids (so every engine computes the same
tokens whatever its tokenizer does with text):

- a system prompt shared by every session (`shared` tokens);
- the session's own tool definitions and task (the rest of its head: most of its tokens are its own);
- turns: each turn's prompt is the previous turn's prompt + the previous answer (`answer` tokens) + a tool result
  of `growth` fresh tokens.

The answers in the history are the client's record of them: fixed ids of the generated length, not the engine's
own output (which is discarded), so every engine and every configuration computes exactly the same prompts, and
the next turn's match ends where the previous answer began (as when a client re-renders an answer's text). Turn
k's prompt starts with turn k - 1's whole prompt; the session's last context is `session_tokens` long. The client
streams one completion per turn and measures TTFT (sent to first streamed token) itself.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass

import httpx

WORDS = ("file", "path", "line", "error", "test", "module", "branch", "commit", "diff", "patch", "build", "cache",
         "token", "queue", "batch", "worker", "socket", "buffer", "config", "schema", "query", "index", "table",
         "thread", "result", "status", "request", "handler", "parser", "report", "metric", "trace", "kernel")


@dataclass(frozen=True)
class Shape:
    """How big each part of a session is, in tokens."""

    sessions: int
    session_tokens: int  # the last turn's context: prompt + answer
    turns: int
    shared: int  # the system prompt every session shares
    answer: int  # generated tokens per turn
    growth: int  # tool-result tokens appended per turn

    @property
    def head(self) -> int:
        """Tokens of turn 0's prompt (shared system prompt + the session's own tools and task)."""
        return self.session_tokens - self.turns * self.answer - (self.turns - 1) * self.growth

    def check(self) -> None:
        if self.sessions < 1 or self.turns < 1 or self.answer < 1:
            raise SystemExit("--sessions, --turns and --answer-tokens must be >= 1")
        if self.head < self.shared + 32:
            raise SystemExit(f"a session of {self.session_tokens} tokens has no room for its head: "
                             f"{self.turns} turns x ({self.answer} + {self.growth}) tokens past {self.shared} shared")


def make_shape(sessions: int, session_tokens: int, turns: int, shared_fraction: float, loop_fraction: float,
               answer: int) -> Shape:
    """The tool loop takes `loop_fraction` of a session's tokens, the shared system prompt `shared_fraction`."""
    loop = round(session_tokens * loop_fraction)
    growth = max(0, (loop - turns * answer) // max(turns - 1, 1)) if turns > 1 else 0
    return Shape(sessions, session_tokens, turns, round(session_tokens * shared_fraction), answer, growth)


class Pieces:
    """Token ids of chat-format text, cut to exact lengths (random words from a seeded generator)."""

    def __init__(self, tokenizer, seed: int) -> None:
        self.tokenizer = tokenizer
        self.rng = random.Random(seed)

    def ids(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def filler(self, prefix: str, tokens: int, suffix: str = "") -> list[int]:
        """`prefix`, random words, `suffix`: exactly `tokens` ids (`suffix` kept whole at the end)."""
        head, tail = self.ids(prefix), self.ids(suffix)
        body: list[int] = []
        while len(head) + len(body) + len(tail) < tokens:
            body += self.ids(" " + " ".join(self.rng.choice(WORDS) + str(self.rng.randrange(100)) for _ in range(64)))
        out = (head + body)[: max(tokens - len(tail), 0)] + tail
        return out[:tokens]


@dataclass
class Session:
    """One agent's turns: turn k's prompt is `head` + (answer, tool result) for each earlier turn."""

    index: int
    head: list[int]
    steps: list[list[int]]  # before turn k (k >= 1): the answer of turn k - 1 as replayed, then a tool result
    session_id: str | None = None

    def prompt(self, turn: int) -> list[int]:
        return self.head + [t for step in self.steps[:turn] for t in step]


def build_sessions(tokenizer, shape: Shape, seed: int = 0) -> list[Session]:
    """Every session's prompts, as token ids (seeded: the same for every engine and configuration)."""
    shape.check()
    system = Pieces(tokenizer, seed).filler("<|im_start|>system\nYou are a coding agent. Rules:", shape.shared)
    sessions = []
    for s in range(shape.sessions):
        p = Pieces(tokenizer, seed * 100_003 + s + 1)
        own = p.filler(f"\nTools of workspace {s}: ", shape.head - shape.shared - 24,
                       "<|im_end|>\n<|im_start|>user\nFix the failing test.<|im_end|>\n")
        task = p.filler("<|im_start|>assistant\n", 24)
        steps = [p.filler("<tool_call>", shape.answer) + p.filler("<|im_end|>\n<|im_start|>tool\n", shape.growth,
                                                                  "<|im_end|>\n<|im_start|>assistant\n")
                 for _ in range(shape.turns - 1)]
        sessions.append(Session(s, system + own + task, steps))
    return sessions


@dataclass(frozen=True)
class TurnResult:
    session: int
    turn: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # what the engine's usage says (0 where it does not say)
    details: dict  # the usage's whole prompt_tokens_details (per-tier counts where the engine gives them)
    ttft_s: float
    e2e_s: float


def run_turn(client: httpx.Client, model: str, session: Session, turn: int, answer_tokens: int) -> TurnResult:
    """One streamed greedy completion of the session's turn `turn`."""
    prompt = session.prompt(turn)
    body = {"model": model, "prompt": prompt, "max_tokens": answer_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    if session.session_id is not None:
        body["session_id"] = session.session_id
    sent, first, usage = time.perf_counter(), None, None
    with client.stream("POST", "/v1/completions", json=body, timeout=3600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"session {session.index} turn {turn}: HTTP {r.status_code}: {r.read()[:300]!r}")
        for raw in r.iter_lines():
            if not raw.startswith("data: {"):
                continue
            chunk = json.loads(raw[6:])
            if chunk.get("choices") and first is None:
                first = time.perf_counter()
            usage = chunk.get("usage") or usage
    end = time.perf_counter()
    if usage is None:
        raise RuntimeError(f"session {session.index} turn {turn}: no usage chunk")
    if usage["prompt_tokens"] != len(prompt) or usage["completion_tokens"] != answer_tokens:
        raise RuntimeError(f"session {session.index} turn {turn}: usage {usage} for {len(prompt)} prompt ids")
    details = usage.get("prompt_tokens_details") or {}
    return TurnResult(session.index, turn, usage["prompt_tokens"], usage["completion_tokens"],
                      int(details.get("cached_tokens") or 0), details, (first or end) - sent, end - sent)

