"""Each C attention kernel against torch's own op, for every CPU class this CPU can emulate: the selection table.

For each class of --classes (`radixserve.bench.docs.CPU_CLASSES`: amx is this machine as it is; the
others force our kernel level with RADIXSERVE_CPU_ISA, which also hides AMX), one process per class, and
each --dtypes, at
SmolLM2-135M's head shape (9 query heads over 3 kv heads, dim 64), on a pool with scattered slots:

* decode: --batches requests of --context tokens; the C decode kernel vs the torch backend's
  `decode_block_diagonal` (one gather, batched matmuls);
* extend: causal prefill of 1 x 500, 4 x 500 and 1 x 2,048 new tokens; the C extend kernel vs
  `_causal_sdpa` per request (torch's SDPA);
* prefix: cascade's part (a), W1's shapes (31 x 40 extend tokens, or 32 decode tokens, over a
  1,000-token shared prefix); the C prefix kernel vs `cascade._prefix_torch` (torch's CPU flash op).

With --torch-follows (default) each class's process also gets torch's own switches for that class
(`radixserve.bench.docs.TORCH_ISA_ENV`: ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, MKL_ENABLE_INSTRUCTIONS),
so torch's side runs the code it would run on such a CPU. Calls alternate; medians.

    python benchmarks/bench_kernels.py                     # table + docs/benchmarks.md section
    python benchmarks/bench_kernels.py --classes avx2 --dtypes float32 --no-docs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from radixserve.bench.docs import class_env, cpu_header, runnable_classes, write_doc_section
from radixserve.configs.row_table import DEFAULT_ROWS
from radixserve.kernels.attention import SELECTED

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- bench_kernels:begin -->", "<!-- bench_kernels:end -->"
HEADS, KV_HEADS, DIM = 9, 3, 64


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--classes", default=",".join(runnable_classes()))
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--batches", default="1,32")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--seconds", type=float, default=0.6, help="time budget per row and side")
    p.add_argument("--torch-follows", action=argparse.BooleanOptionalAction, default=True,
                   help="set torch's own ISA switches to each class too")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--no-docs", action="store_true", help="do not touch docs/")
    return p.parse_args()


def time_pair(fns: dict[str, Callable[[], object]], seconds: float) -> dict[str, float]:
    """Median seconds per call, calls alternating, until each side spent about `seconds` (at least 5 calls)."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    while min(len(ts) for ts in times.values()) < 5 or min(sum(ts) for ts in times.values()) < seconds:
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _pool(tokens: int, dtype: torch.dtype, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K/V buffers of tokens + 64 slots and a random permutation of the slots (scattered, as after churn)."""
    k, v = (torch.randn(tokens + 64, KV_HEADS, DIM, generator=g).to(dtype) for _ in "kv")
    return k, v, torch.randperm(tokens + 64, generator=g)[:tokens].to(torch.int32)


def decode_case(kernel, dtype: torch.dtype, batch: int, context: int):
    from radixserve.layers.attention.torch_backend import DecodeMetadata, decode_block_diagonal

    g = torch.Generator().manual_seed(batch)
    k, v, slots = _pool(batch * context, dtype, g)
    q = torch.randn(batch, HEADS, DIM, generator=g).to(dtype)
    lens = torch.full((batch,), context, dtype=torch.int64)
    meta = DecodeMetadata(slots.long(), context, None)
    return (lambda: decode_block_diagonal(q, k, v, meta, DIM**-0.5),
            lambda: kernel(q, k, v, slots, lens, context, DIM**-0.5))


def extend_case(kernel, dtype: torch.dtype, lengths: list[int]):
    from radixserve.layers.attention.torch_backend import _causal_sdpa

    g = torch.Generator().manual_seed(len(lengths))
    total = sum(lengths)
    k, v, slots = _pool(total, dtype, g)
    q = torch.randn(total, HEADS, DIM, generator=g).to(dtype)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    reqs = torch.tensor([(s, n, s, n) for s, n in zip(starts, lengths, strict=True)])

    keys, values = k.index_select(0, slots.long()), v.index_select(0, slots.long())

    def sdpa() -> None:  # as the torch backend runs a fresh prompt: its new K/V as they are, one SDPA call each
        out = torch.empty_like(q)
        for s, n in zip(starts, lengths, strict=True):
            out[s : s + n] = _causal_sdpa(q[s : s + n], keys[s : s + n], values[s : s + n], None, DIM**-0.5)

    return sdpa, lambda: kernel.extend(q, k, v, slots, reqs, DIM**-0.5)


def prefix_case(kernel, dtype: torch.dtype, queries: int, prefix: int):
    from radixserve.layers.attention.cascade import _prefix_torch

    g = torch.Generator().manual_seed(queries)
    k, v, slots = _pool(prefix, dtype, g)
    q = torch.randn(queries, HEADS, DIM, generator=g).to(dtype)
    return (lambda: _prefix_torch(q, k, v, slots.long(), DIM**-0.5),
            lambda: kernel.shared_prefix(q, k, v, slots, DIM**-0.5))


def worker(args: argparse.Namespace) -> list[dict]:
    """One class (this process's environment): every case, torch vs C."""
    from radixserve import platform
    from radixserve.kernels.attention import load_decode_kernel

    torch.set_num_threads(args.threads)
    kernel = load_decode_kernel()
    assert kernel is not None and platform.kernel_class() == args.worker, "the kernels of this class did not load"
    cases = [("decode", f"{b} x {args.context}", lambda dt, b=b: decode_case(kernel, dt, b, args.context))
             for b in map(int, args.batches.split(","))]
    cases += [("extend", label, lambda dt, n=n: extend_case(kernel, dt, n))
              for label, n in (("1 x 500", [500]), ("4 x 500", [500] * 4), ("1 x 1024", [1024]), ("1 x 2048", [2048]))]
    cases += [("prefix", f"{n} over 1000", lambda dt, n=n: prefix_case(kernel, dt, n, 1000)) for n in (1240, 32)]
    rows = []
    for dtype_name in args.dtypes.split(","):
        for name, shape, build in cases:
            torch_fn, c_fn = build(getattr(torch, dtype_name))
            seconds = time_pair({"torch": torch_fn, "c": c_fn}, args.seconds)
            rows.append({"class": args.worker, "dtype": dtype_name, "kernel": name, "shape": shape,
                         "torch_ms": 1e3 * seconds["torch"], "c_ms": 1e3 * seconds["c"],
                         "torch_capability": torch.backends.cpu.get_cpu_capability()})
            print(f"# {args.worker} {dtype_name} {name} {shape}: torch {rows[-1]['torch_ms']:.3f} ms, "
                  f"C {rows[-1]['c_ms']:.3f} ms", file=sys.stderr, flush=True)
    return rows


def run_class(cpu_class: str, args: argparse.Namespace) -> list[dict]:
    env = {**os.environ, **class_env(cpu_class, args.torch_follows)}
    cmd = [sys.executable, __file__, "--worker", cpu_class, "--dtypes", args.dtypes, "--threads", str(args.threads),
           "--batches", args.batches, "--context", str(args.context), "--seconds", str(args.seconds)]
    out = subprocess.run(cmd, env=env, check=True, stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def render(rows: list[dict], args: argparse.Namespace, load: tuple[float, float]) -> str:
    follows = "torch's own switches set to the same class (`TORCH_ISA_ENV` in `radixserve/bench/docs.py`)" \
        if args.torch_follows else "torch's own kernels at the machine's best level"
    lines = [
        "## Kernel levels: each C attention kernel vs torch's op (`benchmarks/bench_kernels.py`)", "",
        f"{cpu_header()}. torch {torch.__version__}, {args.threads} thread(s); load average {load[0]:.1f} at "
        f"start, {load[1]:.1f} at end. SmolLM2-135M's head shape (9 query heads over 3 kv heads, dim 64), "
        f"scattered pool slots. Each class in its own process (`class_env` in `radixserve/bench/docs.py`) with "
        f"{follows}; calls alternate, medians. Speedup above 1: the C kernel is faster. Which kernels the backend "
        "uses per class and dtype: `SELECTED` in `radixserve/kernels/attention.py`.",
        "", f"Command: `python benchmarks/bench_kernels.py --classes {args.classes} --dtypes {args.dtypes} --threads "
        f"{args.threads} --batches {args.batches} --context {args.context}"
        + ("" if args.torch_follows else " --no-torch-follows") + "`", "",
        "| class | torch capability | dtype | kernel | shape | torch ms | C ms | speedup |",
        "|---|---|---|---|---|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['class']} | {r['torch_capability']} | {r['dtype']} | {r['kernel']} | {r['shape']} | "
                     f"{r['torch_ms']:.3f} | {r['c_ms']:.3f} | {r['torch_ms'] / r['c_ms']:.2f}x |")
    lines += ["", "Classes where the C kernel was faster at every shape it would run (extend: requests of at most "
              f"{DEFAULT_ROWS.extend_kernel_new_tokens} new tokens), and where the backend uses it (`SELECTED`):", ""]
    for dtype in args.dtypes.split(","):
        for kernel in ("decode", "extend", "prefix"):
            mine = [r for r in rows if r["dtype"] == dtype and r["kernel"] == kernel and _in_use(r)]
            wins = [c for c in args.classes.split(",") if all(r["c_ms"] < r["torch_ms"] for r in mine
                                                             if r["class"] == c)]
            used = [c for c in args.classes.split(",") if kernel in SELECTED.get((c, getattr(torch, dtype)), ())]
            lines.append(f"- {dtype} {kernel}: faster on {', '.join(wins) or 'none'}; used on {', '.join(used) or 'none'}")
    lines += ["", "Why and how the levels differ: [attention.md](attention.md#kernel-levels)."]
    return "\n".join(lines)


def _in_use(row: dict) -> bool:
    """Whether the backend would run this shape in the kernel at all (extend has a length cap)."""
    return row["kernel"] != "extend" or int(row["shape"].split(" x ")[1]) <= DEFAULT_ROWS.extend_kernel_new_tokens


def main() -> None:
    args = parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    load_start = os.getloadavg()[0]
    rows = [row for cpu_class in args.classes.split(",") for row in run_class(cpu_class, args)]
    section = render(rows, args, (load_start, os.getloadavg()[0]))
    print("\n" + section)
    if not args.no_docs:
        write_doc_section(DOCS, BEGIN, END, section)
        print(f"wrote {DOCS}", file=sys.stderr)


if __name__ == "__main__":
    main()
