"""Replaying a workload through a backend, and the figures of one run.

A backend is anything with `name`, `generate(prompt, max_new_tokens) -> RequestRecord` (blocking,
called from many threads at once, greedy with ignore_eos so every request makes exactly
`max_new_tokens` tokens), `flush_cache()` and `counters() -> dict | None` (server-side counters such
as `prefill_tokens_computed`, or None). `EngineBackend` drives the in-process Engine.
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from radixserve.bench.workloads import Conversation, Prompt, Workload, next_turn


@dataclass
class RequestRecord:
    ttft: float
    e2e: float
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    output_ids: list[int] = field(default_factory=list)
    text: str = ""


class Backend(Protocol):
    name: str

    def generate(self, prompt: Prompt, max_new_tokens: int) -> RequestRecord: ...

    def flush_cache(self) -> None: ...

    def counters(self) -> dict[str, Any] | None: ...


class EngineBackend:
    """The in-process Engine: token ids in, meta_info out."""

    def __init__(self, engine: Any, name: str) -> None:
        self.engine = engine
        self.name = name

    def generate(self, prompt: Prompt, max_new_tokens: int) -> RequestRecord:
        params = {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}
        out = self.engine.submit(list(prompt.input_ids), params).result()
        meta = out["meta_info"]
        return RequestRecord(meta["ttft"] or meta["e2e_latency"], meta["e2e_latency"], meta["prompt_tokens"],
                             meta["completion_tokens"], meta["cached_tokens"], out["output_ids"], out["text"])

    def flush_cache(self) -> None:
        result = self.engine.flush_cache()
        if not result["success"]:
            raise RuntimeError(f"flush_cache refused: {result['message']}")

    def counters(self) -> dict[str, Any]:
        return self.engine.get_internal_state()


@dataclass
class WorkloadResult:
    workload: str
    backend: str
    wall_s: float
    records: list[RequestRecord]
    prefill_computed: int  # server counter when available, else Σ(prompt - cached)
    forward_s: float | None = None  # time in model forwards, when the backend reports it
    cache_ops_s: float | None = None  # time in radix-cache work (match, lock, insert, release, evict)
    prefill_batches: int | None = None  # forward batches of each kind, when the backend reports them (roofline.py)
    decode_batches: int | None = None

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_tokens for r in self.records)

    @property
    def cached_tokens(self) -> int:
        return sum(r.cached_tokens for r in self.records)

    @property
    def completion_tokens(self) -> int:
        return sum(r.completion_tokens for r in self.records)

    @property
    def ttfts(self) -> list[float]:
        return [r.ttft for r in self.records]

    def summary(self) -> dict[str, float]:
        ttfts = sorted(self.ttfts)
        return {
            "wall_s": self.wall_s,
            "output_tok_s": self.completion_tokens / self.wall_s,
            "total_tok_s": (self.prompt_tokens + self.completion_tokens) / self.wall_s,
            "ttft_mean_s": statistics.fmean(ttfts),
            "ttft_p50_s": _percentile(ttfts, 50),
            "ttft_p90_s": _percentile(ttfts, 90),
            "hit_rate": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            "prefill_computed": self.prefill_computed,
            "requests": len(self.records),
        }


def _percentile(sorted_values: list[float], pct: float) -> float:
    if not sorted_values:
        return float("nan")
    k = (len(sorted_values) - 1) * pct / 100
    lo, hi = int(k), min(int(k) + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


def run_workload(backend: Backend, workload: Workload) -> WorkloadResult:
    """Send the workload (all independent prompts at once; conversations in parallel, turns in order)."""
    before = backend.counters()
    start = time.perf_counter()
    if workload.prompts:
        with ThreadPoolExecutor(max_workers=len(workload.prompts)) as pool:
            records = list(pool.map(lambda p: backend.generate(p, workload.max_new_tokens), workload.prompts))
    else:
        with ThreadPoolExecutor(max_workers=len(workload.conversations)) as pool:
            per_conv = list(pool.map(lambda c: _run_conversation(backend, c, workload.max_new_tokens),
                                     workload.conversations))
        records = [r for conv in per_conv for r in conv]
    wall = time.perf_counter() - start
    after = backend.counters()
    computed = sum(r.prompt_tokens - r.cached_tokens for r in records)
    forward_s = cache_ops_s = prefill_batches = decode_batches = None
    if before is not None and after is not None and "prefill_tokens_computed" in after:
        computed = after["prefill_tokens_computed"] - before["prefill_tokens_computed"]
        forward_s = after.get("forward_time_s", 0.0) - before.get("forward_time_s", 0.0)
        cache_ops_s = after.get("cache_ops_s", 0.0) - before.get("cache_ops_s", 0.0)
        if "num_decode_batches" in after:
            prefill_batches = after["num_prefill_batches"] - before["num_prefill_batches"]
            decode_batches = after["num_decode_batches"] - before["num_decode_batches"]
    return WorkloadResult(workload.name, backend.name, wall, records, computed, forward_s, cache_ops_s,
                          prefill_batches, decode_batches)


def _run_conversation(backend: Backend, conv: Conversation, max_new_tokens: int) -> list[RequestRecord]:
    records: list[RequestRecord] = []
    prompt = conv.turns[0]
    for k, addition in enumerate(conv.turns):
        if k > 0:
            last = records[-1]
            prompt = next_turn(prompt, last.output_ids, last.text, addition)
        records.append(backend.generate(prompt, max_new_tokens))
    return records
