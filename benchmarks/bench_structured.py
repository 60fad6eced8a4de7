"""Constrained decoding's cost: decode tokens/s with a JSON schema against unconstrained, at batch 1 and 32,
with jump-forward off (the mask's cost per token) and on (what a schema's fixed text saves), on a schema of
short keys and one of long keys; the share of tokens jump-forward wrote; grammar compile time (first and
cached); on the embedded SmolLM2-135M in one Engine.

Every side generates the same number of tokens: the unconstrained rows ignore EOS, and each schema (an array
of at least 64 objects) cannot finish before `--new-tokens`, so every row ends by length. Rounds rotate the
sides; the table shows medians.

    python benchmarks/bench_structured.py                 # docs/benchmarks.md section + docs/bench_structured.png
    python benchmarks/bench_structured.py --no-docs --rounds 1
    python benchmarks/bench_structured.py --jump-sweep    # how jump-forward's tokens get their KV, by batch size

The jump sweep runs json_schema with jump-forward at batch 1-32 three ways: every jump by one extend, every
jump fed through decode steps, and the engine's choice (`jump_forward.extends`), each against jump-forward off.
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
SWEEP_BEGIN, SWEEP_END = "<!-- bench_structured_jump:begin -->", "<!-- bench_structured_jump:end -->"
SWEEP_BATCHES = (1, 2, 4, 8, 16, 32)
SWEEP_WAYS = {"extend": (1, 10**6), "fed": (10**6, 0), "chosen": None}  # (EXTEND_ALWAYS_TOKENS, EXTEND_MAX_BATCH)
SCHEMA = {"type": "array", "minItems": 64, "items": {
    "type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0,
                                                                        "maximum": 120},
                   "city": {"enum": ["Paris", "Rome", "Oslo", "Lima"]}}}}
LONG_KEYS = {**SCHEMA, "items": {**SCHEMA["items"], "required": ["customer_full_name_as_on_the_invoice",
                                                                   "customer_age_in_completed_years",
                                                                   "customer_billing_city_name"],
                                  "properties": {"customer_full_name_as_on_the_invoice": {"type": "string",
                                                                                          "maxLength": 12},
                                                 "customer_age_in_completed_years": {"type": "integer",
                                                                                     "minimum": 0, "maximum": 120},
                                                 "customer_billing_city_name": {"enum": ["Paris", "Rome", "Oslo",
                                                                                         "Lima"]}}}}
SCHEMAS = {"short keys": SCHEMA, "long keys": LONG_KEYS}
MODES = ("free", "schema", "schema+jump")  # unconstrained; json_schema, jump-forward off; and on
PROMPT = "List people as JSON objects with a name, an age and a city. " * 8


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-docs", action="store_true")
    p.add_argument("--jump-sweep", action="store_true", help="extend vs fed jump-forward by batch size instead")
    return p.parse_args(argv)


def run(engine, batch: int, mode: str, schema: dict, new_tokens: int) -> tuple[float, float]:
    """Output tokens/s of `batch` rows generating `new_tokens` each (prefill included, the same on every side),
    and the share of them jump-forward wrote."""
    params = {"max_new_tokens": new_tokens, "temperature": 0.8, "ignore_eos": True}
    if mode != "free":
        params["json_schema"] = json.dumps(schema)
    jump, stats = engine.scheduler.output.jump_forward, engine.scheduler.stats
    jump.enabled, jumped = mode == "schema+jump", stats.jump_forward_tokens
    start = time.perf_counter()
    outs = engine.generate([PROMPT + f" #{i}" for i in range(batch)], sampling_params=[params] * batch)
    elapsed = time.perf_counter() - start
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    if mode != "free" and any(o["meta_info"]["finish_reason"]["type"] != "length" for o in outs):
        raise SystemExit("a constrained row finished before --new-tokens: lengthen the schema")
    return tokens / elapsed, (stats.jump_forward_tokens - jumped) / tokens


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
    if args.jump_sweep:
        try:
            section = jump_sweep(engine, args)
        finally:
            engine.shutdown()
        print(section)
        if not args.no_docs:
            from radixserve.bench.docs import write_doc_section

            write_doc_section(DOCS, SWEEP_BEGIN, SWEEP_END, section)
        return
    try:
        first, cached = compile_times(engine)
        for mode in MODES:  # NOTE: warm-up of every path
            run(engine, 2, mode, SCHEMA, 8)
        speeds: dict[tuple[str, int, str], list[float]] = {}
        shares: dict[tuple[str, int, str], list[float]] = {}
        cases = [(name, batch) for name in SCHEMAS for batch in (1, 32)]
        for round_ in range(args.rounds):
            for name, batch in cases:
                for mode in MODES[round_ % 3:] + MODES[:round_ % 3]:
                    speed, share = run(engine, batch, mode, SCHEMAS[name], args.new_tokens)
                    speeds.setdefault((name, batch, mode), []).append(speed)
                    shares.setdefault((name, batch, mode), []).append(share)
                    print(f"round {round_} {name} batch {batch} {mode}: {speed:.1f} tok/s, {share:.0%} jumped",
                          file=sys.stderr, flush=True)
        dtype = engine.model_runner.dtype_choice.dtype
    finally:
        engine.shutdown()
    medians = {key: statistics.median(values) for key, values in speeds.items()}
    share = {key: statistics.median(values) for key, values in shares.items()}
    section = render(args, medians, share, first, cached, dtype, torch.__version__)
    print(section)
    if not args.no_docs:
        from radixserve.bench.docs import write_doc_section

        write_doc_section(DOCS, BEGIN, END, section)
        plot(medians)


def jump_sweep(engine, args) -> str:
    """json_schema tok/s with jump-forward extended, fed, and as the engine chooses, over jump-forward off."""
    import platform

    import torch

    import radixserve.constrained.jump_forward as jump_forward
    from radixserve.bench.docs import cpu_header

    chosen = (jump_forward.EXTEND_ALWAYS_TOKENS, jump_forward.EXTEND_MAX_BATCH)
    for mode in MODES[1:]:
        run(engine, 2, mode, SCHEMA, 8)
    speeds: dict[tuple[str, int, str], list[float]] = {}
    try:
        for round_ in range(args.rounds):
            for name in SCHEMAS:
                for batch in SWEEP_BATCHES:
                    for way in ("off", *SWEEP_WAYS):
                        limits = SWEEP_WAYS.get(way) or chosen
                        jump_forward.EXTEND_ALWAYS_TOKENS, jump_forward.EXTEND_MAX_BATCH = limits
                        mode = "schema" if way == "off" else "schema+jump"
                        speed, _ = run(engine, batch, mode, SCHEMAS[name], args.new_tokens)
                        speeds.setdefault((name, batch, way), []).append(speed)
                        print(f"round {round_} {name} batch {batch} {way}: {speed:.1f} tok/s", file=sys.stderr,
                              flush=True)
    finally:
        jump_forward.EXTEND_ALWAYS_TOKENS, jump_forward.EXTEND_MAX_BATCH = chosen
    med = {key: statistics.median(values) for key, values in speeds.items()}
    lines = ["## Jump-forward: one extend or fed through decode steps, by batch size "
             "(`benchmarks/bench_structured.py --jump-sweep`)", "",
             f"{cpu_header(engine.model_runner.dtype_choice.dtype)}; Python {platform.python_version()}, torch "
             f"{torch.__version__}, xgrammar 0.2.8. The schemas of the section above, temperature 0.8, "
             f"{args.new_tokens} tokens a row, {args.rounds} rounds; medians. Each cell: json_schema tok/s with "
             f"jump-forward over the same with it off. Chosen: `jump_forward.extends` (one extend for "
             f"{chosen[0]}+ forced tokens or a batch of at most {chosen[1]}, else fed). Command: "
             f"`python benchmarks/bench_structured.py --jump-sweep --rounds {args.rounds}`.", "",
             "| schema | batch | off tok/s | every jump extended | every jump fed | chosen |",
             "|---|---:|---:|---:|---:|---:|"]
    for name in SCHEMAS:
        for batch in SWEEP_BATCHES:
            off = med[(name, batch, "off")]
            cells = " | ".join(f"{med[(name, batch, way)] / off:.2f}" for way in SWEEP_WAYS)
            lines.append(f"| {name} | {batch} | {off:.1f} | {cells} |")
    return "\n".join(lines)


def render(args, medians, share, first: float, cached: float, dtype: str, torch_version: str) -> str:
    import platform

    from radixserve.bench.docs import cpu_header

    lines = ["## Structured outputs: decode with a JSON schema vs unconstrained (`benchmarks/bench_structured.py`)", "",
             f"{cpu_header(dtype)}; Python {platform.python_version()}, torch {torch_version}, xgrammar 0.2.8. "
             f"One Engine, embedded SmolLM2-135M, {args.new_tokens} new tokens per row (temperature 0.8), "
             f"{args.rounds} rounds rotating the sides; medians. Short keys: `name`, `age`, `city`; long keys: "
             f"`customer_full_name_as_on_the_invoice`, `customer_age_in_completed_years`, "
             f"`customer_billing_city_name`. Command: `python benchmarks/bench_structured.py --rounds "
             f"{args.rounds} --new-tokens {args.new_tokens}`.", "",
             "| schema | batch | unconstrained tok/s | json_schema, jump-forward off | / unconstrained | "
             "json_schema, jump-forward on | / unconstrained | tokens jump-forward wrote | on / off |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name in SCHEMAS:
        for batch in (1, 32):
            free, off, on = (medians[(name, batch, m)] for m in MODES)
            lines.append(f"| {name} | {batch} | {free:.1f} | {off:.1f} | {off / free:.2f} | {on:.1f} | {on / free:.2f} "
                         f"| {share[(name, batch, 'schema+jump')]:.0%} | {on / off:.2f}x |")
    free, off, on = (medians[("short keys", 32, m)] for m in MODES)
    lines += ["", f"Target (batch 32, at most 10% slower than unconstrained): {off / free:.2f} with jump-forward off "
              f"({'met' if off >= 0.9 * free else 'MISSED'}), {on / free:.2f} on "
              f"({'met' if on >= 0.9 * free else 'MISSED'}), short keys.", "",
              f"Grammar compile time of the schema: {first * 1000:.0f} ms the first time, "
              f"{cached * 1000:.2f} ms cached (the same text again).", "",
              f"![structured outputs]({PLOT.name})"]
    return "\n".join(lines)


def plot(medians) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2))
    cases = [(name, batch) for name in SCHEMAS for batch in (1, 32)]
    for i, mode in enumerate(MODES):
        ax.bar([x + (i - 1) * 0.27 for x in range(len(cases))], [medians[(n, b, mode)] for n, b in cases], 0.27,
               label={"free": "unconstrained", "schema": "json_schema", "schema+jump": "json_schema + jump-forward"}[mode])
    ax.set_xticks(range(len(cases)), [f"{n}, batch {b}" for n, b in cases])
    ax.set_ylabel("output tokens/s")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(PLOT, dpi=110)


if __name__ == "__main__":
    main()
