"""Replays a peer-benchmark spec through one engine; shared by every engine's worker (stdlib only).

A spec is JSON: {"workloads": [...]}, each entry {"name", "kind", "new_tokens", ...} with token ids:

- kind "batch" (W1, W2): "prompts", all sent at once; wall time and mean TTFT.
- kind "turns" (W3): "conversations", each a list of [first prompt, addition 1, ...]; turn k of every
  conversation is sent together once turn k - 1 finished, its prompt being the previous prompt, the
  engine's own answer and the addition. Wall time summed over the turns.
- kind "cold": one prompt after the cache was emptied, one new token: prefill tokens/s.
- kind "warm": two prompts sharing a prefix, one new token each, one after the other: the second's
  time (a radix / prefix-cache hit) is the warm TTFT.
- kind "decode" (D1, D32): "prompts" sent at once with one new token, then (cache emptied) with many:
  the difference of the two walls is the decode steps alone, i.e. decode speed at the batch size
  len(prompts), taken the same way in every engine (no engine-reported TTFT needed).

An engine is two functions: generate(list of prompt ids, new_tokens) -> list of (output ids, TTFT
seconds), greedy with ignore_eos, and flush() (empty the prefix cache; called before every workload).
"""

from __future__ import annotations

import time
from collections.abc import Callable

Generate = Callable[[list[list[int]], int], list[tuple[list[int], float]]]


def replay(spec: dict, generate: Generate, flush: Callable[[], None], reps: int, engine: str) -> list[dict]:
    rows = []
    for rep in range(reps):
        for workload in spec["workloads"]:
            flush()
            runner = RUNNERS[workload["kind"]]
            row = runner(workload, generate, flush) if runner is run_decode else runner(workload, generate)
            rows.append({"engine": engine, "workload": workload["name"], "kind": workload["kind"], "rep": rep, **row})
            print("ROW", rows[-1], flush=True)
    return rows


def _timed(generate: Generate, prompts: list[list[int]], new_tokens: int) -> tuple[list[tuple[list[int], float]], float]:
    start = time.perf_counter()
    outs = generate(prompts, new_tokens)
    return outs, time.perf_counter() - start


def _check(outs: list[tuple[list[int], float]], new_tokens: int) -> None:
    short = [len(ids) for ids, _ in outs if len(ids) != new_tokens]
    if short:
        raise RuntimeError(f"an engine returned {short[:4]} tokens where {new_tokens} were asked (ignore_eos?)")


def run_batch(workload: dict, generate: Generate) -> dict:
    prompts, n = workload["prompts"], workload["new_tokens"]
    outs, wall = _timed(generate, prompts, n)
    _check(outs, n)
    return {"wall_s": wall, "prompt_tokens": sum(map(len, prompts)), "output_tokens": n * len(prompts),
            "ttft_mean_s": _mean_ttft(outs)}


def run_turns(workload: dict, generate: Generate) -> dict:
    convs, n = workload["conversations"], workload["new_tokens"]
    prompts = [c[0] for c in convs]
    outs: list[tuple[list[int], float]] = []
    wall = ttft = 0.0
    prompt_tokens = requests = 0
    for turn in range(len(convs[0])):
        if turn:
            prompts = [p + answer + c[turn] for p, (answer, _), c in zip(prompts, outs, convs, strict=True)]
        outs, seconds = _timed(generate, prompts, n)
        _check(outs, n)
        wall += seconds
        ttft += _mean_ttft(outs) * len(outs)
        prompt_tokens += sum(map(len, prompts))
        requests += len(prompts)
    return {"wall_s": wall, "prompt_tokens": prompt_tokens, "output_tokens": n * requests,
            "ttft_mean_s": ttft / requests}


def _mean_ttft(outs: list[tuple[list[int], float]]) -> float:
    """Mean engine-reported TTFT; NaN where an engine does not report it."""
    return sum(t for _, t in outs) / len(outs)


def run_cold(workload: dict, generate: Generate) -> dict:
    (prompt,) = workload["prompts"]
    _, wall = _timed(generate, [prompt], 1)
    return {"wall_s": wall, "prompt_tokens": len(prompt), "prefill_tok_s": len(prompt) / wall}


def run_warm(workload: dict, generate: Generate) -> dict:
    first, second = workload["prompts"]
    _, cold = _timed(generate, [first], 1)
    _, warm = _timed(generate, [second], 1)
    return {"wall_s": warm, "first_s": cold, "prompt_tokens": len(second)}


def run_decode(workload: dict, generate: Generate, flush: Callable[[], None]) -> dict:
    prompts, n = workload["prompts"], workload["new_tokens"]
    _, prefill = _timed(generate, prompts, 1)
    flush()
    outs, wall = _timed(generate, prompts, n)
    _check(outs, n)
    return {"wall_s": wall, "prefill_s": prefill, "batch": len(prompts), "output_tokens": n * len(prompts),
            "decode_tok_s": (n - 1) * len(prompts) / (wall - prefill)}


RUNNERS = {"batch": run_batch, "turns": run_turns, "cold": run_cold, "warm": run_warm, "decode": run_decode}
