"""What --enable-deterministic-inference costs: W1-W3 and decode at batch 1 and 32, the mode off and on side by
side, at each CPU class this machine can be forced to.

Each class runs in a subprocess of its own with the class's environment (RADIXSERVE_CPU_ISA and torch's ISA
switches, radixserve.bench.docs.class_env); in it, for each repeat, a fresh Engine per mode, modes alternating
(off, on, off, on, ...), the median kept. Decode speed: 32 short unique prompts (100 tokens), `--decode-tokens`
new tokens each, alone (batch 1) and all at once (batch 32); tokens/s over the decode part (after the first token).

    python benchmarks/bench_deterministic.py                        # every runnable class, --dtype auto and float32
    python benchmarks/bench_deterministic.py --classes avx2 --dtypes float32 --scale 0.5 --output ''
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

MARK = ("<!-- bench_deterministic:start -->", "<!-- bench_deterministic:end -->")
MODES = ("off", "on")


def decode_rate(engine, prompts, new_tokens: int) -> float:
    """Decode tokens/s of `prompts` run at once (after each one's first token)."""
    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        outs = list(pool.map(lambda p: engine.submit(list(p.input_ids), params).result(), prompts))
    wall = time.perf_counter() - start
    first = max(o["meta_info"]["ttft"] for o in outs)
    return sum(o["meta_info"]["completion_tokens"] - 1 for o in outs) / max(wall - first, 1e-9)


def worker(args: argparse.Namespace) -> dict:
    from radixserve import Engine
    from radixserve.bench.runner import EngineBackend, run_workload
    from radixserve.bench.workloads import build_probes, build_workloads
    from radixserve.model_executor.deterministic import DeterminismUnavailable

    figures: dict[str, dict[str, list[float]]] = {}
    for _ in range(args.repeats):
        for mode in MODES:
            try:
                engine = Engine(dtype=args.dtype, log_level="warning", enable_deterministic_inference=mode == "on")
            except DeterminismUnavailable as refused:  # NOTE: the mode's own refusal is the figure of this class
                return {"refused": str(refused)}
            try:
                engine.generate(input_ids=list(range(1000, 1064)), sampling_params={"max_new_tokens": 4})
                workloads = build_workloads(engine.tokenizer, ["w1", "w2", "w3"], args.scale)
                probes = build_probes(engine.tokenizer)
                for wl in workloads:
                    engine.flush_cache()
                    result = run_workload(EngineBackend(engine, mode), wl)
                    figures.setdefault(f"{wl.name} wall s", {}).setdefault(mode, []).append(result.wall_s)
                    print(f"[{args.cpu_class} {args.dtype} {mode}] {wl.name} {result.wall_s:.2f} s", flush=True)
                for batch in (1, 32):
                    engine.flush_cache()
                    rate = decode_rate(engine, probes.decode[:batch], args.decode_tokens)
                    figures.setdefault(f"decode bs {batch} tok/s", {}).setdefault(mode, []).append(rate)
                    print(f"[{args.cpu_class} {args.dtype} {mode}] decode bs {batch} {rate:.1f} tok/s", flush=True)
            finally:
                engine.shutdown()
    return {name: {mode: statistics.median(v) for mode, v in per.items()} for name, per in figures.items()}


def table(cpu_class: str, dtype: str, figures: dict) -> str:
    if "refused" in figures:
        return f"{cpu_class}, --dtype {dtype}: the mode does not start here: {figures['refused']}"
    lines = [f"| {cpu_class}, --dtype {dtype} | off | on | cost (on vs off) |", "|---|---:|---:|---:|"]
    for name, per in figures.items():
        off, on = per["off"], per["on"]
        cost = on / off if name.endswith("wall s") else off / on  # NOTE: >1 means the mode is slower
        lines.append(f"| {name} | {off:.2f} | {on:.2f} | {cost:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--classes", default="", help="comma-separated CPU classes (default: every runnable one)")
    parser.add_argument("--dtypes", default="auto,float32")
    parser.add_argument("--scale", type=float, default=0.5, help="W1-W3 lengths and counts scaled by this")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--output", default="docs/benchmarks.md", help="markdown file to update; '' to skip")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cpu-class", default="", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="auto", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return
    from radixserve.bench.docs import class_env, cpu_header, runnable_classes, write_doc_section

    classes = [c for c in args.classes.split(",") if c] or [c for c in runnable_classes() if c != "amx"]
    sections = [cpu_header(), f"`python benchmarks/bench_deterministic.py --classes {','.join(classes)} --dtypes "
                f"{args.dtypes} --scale {args.scale} --decode-tokens {args.decode_tokens} --repeats {args.repeats}`"]
    for cpu_class in classes:
        for dtype in args.dtypes.split(","):
            cmd = [sys.executable, __file__, "--worker", "--cpu-class", cpu_class, "--dtype", dtype,
                   "--scale", str(args.scale), "--decode-tokens", str(args.decode_tokens),
                   "--repeats", str(args.repeats)]
            env = os.environ | class_env(cpu_class)
            result = None
            # NOTE: the worker's lines pass through as they come: each workload's time is the progress
            with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True) as proc:
                for line in proc.stdout:
                    if line.startswith("RESULT "):
                        result = line[7:]
                    else:
                        sys.stdout.write(line)
                        sys.stdout.flush()
            if proc.returncode or result is None:
                raise SystemExit(f"{cpu_class} {dtype}: the worker failed ({proc.returncode})")
            sections.append(table(cpu_class, dtype, json.loads(result)))
            print(sections[-1], flush=True)
    if args.output:
        write_doc_section(args.output, *MARK, "\n\n".join(sections))


if __name__ == "__main__":
    main()
