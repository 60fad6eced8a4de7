"""Causal prefill attention on the CPU: our extend kernel against torch's SDPA.

The kernel is the one CpuAttnBackend uses for the dtype: in bf16 on a CPU with AMX-BF16 the AMX kernel
(csrc/extend_amx.c), otherwise the C extend kernel (csrc/extend_attention.c).

Attention alone: one request of each --lengths prompt length (no cached prefix; the model's head
shape, default the embedded SmolLM2-135M: 9 query heads over 3 kv heads, dim 64), and one batch of
--batch requests of 500 tokens, per --threads count and --dtypes. SDPA runs as the backend runs it
(`_causal_sdpa` per request over its own K/V); the kernel as CpuAttnBackend calls it (one call for
the batch, reading K/V through slots). Calls alternate; the table shows medians.

End to end: `radixserve bench --workloads <w> --modes on --repeats 3` with the kernel on and off
(RADIXSERVE_CPU_PREFILL_KERNEL=1/0), one process per run, alternating, --e2e-pairs pairs.

    python benchmarks/bench_prefill_attention.py                  # table + docs/benchmarks.md section
    python benchmarks/bench_prefill_attention.py --e2e-pairs 0 --no-docs
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from radixserve.bench.docs import cpu_header, write_doc_section
from radixserve.kernels.attention import load_decode_kernel
from radixserve.kernels.attention_amx import load_amx_extend_kernel
from radixserve.layers.attention.torch_backend import PREFILL_KERNEL_ENV, _causal_sdpa

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- bench_prefill_attention:begin -->", "<!-- bench_prefill_attention:end -->"
BENCH = ["radixserve", "bench", "--modes", "on", "--repeats", "3", "--output", "", "--plot", ""]
Row = tuple[str, int, str, float, float, str]  # dtype, threads, shape, SDPA ms, kernel ms, kernel name


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="32,128,500,1024,2048")
    p.add_argument("--batch", type=int, default=4, help="requests of 500 tokens in the batched row (0: skip)")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--dtypes", default="bfloat16")
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--seconds", type=float, default=1.0, help="time budget per row and side")
    p.add_argument("--workloads", default="w2", help="end-to-end workloads, comma-separated")
    p.add_argument("--e2e-pairs", type=int, default=3, help="end-to-end on/off run pairs per workload (0: skip)")
    p.add_argument("--no-docs", action="store_true", help="do not touch docs/")
    return p.parse_args()


def time_pair(fns: dict[str, callable], seconds: float) -> dict[str, float]:
    """Median seconds per call of each fn, calls alternating, until each side spent about `seconds`."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    while min(len(ts) for ts in times.values()) < 5 or sum(times["sdpa"]) + sum(times["kernel"]) < 2 * seconds:
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def extend_kernel_for(q: torch.Tensor, k: torch.Tensor):
    """(name, kernel): the AMX kernel where it takes this dtype here, else the C extend kernel."""
    amx = load_amx_extend_kernel()
    if amx is not None and amx.extend_supports(q, k):
        return "amx", amx
    kernel = load_decode_kernel()
    assert kernel is not None, "the C kernels cannot be built here"
    return "c", kernel


def bench_shape(lengths: list[int], args: argparse.Namespace, dtype: torch.dtype) -> tuple[float, float, str]:
    """(SDPA, kernel) median seconds for one batch of requests without cached prefixes, and the kernel's name."""
    g = torch.Generator().manual_seed(0)
    total, scale = sum(lengths), args.dim**-0.5
    q = torch.randn(total, args.heads, args.dim, generator=g).to(dtype)
    k, v = (torch.randn(total, args.kv_heads, args.dim, generator=g).to(dtype) for _ in "kv")
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    reqs = torch.tensor([(s, n, s, n) for s, n in zip(starts, lengths, strict=True)])
    slots = torch.arange(total, dtype=torch.int32)
    name, kernel = extend_kernel_for(q, k)

    def sdpa() -> None:
        out = torch.empty_like(q)
        for s, n in zip(starts, lengths, strict=True):
            out[s : s + n] = _causal_sdpa(q[s : s + n], k[s : s + n], v[s : s + n], None, scale)

    seconds = time_pair({"sdpa": sdpa, "kernel": lambda: kernel.extend(q, k, v, slots, reqs, scale)}, args.seconds)
    return seconds["sdpa"], seconds["kernel"], name


def bench_attention(args: argparse.Namespace) -> list[Row]:
    shapes = [(f"1 x {n}", [n]) for n in map(int, args.lengths.split(","))]
    if args.batch:
        shapes.append((f"{args.batch} x 500", [500] * args.batch))
    rows = []
    for dtype_name in args.dtypes.split(","):
        for threads in map(int, args.threads.split(",")):
            torch.set_num_threads(threads)
            for label, lengths in shapes:
                sdpa, kernel, name = bench_shape(lengths, args, getattr(torch, dtype_name))
                rows.append((dtype_name, threads, label, 1e3 * sdpa, 1e3 * kernel, name))
                print(f"{dtype_name} {threads} thread(s) {label}: SDPA {rows[-1][3]:.3f} ms, {name} kernel "
                      f"{rows[-1][4]:.3f} ms, {sdpa / kernel:.2f}x", flush=True)
    return rows


def causal_gflop(label: str, args: argparse.Namespace) -> float:
    count, n = (int(x) for x in label.split(" x "))
    return count * 4 * args.heads * args.dim * n * (n + 1) / 2 / 1e9  # QK and PV over the visible keys


def e2e_command(workload: str) -> list[str]:
    return BENCH + ["--workloads", workload]


def bench_e2e(workload: str, pairs: int) -> dict[str, list[float]]:
    """Wall seconds (the bench's median of 3) per run, kernel on and off, alternating."""
    row = re.compile(rf"^\| {workload.upper()} \| on \| ([0-9.]+) \|", re.M)
    walls: dict[str, list[float]] = {"on": [], "off": []}
    for pair in range(pairs):
        for mode in ("on", "off") if pair % 2 == 0 else ("off", "on"):
            env = {**os.environ, PREFILL_KERNEL_ENV: "1" if mode == "on" else "0"}
            out = subprocess.run(e2e_command(workload), capture_output=True, text=True, check=True, env=env).stdout
            walls[mode].append(float(row.search(out).group(1)))
            print(f"{workload} kernel {mode}: wall {walls[mode][-1]:.2f} s", flush=True)
    return walls


def render(rows: list[Row], e2e: dict[str, dict[str, list[float]]], args: argparse.Namespace,
           load: tuple[float, float]) -> str:
    lines = [
        "## Prefill attention: our extend kernel vs SDPA (`benchmarks/bench_prefill_attention.py`)", "",
        f"Causal attention of prompts without a cached prefix, {args.heads} query heads over {args.kv_heads} kv "
        f"heads, dim {args.dim} (SmolLM2-135M). {cpu_header()}; {os.cpu_count()} logical CPUs, torch "
        f"{torch.__version__}; load average {load[0]:.1f} at start, {load[1]:.1f} at end. SDPA and the kernel "
        "alternate call by call; medians. GFLOP/s count the causal half (4 * heads * dim * n(n+1)/2 per request). "
        "Kernel: `amx` is csrc/extend_amx.c (bf16 on AMX-BF16 CPUs), `c` is csrc/extend_attention.c.",
        "", f"Command: `python benchmarks/bench_prefill_attention.py --lengths {args.lengths} --batch {args.batch} "
        f"--threads {args.threads} --dtypes {args.dtypes} --e2e-pairs {args.e2e_pairs} --workloads {args.workloads}`",
        "", "| dtype | threads | requests x tokens | kernel | SDPA ms | kernel ms | SDPA GFLOP/s | kernel GFLOP/s | speedup |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for dtype, threads, label, sdpa, kernel, name in rows:
        flop = causal_gflop(label, args)
        lines.append(f"| {dtype} | {threads} | {label} | {name} | {sdpa:.3f} | {kernel:.3f} | {flop / sdpa * 1e3:.0f} | "
                     f"{flop / kernel * 1e3:.0f} | {sdpa / kernel:.2f}x |")
    for workload, walls in e2e.items():
        ratios = [off / on for on, off in zip(walls["on"], walls["off"], strict=True)]
        lines += [
            "", f"End to end, {workload.upper()}: `{PREFILL_KERNEL_ENV}=1|0 {shlex.join(e2e_command(workload))}`, "
            f"{len(ratios)} pairs of runs in separate processes, alternating (each wall is that bench's median of 3):",
            "", "| kernel | wall s per run | median |", "|---|---|---:|",
            *(f"| {mode} | {', '.join(f'{w:.2f}' for w in ws)} | {statistics.median(ws):.2f} |"
              for mode, ws in walls.items()),
            "", f"Wall off / on per pair: {', '.join(f'{r:.2f}x' for r in ratios)}; median "
            f"**{statistics.median(ratios):.2f}x**.",
        ]
    lines += ["", "How the kernel works and when it runs: [attention.md](attention.md)."]
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    load_start = os.getloadavg()[0]
    rows = bench_attention(args)
    e2e = {w: bench_e2e(w, args.e2e_pairs) for w in args.workloads.split(",")} if args.e2e_pairs else {}
    section = render(rows, e2e, args, (load_start, os.getloadavg()[0]))
    print("\n" + section)
    if not args.no_docs:
        write_doc_section(DOCS, BEGIN, END, section)
        print(f"wrote {DOCS}", file=sys.stderr)


if __name__ == "__main__":
    main()
