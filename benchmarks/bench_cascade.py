"""Cascade attention on vs off: forward passes of a batch whose requests share one long prefix.

The W1 shape: --batch requests (default 32) share a --prefix of 1,000 cached tokens and each own
--own 40 more. Two workloads on the model runner, with the same attention backend once with cascade
attention (threshold --min-prefix) and once without, rounds alternating, median round kept:

* decode: --steps decode steps of the whole batch (contexts of prefix + own tokens);
* extend: batch - 1 requests compute --own new tokens each over the cached shared prefix (the
  second prefill batch of W1, after the first request computed the prefix).

Cached K/V are random (attention cost does not depend on the values). Then, end to end, W1 through
`radixserve bench --workloads w1 --modes on` with and without --disable-cascade-attention, one
process per run, alternating, --w1-repeats each (0: skip), median wall kept. `--sweep` instead times
one layer's attention alone over a grid of batch sizes and prefix lengths, to pick the thresholds.

    python benchmarks/bench_cascade.py                  # table, docs/benchmarks.md section, docs/bench_cascade.png
    python benchmarks/bench_cascade.py --sweep --no-docs
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

import torch
from bench_forward import time_rounds
from direct import DirectDriver, DirectRequest

from radixserve.bench.docs import cpu_header, write_doc_section
from radixserve.configs.row_table import CascadePolicy
from radixserve.forward_batch import ForwardBatch
from radixserve.layers.attention import create_attention_backend
from radixserve.layers.radix_attention import RadixAttention
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.server_args import ServerArgs

ROOT = Path(__file__).resolve().parent.parent
DOCS, PLOT = ROOT / "docs" / "benchmarks.md", ROOT / "docs" / "bench_cascade.png"
BEGIN, END = "<!-- bench_cascade:begin -->", "<!-- bench_cascade:end -->"
Row = tuple[str, int, float, float]  # workload, threads, tok/s cascade on, tok/s cascade off
W1_COMMAND = ["radixserve", "bench", "--workloads", "w1", "--modes", "on", "--output", "", "--plot", ""]
W1_ROW = re.compile(r"^\| W1 \| on \| (.+) \|$", re.M)  # the bench's table row: wall, out tok/s, total, TTFTs


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--backend", default="cpu", help="our attention backend (cpu: C kernels; torch)")
    p.add_argument("--prefix", type=int, default=1000)
    p.add_argument("--own", type=int, default=40)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=8, help="decode steps per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--min-prefix", type=int, default=CascadePolicy().min_prefix)
    p.add_argument("--threads", default="", help="torch thread counts to run, e.g. 1,2 (default: torch's)")
    p.add_argument("--w1-repeats", type=int, default=3, help="end-to-end W1 runs per mode (0: skip)")
    p.add_argument("--w1-torch-threads", type=int, default=1,
                   help="--torch-threads of the W1 runs; 0: torch's default (default: %(default)s, steadier on a "
                        "shared machine)")
    p.add_argument("--sweep", action="store_true", help="time one layer's attention over a grid instead")
    p.add_argument("--no-docs", action="store_true", help="do not touch docs/")
    return p.parse_args()


def write_random_kv(runner: ModelRunner, slots: torch.Tensor, seed: int) -> None:
    cfg, g = runner.model_config, torch.Generator().manual_seed(seed)
    for layer in range(cfg.num_layers):
        k, v = (torch.randn(len(slots), cfg.num_kv_heads, cfg.head_dim, generator=g).to(runner.dtype) for _ in "kv")
        runner.token_to_kv_pool.set_kv_buffer(layer, slots, k, v)


def cached_tokens(driver: DirectDriver, req: DirectRequest, n: int, seed: int) -> None:
    """Appends n cached tokens with random K/V to req."""
    slots = driver.runner.token_to_kv_pool_allocator.alloc_extend([0], [n], [-1], n)
    driver._assign(req, len(req.token_ids), [11] * n, slots)
    write_random_kv(driver.runner, slots.long(), seed)


def shared_batch(runner: ModelRunner, batch: int, prefix: int, own: int) -> tuple[DirectDriver, list[DirectRequest]]:
    """`batch` requests over one shared prefix (owned by a root request, listed last), `own` tokens each."""
    driver = DirectDriver(runner)
    root = driver.new_request()
    cached_tokens(driver, root, prefix, seed=0)
    reqs = [driver.new_request(share_prefix_of=root, prefix_len=prefix) for _ in range(batch)]
    for i, req in enumerate(reqs):
        if own:
            cached_tokens(driver, req, own, seed=1 + i)
    return driver, [*reqs, root]


def drop_after(driver: DirectDriver, reqs: list[DirectRequest], keep_owned: int, length: int) -> None:
    """Frees each request's slots past its first `keep_owned` allocations; keeps `length` tokens."""
    for req in reqs:
        dropped = req.owned[keep_owned:]
        if dropped:
            driver.runner.token_to_kv_pool_allocator.free(torch.cat(dropped))
        req.owned, req.token_ids = req.owned[:keep_owned], req.token_ids[:length]


def on_off(runner: ModelRunner, args: argparse.Namespace, fn) -> dict[str, float]:
    """Median seconds of fn with cascade on and off, alternating."""
    backends = {mode: create_attention_backend(args.backend, runner) for mode in ("on", "off")}
    backends["on"].cascade = CascadePolicy(min_prefix=args.min_prefix)
    backends["off"].cascade = None

    def runner_with(mode: str):
        def run() -> None:
            runner.attn_backend = backends[mode]
            fn()
        return run

    seconds = time_rounds({mode: runner_with(mode) for mode in backends}, args.rounds)
    assert backends["on"].cascade_forwards != {"decode": 0, "extend": 0}, "cascade never ran"
    return seconds


def bench_decode(runner: ModelRunner, args: argparse.Namespace) -> tuple[float, float]:
    driver, reqs = shared_batch(runner, args.batch, args.prefix, args.own)
    batch = reqs[:-1]

    def steps() -> None:
        for _ in range(args.steps):
            driver.decode(batch, [17] * len(batch))
        drop_after(driver, batch, 1, args.prefix + args.own)

    seconds = on_off(runner, args, steps)
    driver.release_all()
    return args.batch * args.steps / seconds["on"], args.batch * args.steps / seconds["off"]


def bench_extend(runner: ModelRunner, args: argparse.Namespace) -> tuple[float, float]:
    driver, reqs = shared_batch(runner, args.batch - 1, args.prefix, 0)
    batch = reqs[:-1]
    new_tokens = [[100 + (i * 7 + t) % 5000 for t in range(args.own)] for i in range(len(batch))]

    def extend() -> None:
        driver.extend(batch, new_tokens)
        drop_after(driver, batch, 0, args.prefix)

    seconds = on_off(runner, args, extend)
    driver.release_all()
    tokens = len(batch) * args.own
    return tokens / seconds["on"], tokens / seconds["off"]


def sweep(runner: ModelRunner, args: argparse.Namespace) -> None:
    """One layer's attention alone, cascade on vs off, over batch sizes x shared prefix lengths.

    Each request owns --own tokens past the prefix; decode: one new token each; extend: the own
    tokens are the new ones."""
    cfg = runner.model_config
    layer = RadixAttention(0, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.head_dim**-0.5)
    print("mode | batch | prefix | on us | off us | off / on")
    for batch in (2, 4, 8, 32):
        for prefix in (64, 128, 256, 512, 1000):
            driver, reqs = shared_batch(runner, batch, prefix, args.own)
            rows, own = [r.row for r in reqs[:-1]], [r.owned[-1].to(runner.device) for r in reqs[:-1]]
            decode = ForwardBatch.for_decode([17] * batch, rows, [prefix + args.own] * batch,
                                             torch.cat([o[-1:] for o in own]), runner.device)
            extend = ForwardBatch.for_extend([17] * batch * args.own, rows, [prefix] * batch, [args.own] * batch,
                                             torch.cat(own), runner.device)
            for mode, fb in (("decode", decode), ("extend", extend)):
                fb.req_to_token_pool, fb.token_to_kv_pool = runner.req_to_token_pool, runner.token_to_kv_pool
                n = fb.num_tokens
                q = torch.randn(n, cfg.num_heads, cfg.head_dim).to(runner.dtype)
                k, v = (torch.randn(n, cfg.num_kv_heads, cfg.head_dim).to(runner.dtype) for _ in "kv")
                on, off = time_attention(runner, args, (q, k, v, layer, fb), repeat=20 if mode == "decode" else 2)
                print(f"{mode} | {batch} | {prefix} | {on:.0f} | {off:.0f} | {off / on:.2f}x", flush=True)
            driver.release_all()


def time_attention(runner: ModelRunner, args: argparse.Namespace, call: tuple, repeat: int = 20) -> tuple[float, float]:
    """Microseconds of one backend.forward(*call), cascade on (any shared prefix) and off."""
    backends = {mode: create_attention_backend(args.backend, runner) for mode in ("on", "off")}
    backends["on"].cascade = CascadePolicy(min_prefix=1, min_decode_batch=1, min_decode_saved=0)
    backends["off"].cascade = None
    # NOTE: a forward's metadata travels on the batch: each backend's own goes back on before it runs
    metas = {mode: backend.init_forward_metadata(call[-1]) for mode, backend in backends.items()}

    def attend(backend, meta) -> None:
        call[-1].attn_metadata = meta
        for _ in range(repeat):
            backend.forward(*call)

    seconds = time_rounds({mode: lambda b=b, m=metas[mode]: attend(b, m) for mode, b in backends.items()},
                          args.rounds)
    return 1e6 * seconds["on"] / repeat, 1e6 * seconds["off"] / repeat


def w1_command(threads: int, mode: str) -> list[str]:
    return (W1_COMMAND + (["--torch-threads", str(threads)] if threads else [])
            + (["--disable-cascade-attention"] if mode == "off" else []))


def bench_w1(repeats: int, threads: int) -> dict[str, list[list[float]]]:
    """W1 end to end per mode ("on"/"off" cascade): the bench's row of each run, modes alternating."""
    runs: dict[str, list[list[float]]] = {"on": [], "off": []}
    for rep in range(repeats):
        for mode in ("on", "off") if rep % 2 == 0 else ("off", "on"):
            command = w1_command(threads, mode)
            out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
            cells = W1_ROW.search(out).group(1).split(" | ")
            runs[mode].append([float(c) for c in cells[:6]])  # wall, out tok/s, total tok/s, TTFT mean/p50/p90
            print(f"W1 cascade {mode}: wall {cells[0]} s, mean TTFT {cells[3]} s", flush=True)
    return runs


def render_w1(runs: dict[str, list[list[float]]], threads: int) -> list[str]:
    median = {mode: sorted(rs)[(len(rs) - 1) // 2] for mode, rs in runs.items()}  # the median-wall run
    lines = [
        "", "End to end, W1 (32 requests = a shared 1,000-token prefix + 40 own tokens, 32 new tokens each), "
        f"{len(runs['on'])} runs per mode in separate processes, alternating; median-wall run shown:", "",
        "| cascade | command | wall s (all runs) | out tok/s | TTFT mean s | TTFT p90 s |",
        "|---|---|---|---:|---:|---:|",
    ]
    for mode, rs in runs.items():
        command = shlex.join(w1_command(threads, mode))
        walls = ", ".join(f"{r[0]:.2f}" for r in rs)
        m = median[mode]
        lines.append(f"| {mode} | `{command}` | {m[0]:.2f} ({walls}) | "
                     f"{m[1]:.1f} | {m[3]:.3f} | {m[5]:.3f} |")
    ratios = sorted(off[0] / on[0] for on, off in zip(runs["on"], runs["off"], strict=True))  # per repeat
    on, off = median["on"], median["off"]
    lines += ["", f"W1 wall, cascade off / on, per repeat (adjacent runs): {', '.join(f'{r:.2f}x' for r in ratios)}; "
              f"median **{statistics.median(ratios):.2f}x**. Mean TTFT of the median-wall runs: "
              f"{100 * (1 - on[3] / off[3]):.0f}% lower with cascade."]
    return lines


def render(rows: list[Row], args: argparse.Namespace, load: tuple[float, float],
           w1: dict[str, list[list[float]]] | None) -> str:
    lines = [
        "## Cascade attention: shared-prefix batches, cascade on vs off (`benchmarks/bench_cascade.py`)",
        "",
        f"Model: embedded SmolLM2-135M-Instruct; attention backend `{args.backend}`; "
        f"cascade threshold {args.min_prefix} tokens. {cpu_header(args.dtype)}; {os.cpu_count()} logical CPUs, "
        f"torch {torch.__version__}. Load average {load[0]:.1f} at start, {load[1]:.1f} at end; rounds "
        "alternate between on and off and the table shows the median round. Cached K/V are random.",
        "",
        f"Command: `python benchmarks/bench_cascade.py --dtype {args.dtype} --backend {args.backend} "
        f"--prefix {args.prefix} --own {args.own} --batch {args.batch} --steps {args.steps} "
        f"--rounds {args.rounds} --w1-repeats {args.w1_repeats} --w1-torch-threads {args.w1_torch_threads}"
        + (f" --threads {args.threads}`" if args.threads else "`"),
        "",
        "| workload | threads | cascade on tok/s | cascade off tok/s | on / off |",
        "|---|---:|---:|---:|---:|",
    ]
    lines += [f"| {w} | {t} | {on:.1f} | {off:.1f} | {on / off:.2f}x |" for w, t, on, off in rows]
    if w1:
        lines += render_w1(w1, args.w1_torch_threads)
    lines += ["", "How it works, when it runs and the threshold sweep: [attention.md](attention.md).", "",
              f"![cascade on vs off]({PLOT.name})"]
    return "\n".join(lines)


def plot(rows: list[Row]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r[2] for r in rows], width=0.4, label="cascade on")
    ax.bar([x + 0.2 for x in xs], [r[3] for r in rows], width=0.4, label="cascade off")
    ax.set_xticks(list(xs), [f"{r[0]}\n{r[1]} thread(s)" for r in rows], fontsize=7)
    ax.set_ylabel("tokens / s")
    ax.set_title("SmolLM2-135M, batch sharing a 1,000-token prefix", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(PLOT, dpi=120)


def main() -> None:
    args = parse_args()
    load_start = os.getloadavg()[0]
    pool = (args.batch + 1) * (args.prefix + args.own + args.steps + 8)
    runner = ModelRunner(ServerArgs(dtype=args.dtype, max_total_tokens=pool, max_running_requests=args.batch + 4))
    rows: list[Row] = []
    for threads in [int(t) for t in args.threads.split(",") if t] or [torch.get_num_threads()]:
        torch.set_num_threads(threads)
        if args.sweep:
            print(f"{threads} thread(s)")
            sweep(runner, args)
            continue
        shape = f"shared {args.prefix} + own {args.own}"
        rows.append((f"decode bs={args.batch}, {shape}", threads, *bench_decode(runner, args)))
        print(rows[-1], flush=True)
        rows.append((f"extend {args.batch - 1}x{args.own} over shared {args.prefix}", threads,
                     *bench_extend(runner, args)))
        print(rows[-1], flush=True)
    if args.sweep:
        return
    w1 = bench_w1(args.w1_repeats, args.w1_torch_threads) if args.w1_repeats else None
    section = render(rows, args, (load_start, os.getloadavg()[0]), w1)
    print("\n" + section)
    if not args.no_docs:
        write_doc_section(DOCS, BEGIN, END, section)
        plot(rows)
        print(f"wrote {DOCS} and {PLOT}", file=sys.stderr)


if __name__ == "__main__":
    main()
