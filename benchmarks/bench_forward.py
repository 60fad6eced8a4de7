"""Forward-pass throughput: radixserve's model runner against transformers, same weights and dtype.

Prefill: one prompt of --prefill-len tokens (logits of the last token only, as generate does).
Decode: batches of --batches requests, each with --context tokens of context, --steps steps per
round. The decode context is filled with random K/V (decode cost does not depend on the values),
written through our allocator into our pool and into a transformers DynamicCache of the same shape.
Rounds alternate between the two engines, so load from other processes hits both alike; the table
shows the median round.

    python benchmarks/bench_forward.py                   # prints the table, updates docs/benchmarks.md
    python benchmarks/bench_forward.py --profile         # also where our time goes (torch.profiler)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from radixserve.bench.docs import cpu_header, write_doc_section
from radixserve.layers.attention import create_attention_backend
from radixserve.model_executor.direct_driver import DirectDriver, DirectRequest
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.server_args import ServerArgs

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "benchmarks.md"
PLOT = ROOT / "docs" / "bench_forward.png"
BEGIN, END = "<!-- bench_forward:begin -->", "<!-- bench_forward:end -->"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="default: the embedded SmolLM2-135M-Instruct GGUF")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="auto: what --dtype auto picks on this CPU (radixserve.platform.choose_dtype)")
    p.add_argument("--prefill-len", type=int, default=1024)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--steps", type=int, default=8, help="decode steps per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--backends", default="cpu,torch", help="our attention backends to measure, comma-separated")
    p.add_argument("--threads", default="", help="torch thread counts to run, e.g. 1,2 (default: torch's)")
    p.add_argument("--profile", action="store_true", help="print torch.profiler tables of our prefill and decode")
    p.add_argument("--only-ours", action="store_true", help="skip transformers (no comparison columns)")
    p.add_argument("--no-docs", action="store_true", help="do not touch docs/")
    return p.parse_args()


def build_engines(args: argparse.Namespace):
    from transformers import AutoModelForCausalLM

    from radixserve.models.gguf_loader import gguf_to_hf_folder

    batches = [int(b) for b in args.batches.split(",")]
    pool = max(batches) * (args.context + args.steps + 2) + args.prefill_len + 64
    runner = ModelRunner(ServerArgs(model_path=args.model_path, dtype=args.dtype, max_total_tokens=pool))
    if args.only_ours:
        return runner, None, batches
    source = Path(runner.loaded.source)
    folder = gguf_to_hf_folder(source, runner.dtype) if source.is_file() else source
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=runner.dtype).eval()
    return runner, hf, batches


def time_rounds(fns: dict[str, callable], rounds: int) -> dict[str, float]:
    """Median seconds per call of each fn, calls interleaved round by round."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def with_backend(runner: ModelRunner, name: str, fn):
    """fn, run with our attention backend `name`."""
    backend = create_attention_backend(name, runner)

    def run() -> None:
        runner.attn_backend = backend
        fn()

    return run


def engines(runner: ModelRunner, args: argparse.Namespace, ours, theirs) -> dict[str, callable]:
    fns = {f"radixserve ({b})": with_backend(runner, b, ours) for b in args.backends.split(",")}
    if not args.only_ours:
        fns["transformers"] = theirs
    return fns


def bench_prefill(runner: ModelRunner, hf, args: argparse.Namespace) -> dict[str, float]:
    prompt = torch.randint(10, runner.model_config.vocab_size, (args.prefill_len,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    driver = DirectDriver(runner)

    def ours() -> None:
        req = driver.new_request()
        driver.extend([req], [prompt])
        driver.release([req])

    def theirs() -> None:
        with torch.inference_mode():
            hf(input_ids=torch.tensor([prompt]), use_cache=True, logits_to_keep=1)

    seconds = time_rounds(engines(runner, args, ours, theirs), max(3, args.rounds // 2))
    return {name: args.prefill_len / s for name, s in seconds.items()}


def fill_context(runner: ModelRunner, hf, batch: int, context: int):
    """`batch` requests with `context` random K/V tokens each, in our pool and in an HF DynamicCache."""
    from transformers import DynamicCache

    driver = DirectDriver(runner)
    cfg = runner.model_config
    reqs = [driver.new_request() for _ in range(batch)]
    allocator = runner.token_to_kv_pool_allocator
    cache = DynamicCache(config=hf.config) if hf is not None else None
    g = torch.Generator().manual_seed(batch)
    shape = (batch, cfg.num_kv_heads, context, cfg.head_dim)
    for layer in range(cfg.num_layers):
        k = torch.randn(shape, generator=g).to(runner.dtype)
        v = torch.randn(shape, generator=g).to(runner.dtype)
        if cache is not None:
            cache.update(k, v, layer)
        for i, req in enumerate(reqs):
            if layer == 0:
                slots = allocator.alloc_extend([0], [context], [-1], context)
                driver._assign(req, 0, [11] * context, slots)
            slots = runner.req_to_token_pool.req_to_token[req.row, :context].long()
            runner.token_to_kv_pool.set_kv_buffer(layer, slots, k[i].transpose(0, 1), v[i].transpose(0, 1))
    return driver, reqs, cache


def truncate(driver: DirectDriver, reqs: list[DirectRequest], context: int) -> None:
    """Drops the decode steps of a round: frees their slots, keeps the first `context` tokens."""
    for req in reqs:
        kept, dropped = req.owned[:1], req.owned[1:]
        if dropped:
            driver.runner.token_to_kv_pool_allocator.free(torch.cat(dropped))
        req.owned, req.token_ids = kept, req.token_ids[:context]


def bench_decode(runner: ModelRunner, hf, batch: int, args: argparse.Namespace) -> dict[str, float]:
    driver, reqs, cache = fill_context(runner, hf, batch, args.context)
    tokens = [17] * batch

    def ours() -> None:
        for _ in range(args.steps):
            driver.decode(reqs, tokens)
        truncate(driver, reqs, args.context)

    def theirs() -> None:
        with torch.inference_mode():
            for _ in range(args.steps):
                hf(input_ids=torch.tensor([[17]] * batch), past_key_values=cache, use_cache=True)
        cache.crop(-args.steps)

    seconds = time_rounds(engines(runner, args, ours, theirs), args.rounds)
    driver.release(reqs)
    return {name: batch * args.steps / s for name, s in seconds.items()}


def profile_ours(runner: ModelRunner, hf, args: argparse.Namespace) -> tuple[str, str]:
    """(markdown summary, full tables) of where our prefill and largest-batch decode spend CPU time."""
    from torch.profiler import ProfilerActivity, profile

    runner.attn_backend = create_attention_backend(args.backends.split(",")[0], runner)
    prompt = list(range(100, 100 + args.prefill_len))
    driver = DirectDriver(runner)
    req = driver.new_request()
    with profile(activities=[ProfilerActivity.CPU]) as prefill_prof:
        driver.extend([req], [prompt])
    driver.release([req])
    batch = max(int(b) for b in args.batches.split(","))
    driver, reqs, _ = fill_context(runner, hf, batch, args.context)
    driver.decode(reqs, [17] * batch)
    with profile(activities=[ProfilerActivity.CPU]) as decode_prof:
        for _ in range(3):
            driver.decode(reqs, [17] * batch)
    driver.release(reqs)
    runs = ((f"prefill of {args.prefill_len} tokens", prefill_prof),
            (f"decode, batch {batch}, context {args.context}", decode_prof))
    summary = [f"Where our time goes (torch.profiler, backend `{args.backends.split(',')[0]}`, "
               f"{torch.get_num_threads()} threads, share of self CPU time):", ""]
    for title, prof in runs:
        events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        total = sum(e.self_cpu_time_total for e in events) or 1
        top = ", ".join(f"`{e.key}` {100 * e.self_cpu_time_total / total:.0f}%" for e in events[:6])
        matmuls = sum(e.self_cpu_time_total for e in events if e.key in MATMUL_OPS) / total
        attention = sum(e.self_cpu_time_total for e in events if e.key in ATTENTION_OPS) / total
        summary.append(f"- {title}: {top}; all matrix products {100 * matmuls:.0f}%, attention "
                       f"{100 * attention:.0f}%")
    tables = "\n\n".join(f"{title}\n" + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
                         for title, prof in runs)
    return "\n".join(summary) + "\n", tables


Row = tuple[str, int, dict[str, float]]  # workload, threads, tokens/s per engine
MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear"}
ATTENTION_OPS = {"radixserve::decode_attention_cpu", "radixserve::extend_attention_cpu",
                 "radixserve::prefix_attention_cpu", "aten::_scaled_dot_product_flash_attention_for_cpu"}
NOTES = """Backends: `torch` is plain torch (one `index_select` gather of all requests' K/V per layer, then
batched matmuls); `cpu` is the same with the C attention kernels this CPU class selects (decode
everywhere, extend where it beat SDPA; docs/attention.md, "Kernel levels"), which read each request's
slots in place, with no gather. Prefill is matrix products plus
`scaled_dot_product_attention`, the same kernels transformers calls, so the two run level (within
the noise of this machine). Decode at batch 1 is bound by reading the 270 MB of bf16 weights per step
(matrix-vector products); at larger batches the KV side decides: a transformers decode step at batch
32 spends about 85% of its time in torch's bf16 SDPA kernel and 6% concatenating its cache (profiled
the same way), while ours reads the KV pool once per layer. On this shared 2-core machine two
OpenMP threads often lose to one: when another process holds a core, the threads spin-wait on each
other, so the 2-thread rows swing with the load."""


def render(rows: list[Row], args: argparse.Namespace, load: tuple[float, float], notes: str = "") -> str:
    names = list(rows[0][2])
    ours = [n for n in names if n != "transformers"] if "transformers" in names else []
    lines = [
        "## Forward pass: radixserve vs transformers (`benchmarks/bench_forward.py`)",
        "",
        f"Model: {'embedded SmolLM2-135M-Instruct (GGUF Q4_1, dequantised)' if args.model_path is None else args.model_path}"
        f"; both engines run the same weights. {cpu_header(args.dtype)}. torch {torch.__version__}, transformers "
        f"{_transformers_version()}. "
        f"Load average {load[0]:.1f} at start, {load[1]:.1f} at end: the machine is shared, so rounds "
        "alternate between the engines and the table shows the median round. Decode contexts hold random K/V.",
        "",
        f"Command: `python benchmarks/bench_forward.py --dtype {args.dtype} --prefill-len {args.prefill_len} "
        f"--context {args.context} --batches {args.batches} --steps {args.steps} --rounds {args.rounds} "
        f"--backends {args.backends}" + (f" --threads {args.threads}" if args.threads else "")
        + (" --only-ours`" if args.only_ours else "`"),
        "",
        "| " + " | ".join(["workload", "threads", *(f"{n} tok/s" for n in names),
                             *(f"{n.split(' ')[-1]} / transformers" for n in ours)]) + " |",
        "|---|---:|" + "---:|" * (len(names) + len(ours)),
    ]
    for workload, threads, tps in rows:
        cells = [f"{tps[n]:.1f}" for n in names] + [f"{tps[n] / tps['transformers']:.2f}x" for n in ours]
        lines.append(f"| {workload} | {threads} | " + " | ".join(cells) + " |")
    lines += ["", f"![forward throughput]({PLOT.name})", "", NOTES, "", notes]
    return "\n".join(lines)


def write_docs(section: str) -> None:
    write_doc_section(DOCS, BEGIN, END, section)


def plot(rows: list[Row]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rows[0][2])
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        xs = [x + (i - (len(names) - 1) / 2) * width for x in range(len(rows))]
        ax.bar(xs, [r[2][name] for r in rows], width=width, label=name)
    labels = [_short_label(r) for r in rows]
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("tokens / s (log)")
    ax.set_title("SmolLM2-135M forward throughput, context 1024 for decode", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(PLOT, dpi=120)


def _short_label(row: Row) -> str:
    workload = row[0].split(" ctx=")[0].replace("decode ", "decode\n")
    return f"{workload}\n{row[1]} thread(s)"


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def main() -> None:
    args = parse_args()
    print(cpu_header(args.dtype), flush=True)
    load_start = os.getloadavg()[0]
    runner, hf, batches = build_engines(args)
    rows: list[Row] = []
    for threads in [int(t) for t in args.threads.split(",") if t] or [torch.get_num_threads()]:
        torch.set_num_threads(threads)
        rows.append((f"prefill {args.prefill_len}", threads, bench_prefill(runner, hf, args)))
        print(_line(rows[-1]), flush=True)
        for batch in batches:
            rows.append((f"decode bs={batch} ctx={args.context}", threads, bench_decode(runner, hf, batch, args)))
            print(_line(rows[-1]), flush=True)
    notes, tables = profile_ours(runner, hf, args) if args.profile else ("", "")
    section = render(rows, args, (load_start, os.getloadavg()[0]), notes)
    print("\n" + section)
    if tables:
        print(tables)
    if not args.no_docs:
        write_docs(section)
        plot(rows)
        print(f"wrote {DOCS} and {PLOT}", file=sys.stderr)


def _line(row: Row) -> str:
    return f"{row[0]} ({row[1]} threads): " + ", ".join(f"{n} {v:.1f} tok/s" for n, v in row[2].items())


if __name__ == "__main__":
    main()
