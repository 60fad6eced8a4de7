"""Speed and memory of float32 / bfloat16 / int8 / int4 weights on the embedded SmolLM2-135M, side by side,
with llama.cpp on the same Q4_1 file when --llama-python names a python that has llama-cpp-python.

Each variant runs in its own process (so resident memory is its own): batch-1 and batch-32 decode
tokens/s after --context tokens of context, prefill tokens/s of one --prefill-len prompt, and VmRSS.
Rounds alternate the variants, so load from other processes hits all alike; the table shows the
median round.

    flock /tmp/radixserve-bench.lock python benchmarks/bench_quantization.py --llama-python /root/peers/llamacpp/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "benchmarks.md"
PLOT = ROOT / "docs" / "bench_quantization.png"
BEGIN, END = "<!-- bench_quantization:begin -->", "<!-- bench_quantization:end -->"
LLAMA = "llama.cpp Q4_1"
VARIANTS = ("float32", "bfloat16", "int8", "int4")  # `auto` (the dtype --dtype auto picks here) on request


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per batch size")
    p.add_argument("--prefill-len", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--llama-python", default="")
    p.add_argument("--llama-build", default="", help="how that llama.cpp was built, for the table's header")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"of auto,{','.join(VARIANTS)}")
    p.add_argument("--no-docs", action="store_true")
    p.add_argument("--class", dest="cpu_class", default="", help="run as on this CPU class (bench/docs.class_env, "
                   "e.g. avx2); the table goes to its own section")
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def variant_args(name: str) -> dict:
    import torch

    from radixserve.model_loader.gguf_loader import gguf_to_hf_folder
    from radixserve.models.loader import embedded_model_path

    # NOTE: the quantized rows compute in the dtype `auto` picks (bfloat16 with native bf16 products, float32 else)
    if name == "int8":  # a bfloat16 checkpoint quantized at load (per-channel scales)
        return dict(model_path=str(gguf_to_hf_folder(embedded_model_path(), torch.bfloat16)), dtype="auto",
                    quantization="int8")
    if name == "int4":  # the shipped Q4_1 blocks as they are
        return dict(dtype="auto", quantization="int4")
    return dict(dtype=name)


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def worker(args: argparse.Namespace) -> None:
    import torch
    from direct import DirectDriver

    from radixserve.model_executor.model_runner import ModelRunner
    from radixserve.server_args import ServerArgs

    torch.set_num_threads(args.threads)
    pool = 32 * (args.context + args.steps + 2) + args.prefill_len + 64
    runner = ModelRunner(ServerArgs(max_total_tokens=pool, log_level="warning", **variant_args(args.worker)))
    driver = DirectDriver(runner)
    prompt = [(i * 7919) % 40000 + 100 for i in range(max(args.context, args.prefill_len))]
    result = {}
    driver.extend([driver.new_request()], [prompt[:64]])  # warm-up
    driver.release_all()
    start = time.perf_counter()
    driver.extend([driver.new_request()], [prompt[: args.prefill_len]])
    result["prefill"] = args.prefill_len / (time.perf_counter() - start)
    driver.release_all()
    for bs in (1, 32):
        reqs = [driver.new_request() for _ in range(bs)]
        for req in reqs:
            driver.extend([req], [prompt[: args.context]])
        tokens = [5] * bs
        driver.decode(reqs, tokens)
        start = time.perf_counter()
        for _ in range(args.steps):
            tokens = driver.decode(reqs, tokens).argmax(-1).tolist()
        result[f"decode{bs}"] = bs * args.steps / (time.perf_counter() - start)
        driver.release_all()
    result["rss_mib"] = rss_mib()
    print(json.dumps(result), flush=True)


def run_variant(name: str, args: argparse.Namespace) -> dict:
    if name == LLAMA:
        from radixserve.models.loader import embedded_model_path

        cmd = [args.llama_python, str(Path(__file__).parent / "llama_cpp_helper.py"), "speed",
               str(embedded_model_path()), str(args.threads), str(args.context), str(args.steps), str(args.prefill_len)]
    else:
        cmd = [sys.executable, __file__, "--worker", name, "--context", str(args.context), "--steps", str(args.steps),
               "--prefill-len", str(args.prefill_len), "--threads", str(args.threads)]
    env = {**os.environ, **class_env_of(args), "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, timeout=900)
    return json.loads(out.stdout.strip().splitlines()[-1])


def class_env_of(args: argparse.Namespace) -> dict[str, str]:
    from radixserve.bench.docs import class_env

    return class_env(args.cpu_class) if args.cpu_class else {}


def main() -> None:
    args = parse_args()
    if args.worker:
        return worker(args)
    names = [*args.variants.split(","), *([LLAMA] if args.llama_python else [])]
    runs: dict[str, list[dict]] = {n: [] for n in names}
    load = [os.getloadavg()[0]]
    for r in range(args.rounds):
        for name in names:
            runs[name].append(run_variant(name, args))
            print(f"round {r + 1} {name}: {runs[name][-1]}", flush=True)
    load.append(os.getloadavg()[0])
    med = {n: {k: statistics.median(run[k] for run in runs[n]) for k in runs[n][0]} for n in names}
    body = doc_body(args, med, load)
    print(body)
    if not args.no_docs:
        from radixserve.bench.docs import write_doc_section

        tag = f"_{args.cpu_class}" if args.cpu_class else ""
        write_doc_section(DOCS, BEGIN.replace(":begin", f"{tag}:begin"), END.replace(":end", f"{tag}:end"), body)
        plot(med, PLOT.with_name(f"bench_quantization{tag}.png"))


def doc_body(args: argparse.Namespace, med: dict, load: list[float]) -> str:
    import torch

    from radixserve.bench.docs import cpu_name
    from radixserve.kernels.quant import best_quant_isa
    from radixserve.platform import choose_dtype

    os.environ.update(class_env_of(args))  # NOTE: the header names the class the workers ran as

    def cell(n: str, key: str, fmt: str = "{:.1f}") -> str:
        return fmt.format(med[n][key]) if key in med[n] else "n/a"

    rows = [f"| {n} | {cell(n, 'decode1')} | {cell(n, 'decode32')} | {cell(n, 'prefill')} | "
            f"{cell(n, 'rss_mib', '{:.0f}')} |" for n in med]
    cmd = (f"python benchmarks/bench_quantization.py --context {args.context} --steps {args.steps} --prefill-len "
           f"{args.prefill_len} --rounds {args.rounds} --threads {args.threads}"
           + (f" --llama-python {args.llama_python}" if args.llama_python else "")
           + (f" --llama-build '{args.llama_build}'" if args.llama_build else "")
           + (f" --variants {args.variants}" if args.variants != ",".join(VARIANTS) else "")
           + (f" --class {args.cpu_class}" if args.cpu_class else ""))
    forced = (f" Run as the **{args.cpu_class} class** on this CPU: {' '.join(f'{k}={v}' for k, v in class_env_of(args).items())}"
              " (our kernels and torch's)." if args.cpu_class else "")
    if args.llama_python:
        forced += f" llama.cpp: llama-cpp-python {args.llama_build or '(build not given)'}, 2 threads, on the same file."
    auto = choose_dtype("auto", "cpu")
    return "\n".join([
        f"## Quantized weights{f' ({args.cpu_class} class)' if args.cpu_class else ''}: "
        f"{', '.join(args.variants.split(','))} (`benchmarks/bench_quantization.py`)",
        "",
        f"Model: embedded SmolLM2-135M-Instruct. float32 and bfloat16: the Q4_1 file dequantized; int8: its "
        f"bfloat16 folder quantized at load (per-channel); int4: the Q4_1 blocks as they are; the quantized rows "
        f"compute in the dtype `auto` picks ({auto.dtype} here) with the kernels at level `{best_quant_isa()}` (the class's); "
        f"auto: {auto.dtype}{' with bf16 weights' if auto.weights == 'bfloat16' else ''}.{forced} Machine: "
        f"{os.cpu_count()} CPUs "
        f"({cpu_name()}), torch {torch.__version__}, {args.threads} threads. Load average {load[0]:.1f} at start, "
        f"{load[1]:.1f} at end; each variant in its own process, rounds alternate, median of {args.rounds}. "
        f"Decode after {args.context} tokens of context; RSS is the process's resident memory after the runs.",
        "",
        f"Command: `flock /tmp/radixserve-bench.lock {cmd}`",
        "",
        "| weights | decode bs=1 tok/s | decode bs=32 tok/s | prefill tok/s | RSS MiB |",
        "|---|---:|---:|---:|---:|",
        *rows,
        "",
        f"![quantization](bench_quantization{f'_{args.cpu_class}' if args.cpu_class else ''}.png)",
        "",
    ])


def plot(med: dict, path: Path = PLOT) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [("decode1", "decode bs=1 tok/s"), ("decode32", "decode bs=32 tok/s"), ("prefill", "prefill tok/s"),
            ("rss_mib", "RSS MiB")]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    for ax, (key, title) in zip(axes, keys, strict=True):
        names = [n for n in med if key in med[n]]
        ax.bar(range(len(names)), [med[n][key] for n in names], color="tab:blue")
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    main()
