"""Decode and prefill against this machine's roofline, per CPU class and dtype, and where a decode step's time goes.

For each CPU class (--classes: the classes this CPU can run, `native` for the CPU as it is; a forced class sets ours
and torch's switches, radixserve/bench/docs.py) and each --dtype (auto, float32), one worker process:

1. measures the roofline's rates (radixserve/bench/roofline.py: read bandwidth, GEMM rate of the compute dtype on
   the model's shapes) before anything else runs;
2. through the offline Engine (the whole serving path, default loop), measures decode at each --batches size
   (100-token prompts, --new-tokens greedy tokens; peer_replay.run_decode: the wall of n tokens less the wall of one)
   and a cold prefill of each --prefills length, --reps times (median), and the process's CPU use during decode;
3. with --trace, profiles one decode step at each batch size on the model runner alone (the direct driver: no
   scheduler), at the decode's mean context, with greedy sampling, in two paths: `after` (the default: the C decode
   step) and `python-layers` (RADIXSERVE_DECODE_STEP=0: the same kernels one by one, which tells the products from
   attention). The step period the Engine reached less the runner's own step time is the scheduler's share.

Each figure's bound is its own steps' bytes and FLOPs at the roofline; the table gives the fraction reached.

    python benchmarks/bench_roofline.py --classes native,portable --trace     # docs/benchmarks.md section
    python benchmarks/bench_roofline.py --classes native --dtypes auto --batches 8,32 --no-docs
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
DOCS = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- bench_roofline:begin -->", "<!-- bench_roofline:end -->"
PROMPT_LEN = 100


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--classes", default="native", help="CPU classes: native and/or forced ones (avx2, portable, ...)")
    p.add_argument("--dtypes", default="auto,float32")
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--prefills", default="512,2048")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--trace", action="store_true", help="also profile a decode step per batch size")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads for the rates, the Engine (--torch-threads) and the trace (default: torch's); 1 "
                        "while the machine is shared (docs/benchmarks.md, the roofline section)")
    p.add_argument("--server-args", default="", help="extra radixserve server args for the Engine")
    p.add_argument("--no-docs", action="store_true")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # JSON: {"dtype", "out"}
    return p.parse_args()


def _prompts(batch: int, length: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(batch)]


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure_engine(engine, args: argparse.Namespace) -> list[dict]:
    """Decode and cold-prefill figures through the Engine (rows: kind, size, tokens/s, step ms, CPU use)."""
    import torch
    from peer_replay import run_cold, run_decode

    def generate(prompts: list[list[int]], new_tokens: int) -> list[tuple[list[int], float]]:
        outs = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": new_tokens, "temperature": 0.0,
                                                                   "ignore_eos": True})
        return [(o["output_ids"], o["meta_info"]["ttft"]) for o in outs]

    def flush() -> None:
        if not engine.flush_cache()["success"]:
            raise RuntimeError("flush_cache refused")

    generate(_prompts(2, 40, 0), 8)
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        work = {"prompts": _prompts(batch, PROMPT_LEN, batch), "new_tokens": args.new_tokens}
        speeds, busy = [], []
        for _ in range(args.reps):
            flush()
            wall, cpu = time.perf_counter(), _cpu_seconds()
            speeds.append(run_decode(work, generate, flush)["decode_tok_s"])
            busy.append((_cpu_seconds() - cpu) / ((time.perf_counter() - wall) * torch.get_num_threads()))
        speed = statistics.median(speeds)
        rows.append({"kind": "decode", "size": batch, "tok_s": speed, "step_ms": 1e3 * batch / speed,
                     "cpu_busy": statistics.median(busy)})
        print(f"decode bs={batch}: {speed:.1f} tok/s", flush=True)
    for length in [int(n) for n in args.prefills.split(",")]:
        speeds = []
        for _ in range(args.reps):
            flush()
            speeds.append(run_cold({"prompts": _prompts(1, length, length)}, generate)["prefill_tok_s"])
        rows.append({"kind": "prefill", "size": length, "tok_s": statistics.median(speeds)})
        print(f"prefill {length}: {rows[-1]['tok_s']:.0f} tok/s", flush=True)
    return rows


def trace_steps(dtype: str, args: argparse.Namespace) -> list[dict]:
    """One decode step per batch size on the runner alone, profiled: ms per category (forward_profile.py)."""
    import torch
    from bench_forward import build_engines, fill_context, truncate
    from forward_profile import instrument, linear_flops, profile_step

    from radixserve.layers.sampler import SamplingBatchInfo
    from radixserve.sampling_params import SamplingParams

    batches = [int(b) for b in args.batches.split(",")]
    context = PROMPT_LEN + args.new_tokens // 2
    ns = argparse.Namespace(model_path=None, dtype=dtype, batches=args.batches, context=context, steps=2,
                            prefill_len=64, paths="after,python-layers", backend="cpu", only_ours=True)
    runners, _, _ = build_engines(ns)
    traces = []
    for batch in batches:
        filled, _ = fill_context(runners, None, batch, context)
        info = SamplingBatchInfo.from_params([SamplingParams(temperature=0.0)] * batch, [0] * batch, "cpu")
        for path, (driver, reqs) in filled.items():
            runner = runners[path]

            def step(driver=driver, reqs=reqs, runner=runner, info=info) -> None:
                runner.sample(driver.decode(reqs, [17] * len(reqs)), info)

            def reset(driver=driver, reqs=reqs) -> None:
                truncate(driver, reqs, context)

            with instrument(runner):
                profile = profile_step(f"decode bs={batch}", path, step, linear_flops(runner.model, batch, batch),
                                       repeats=5, reset=reset)
            traces.append({"size": batch, "path": path, "step_ms": profile.step_ms, "ms": profile.ms,
                           "threads": torch.get_num_threads()})
            print(f"trace bs={batch} {path}: {profile.step_ms:.1f} ms "
                  + ", ".join(f"{k} {v:.1f}" for k, v in profile.ms.items() if v >= 0.05), flush=True)
            driver.release(reqs)
    return traces


def bound(cfg, fmt, rates, row: dict, new_tokens: int) -> dict:
    """A measured row's roofline: tokens/s at the bound, the binding roof, and a step's memory and compute ms."""
    from radixserve.bench import roofline

    if row["kind"] == "decode":
        steps = new_tokens - 1
        cost = roofline.decode_run(cfg, [PROMPT_LEN] * row["size"], steps, fmt.bytes_per_weight, fmt.kv_bytes)
        tokens = steps * row["size"]
    else:
        steps, tokens = 1, row["size"]
        cost = roofline.prefill(cfg, [row["size"]], fmt.bytes_per_weight, fmt.kv_bytes)
    return {"bound_tok_s": tokens / rates.seconds(cost, fmt.compute), "limit": rates.limit(cost, fmt.compute),
            "memory_ms": 1e3 * rates.memory_s(cost) / steps, "compute_ms": 1e3 * rates.compute_s(cost, fmt.compute) / steps}


def worker(args: argparse.Namespace) -> None:
    import shlex

    import torch

    from radixserve import Engine
    from radixserve.bench import roofline
    from radixserve.bench.docs import cpu_header
    from radixserve.server_args import ServerArgs

    job = json.loads(args.worker)
    dtype = job["dtype"]
    if args.threads:
        torch.set_num_threads(args.threads)
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    extra = ServerArgs.from_cli_args(parser.parse_args(shlex.split(args.server_args)))
    kwargs = {k: v for k, v in vars(extra).items() if v != getattr(ServerArgs(), k)}
    if args.threads:
        kwargs["torch_threads"] = args.threads
    pool = max(int(b) for b in args.batches.split(",")) * (PROMPT_LEN + args.new_tokens + 8) + 4096
    header = cpu_header(dtype)
    engine = Engine(**{"max_total_tokens": pool, "log_level": "warning", **kwargs, "dtype": dtype})
    runner = engine.model_runner
    cfg, fmt = runner.model_config, roofline.Formats.of_runner(runner)
    setup = runner.device_setup.describe()
    engine.shutdown()  # NOTE: the rates are measured with no scheduler running, then the engine starts afresh
    rates = roofline.measure_rates(cfg, [fmt.compute])
    print(f"roofline: {rates.describe()}; {fmt.describe()}", flush=True)
    engine = Engine(**{"max_total_tokens": pool, "log_level": "warning", **kwargs, "dtype": dtype})
    try:
        rows = measure_engine(engine, args)
    finally:
        engine.shutdown()
    for row in rows:
        row.update(bound(cfg, fmt, rates, row, args.new_tokens))
    traces = trace_steps(dtype, args) if args.trace else []
    Path(job["out"]).write_text(json.dumps({"header": header, "setup": setup, "formats": fmt.describe(),
                                            "rates": rates.describe(), "rows": rows, "traces": traces}))


def run_worker(cpu_class: str, dtype: str, args: argparse.Namespace, workdir: Path) -> dict:
    from radixserve.bench.docs import class_env

    out = workdir / f"{cpu_class}-{dtype}.json"
    env = {**os.environ, **({} if cpu_class == "native" else class_env(cpu_class))}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps({"dtype": dtype, "out": str(out)}),
           "--batches", args.batches, "--prefills", args.prefills, "--new-tokens", str(args.new_tokens),
           "--reps", str(args.reps), "--server-args", args.server_args, *(["--trace"] if args.trace else []),
           *(["--threads", str(args.threads)] if args.threads else [])]
    print(f"=== {cpu_class}, --dtype {dtype} (load {os.getloadavg()[0]:.1f})", flush=True)
    proc = subprocess.run(cmd, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"the worker for {cpu_class} / {dtype} failed (exit {proc.returncode})")
    return {"class": cpu_class, "dtype": dtype, **json.loads(out.read_text())}


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    from bench_roofline_report import render

    load_start = os.getloadavg()[0]
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_roofline-") as tmp:
        for cpu_class in args.classes.split(","):
            for dtype in args.dtypes.split(","):
                results.append(run_worker(cpu_class, dtype, args, Path(tmp)))
    section = render(results, args, (load_start, os.getloadavg()[0]))
    print("\n" + section)
    if not args.no_docs:
        from radixserve.bench.docs import write_doc_section

        write_doc_section(DOCS, BEGIN, END, section)
        print(f"wrote {DOCS}", file=sys.stderr)


if __name__ == "__main__":
    main()
