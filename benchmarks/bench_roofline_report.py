"""bench_roofline.py's markdown: the figures against their roofline, and where a decode step's time goes."""

from __future__ import annotations

import argparse
import platform

LAYER_PARTS = ("GEMM", "attention", "KV write", "fused ops")  # what the C decoder does, told apart by python-layers


def render(results: list[dict], args: argparse.Namespace, load: tuple[float, float]) -> str:
    import torch

    command = (f"python benchmarks/bench_roofline.py --classes {args.classes} --dtypes {args.dtypes} --batches "
               f"{args.batches} --prefills {args.prefills} --new-tokens {args.new_tokens} --reps {args.reps}"
               + (" --trace" if args.trace else "") + (f" --threads {args.threads}" if getattr(args, "threads", None) else "")
               + (f" --server-args '{args.server_args}'" if args.server_args else ""))
    lines = ["## Decode and prefill against the roofline (`benchmarks/bench_roofline.py`)", "",
             f"Model: embedded SmolLM2-135M-Instruct. Python {platform.python_version()}, torch {torch.__version__}, "
             f"{getattr(args, 'threads', None) or torch.get_num_threads()} threads; load average {load[0]:.1f} at start, {load[1]:.1f} at end (the machine "
             "is shared). Each class and dtype in its own process: the roofline's rates measured first (read bandwidth "
             "of torch.mv over 1 GiB; torch's GEMM rate in the compute dtype on one decoder layer's shapes at 512 rows), "
             "then the offline Engine (default loop): decode of 100-token prompts, prefill of one cold prompt, medians "
             "of the reps. A figure's bound is max(bytes / bandwidth, FLOPs / GEMM rate) of its own steps "
             "(radixserve/bench/roofline.py: weights read once per step at their stored dtype, KV read and written at the "
             "cache's, the LM head on sampled rows, attention FLOPs); `of bound` is the measured speed over it.", "",
             f"Command: `{command}`", ""]
    for result in results:
        lines += [f"**{result['class']}, `--dtype {result['dtype']}`**: {result['header']}. Rates: {result['rates']}; "
                  f"formats: {result['formats']}; {result['setup']}.", ""]
    lines += ["| class | --dtype | figure | tok/s | bound tok/s (limit) | of bound | step ms | bound: memory / compute ms "
              "per step | CPU busy |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for result in results:
        for row in result["rows"]:
            figure = f"decode bs={row['size']}" if row["kind"] == "decode" else f"prefill {row['size']}"
            step = f"{row['step_ms']:.1f}" if "step_ms" in row else f"{1e3 * row['size'] / row['tok_s']:.0f}"
            busy = f"{row['cpu_busy']:.0%}" if "cpu_busy" in row else "-"
            lines.append(f"| {result['class']} | {result['dtype']} | {figure} | {row['tok_s']:.1f} | "
                         f"{row['bound_tok_s']:.0f} ({row['limit']}) | {row['tok_s'] / row['bound_tok_s']:.0%} | {step} | "
                         f"{row['memory_ms']:.1f} / {row['compute_ms']:.1f} | {busy} |")
    if any(r["traces"] for r in results):
        lines += ["", trace_table(results)]
    return "\n".join(lines)


def trace_table(results: list[dict]) -> str:
    """Per batch size: the Engine's step, the runner's own step split by category, the scheduler's share."""
    lines = ["Where a decode step's time goes (ms per step; the runner's step profiled alone at the decode's mean "
             "context with greedy sampling, torch.profiler self times; `decoder layers` is the C decoder, split "
             "into products / attention / passes in the proportions of the `python-layers` path, which runs the same "
             "kernels one call at a time; `Python` is the runner step's wall no op accounts for; `scheduler & idle` "
             "is the Engine's step period less the runner's step; `CPU busy` the process's CPU time over the decode's "
             "wall x threads):", "",
             "| class | --dtype | bs | Engine step | runner step | decoder layers: products / attention / passes | "
             "LM head | sampling | other ops | Python | scheduler & idle | CPU busy |",
             "|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for result in results:
        engine = {r["size"]: r for r in result["rows"] if r["kind"] == "decode"}
        by = {(t["size"], t["path"]): t for t in result["traces"]}
        for (size, path), trace in by.items():
            if path != "after":
                continue
            ms, layers = trace["ms"], trace["ms"]["C decoder"]
            split = by.get((size, "python-layers"))
            parts = "-"
            if layers and split:
                total = sum(split["ms"][p] for p in LAYER_PARTS) or 1.0
                products, attention = (layers * split["ms"][p] / total for p in ("GEMM", "attention"))
                parts = f"{layers:.1f}: {products:.1f} / {attention:.1f} / {layers - products - attention:.1f}"
            elif ms["GEMM"]:
                parts = f"(Python layers) {ms['GEMM']:.1f} / {ms['attention']:.1f} / {ms['fused ops'] + ms['KV write']:.1f}"
            row = engine.get(size)
            period = row["step_ms"] if row else None
            rest = "-" if period is None else f"{period - trace['step_ms']:.1f}"
            lines.append(f"| {result['class']} | {result['dtype']} | {size} | "
                         f"{'-' if period is None else f'{period:.1f}'} | {trace['step_ms']:.1f} | {parts} | "
                         f"{ms['LM head']:.1f} | {ms['sampling']:.2f} | {ms['other ops']:.1f} | "
                         f"{ms['Python & dispatch']:.1f} | {rest} | "
                         f"{'-' if row is None else format(row['cpu_busy'], '.0%')} |")
    return "\n".join(lines)
