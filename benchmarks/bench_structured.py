"""Constrained decoding's cost: decode tokens/s with a JSON schema against unconstrained, at batch 1 and 32,
and grammar compile time (first and cached), on the embedded SmolLM2-135M in one Engine.

Both sides generate the same number of tokens: the unconstrained rows ignore EOS, and the schema (an array
of at least 64 small objects) cannot finish before `--new-tokens`, so every row ends by length. Rounds
alternate the two sides; the table shows medians. A figure of the mask's cost per token, not of a workload.

    python benchmarks/bench_structured.py                 # docs/benchmarks.md section + docs/bench_structured.png
    python benchmarks/bench_structured.py --no-docs --rounds 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "benchmarks.md"
PLOT = ROOT / "docs" / "bench_structured.png"
BEGIN, END = "<!-- bench_structured:begin -->", "<!-- bench_structured:end -->"
SCHEMA = {"type": "array", "minItems": 64, "items": {
    "type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0,
                                                                        "maximum": 120},
                   "city": {"enum": ["Paris", "Rome", "Oslo", "Lima"]}}}}
PROMPT = "List people as JSON objects with a name, an age and a city. " * 8


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-docs", action="store_true")
    return p.parse_args(argv)


def run(engine, batch: int, constrained: bool, new_tokens: int) -> float:
    """Output tokens/s of `batch` rows generating `new_tokens` each (prefill included, the same on both sides)."""
    params = {"max_new_tokens": new_tokens, "temperature": 0.8, "ignore_eos": True}
    if constrained:
        params["json_schema"] = json.dumps(SCHEMA)
    start = time.perf_counter()
    outs = engine.generate([PROMPT + f" #{i}" for i in range(batch)], sampling_params=[params] * batch)
    elapsed = time.perf_counter() - start
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    if constrained and any(o["meta_info"]["finish_reason"]["type"] != "length" for o in outs):
        raise SystemExit("a constrained row finished before --new-tokens: lengthen the schema")
    return tokens / elapsed


def compile_times(engine) -> tuple[float, float]:
    from radixserve.constrained.grammar_backend import GrammarSpec

    backend = engine.scheduler.grammars.backend
    spec = GrammarSpec("json_schema", json.dumps({**SCHEMA, "minItems": 63}))  # NOTE: a text not compiled yet
    start = time.perf_counter()
    backend.submit(spec).result()
    first = time.perf_counter() - start
    start = time.perf_counter()
    backend.submit(spec).result()
    return first, time.perf_counter() - start


def main() -> None:
    args = parse_args()
    import torch

    from radixserve import Engine

    engine = Engine(dtype=args.dtype, log_level="warning")
    try:
        first, cached = compile_times(engine)
        run(engine, 2, True, 8)  # NOTE: warm-up of both paths
        run(engine, 2, False, 8)
        speeds: dict[tuple[int, bool], list[float]] = {}
        for round_ in range(args.rounds):
            for batch in (1, 32):
                for constrained in ((False, True) if round_ % 2 == 0 else (True, False)):
                    speeds.setdefault((batch, constrained), []).append(run(engine, batch, constrained, args.new_tokens))
                    print(f"round {round_} batch {batch} {'json_schema' if constrained else 'free'}: "
                          f"{speeds[(batch, constrained)][-1]:.1f} tok/s", file=sys.stderr, flush=True)
        dtype = engine.model_runner.dtype_choice.dtype
    finally:
        engine.shutdown()
    medians = {key: statistics.median(values) for key, values in speeds.items()}
    section = render(args, medians, speeds, first, cached, dtype, torch.__version__)
    print(section)
    if not args.no_docs:
        from radixserve.bench.docs import write_doc_section

        write_doc_section(DOCS, BEGIN, END, section)
        plot(medians)


def render(args, medians, speeds, first: float, cached: float, dtype: str, torch_version: str) -> str:
    import platform

    from radixserve.bench.docs import cpu_header

    lines = ["## Structured outputs: decode with a JSON schema vs unconstrained (`benchmarks/bench_structured.py`)", "",
             f"{cpu_header(dtype)}; Python {platform.python_version()}, torch {torch_version}, xgrammar 0.2.8. "
             f"One Engine, embedded SmolLM2-135M, {args.new_tokens} new tokens per row (temperature 0.8), "
             f"{args.rounds} rounds alternating the sides; medians. Command: `python benchmarks/bench_structured.py"
             f" --rounds {args.rounds} --new-tokens {args.new_tokens}`.", "",
             "| batch | unconstrained tok/s | json_schema tok/s | json_schema / unconstrained | target |",
             "|---:|---:|---:|---:|---|"]
    for batch in (1, 32):
        free, schema = medians[(batch, False)], medians[(batch, True)]
        target = "at most 10% slower: " + ("met" if schema >= 0.9 * free else "MISSED") if batch == 32 else "-"
        lines.append(f"| {batch} | {free:.1f} | {schema:.1f} | {schema / free:.2f} | {target} |")
    lines += ["", f"Grammar compile time of the schema: {first * 1000:.0f} ms the first time, "
              f"{cached * 1000:.2f} ms cached (the same text again).", "",
              f"![structured outputs]({PLOT.name})"]
    return "\n".join(lines)


def plot(medians) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3))
    xs = range(2)
    free = [medians[(b, False)] for b in (1, 32)]
    schema = [medians[(b, True)] for b in (1, 32)]
    ax.bar([x - 0.2 for x in xs], free, 0.4, label="unconstrained")
    ax.bar([x + 0.2 for x in xs], schema, 0.4, label="json_schema")
    ax.set_xticks(list(xs), ["batch 1", "batch 32"])
    ax.set_ylabel("output tokens/s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(PLOT, dpi=110)


if __name__ == "__main__":
    main()
