"""Decode speed with the KV cache in the compute dtype against a bf16 cache (--kv-cache-dtype bfloat16), where
`--dtype auto` computes in float32 (CPUs without native bf16 products: the AVX2 class, AVX-512 without BF16).

A float32 cache costs SmolLM2-135M 46 KB of K/V per token (30 layers x 3 kv heads x 64 x 2 x 4 bytes), so at 1,000
tokens of context a decode step reads about as many bytes of K/V as of int4 weights; bf16 halves them. For each
CPU class (run as that class: our kernels and torch's), one worker process builds both runners and, per case
(weights x batch x context), alternates them round by round (medians, each round's own ratio).

    python benchmarks/bench_kv_cache_dtype.py --classes avx2,avx512             # table + plot + docs section
    python benchmarks/bench_kv_cache_dtype.py --classes avx2 --contexts 256,2048 --rounds 3 --no-docs
    python benchmarks/bench_kv_cache_dtype.py --accuracy      # greedy agreement with a float32 cache

`--accuracy` (float32 compute): prompts cut from this repository's own docs (English and Markdown, --contexts tokens
each) are decoded greedily with float32 weights and a float32 cache; a bf16 cache, bf16 weights (what `--dtype auto`
keeps on these CPUs) and both together decode the same tokens (teacher forcing), and each step compares them with
the reference: the same top-1 token, the KL divergence of the next-token distributions, the largest logit
difference; and the first step where a variant's own greedy answer would part from the reference's.
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
ACCURACY_DOC = ROOT / "docs" / "kv_cache_dtype.md"
ACC_BEGIN, ACC_END = "<!-- kv_cache_dtype_accuracy:begin -->", "<!-- kv_cache_dtype_accuracy:end -->"
PLOT = ROOT / "docs" / "bench_kv_cache_dtype.png"
BEGIN, END = "<!-- bench_kv_cache_dtype:begin -->", "<!-- bench_kv_cache_dtype:end -->"
CACHES = ("float32", "bfloat16")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--classes", default="avx2", help="CPU classes to run as (bench/docs.class_env)")
    p.add_argument("--weights", default="int4,auto", help="int4 (the shipped Q4_1 blocks) and/or auto (bf16 "
                   "weights, float32 compute)")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--contexts", default="256,1024,2048,4096")
    p.add_argument("--steps", type=int, default=24, help="decode steps timed per case and round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--accuracy", action="store_true", help="greedy agreement instead of speed (see above)")
    p.add_argument("--prompts", type=int, default=6, help="--accuracy: prompts per context length")
    p.add_argument("--no-docs", action="store_true")
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def worker(args: argparse.Namespace) -> None:
    """One class, one weights choice: both caches' runners in this process; prints one JSON line per case."""
    import torch
    from direct import DirectDriver

    from radixserve.model_executor.model_runner import ModelRunner
    from radixserve.server_args import ServerArgs

    torch.set_num_threads(args.threads)
    batches, contexts = _ints(args.batches), _ints(args.contexts)
    pool = max(b * (c + args.rounds * args.steps + 2) for b in batches for c in contexts) + 64
    weights = {"quantization": "int4"} if args.worker == "int4" else {}
    runners = {kv: ModelRunner(ServerArgs(dtype="auto", max_total_tokens=pool, kv_cache_dtype=kv, log_level="warning",
                                          **weights)) for kv in CACHES}
    assert runners["float32"].dtype == torch.float32, "a bf16 cache is for float32 compute; this class computes in bf16"
    prompt = [(i * 7919) % 40000 + 100 for i in range(max(contexts))]

    def prefilled(runner: ModelRunner, bs: int, context: int) -> tuple[DirectDriver, list, list[int]]:
        driver = DirectDriver(runner)
        reqs = [driver.new_request() for _ in range(bs)]
        for req in reqs:
            driver.extend([req], [prompt[:context]])
        return driver, reqs, driver.decode(reqs, [5] * bs).argmax(-1).tolist()  # a first step, untimed

    def decode_rate(driver: DirectDriver, reqs: list, tokens: list[int]) -> tuple[float, list[int]]:
        start = time.perf_counter()
        for _ in range(args.steps):
            tokens = driver.decode(reqs, tokens).argmax(-1).tolist()
        return len(reqs) * args.steps / (time.perf_counter() - start), tokens

    decoders = {kv: runner.execution_plan.decoder for kv, runner in runners.items()}
    assert decoders["float32"] == decoders["bfloat16"], decoders  # NOTE: the same decoder, or the ratio is not the cache's
    for bs in batches:
        for context in contexts:
            # NOTE: each runner's requests are prefilled once; rounds then alternate their decode steps (a round adds
            # `steps` tokens of context to each, the same for both)
            state = {kv: prefilled(runners[kv], bs, context) for kv in CACHES}
            rounds: dict[str, list[float]] = {kv: [] for kv in CACHES}
            for r in range(args.rounds):
                for kv in CACHES if r % 2 == 0 else reversed(CACHES):  # NOTE: alternate which goes first
                    driver, reqs, tokens = state[kv]
                    rate, tokens = decode_rate(driver, reqs, tokens)
                    state[kv] = (driver, reqs, tokens)
                    rounds[kv].append(rate)
            for driver, _, _ in state.values():
                driver.release_all()
            print(json.dumps({"bs": bs, "context": context, "decoder": decoders["float32"], **rounds}), flush=True)


def run_class(cpu_class: str, weights: str, args: argparse.Namespace) -> list[dict]:
    from radixserve.bench.docs import class_env

    cmd = [sys.executable, __file__, "--worker", weights, "--batches", args.batches, "--contexts", args.contexts,
           "--steps", str(args.steps), "--rounds", str(args.rounds), "--threads", str(args.threads)]
    env = {**os.environ, **class_env(cpu_class), "PYTHONPATH": f"{ROOT}/benchmarks:{ROOT}"}
    rows = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env) as proc:
        for line in proc.stdout:
            rows.append({"class": cpu_class, "weights": weights, **json.loads(line)})
            row = rows[-1]
            print(f"[{cpu_class} {weights}] bs {row['bs']} ctx {row['context']}: "
                  f"{statistics.median(row['float32']):.1f} -> {statistics.median(row['bfloat16']):.1f} tok/s", flush=True)
    if proc.returncode:
        raise SystemExit(f"worker for {cpu_class}/{weights} failed ({proc.returncode})")
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| class | weights | decoder | batch | context | float32 cache tok/s | bf16 cache tok/s | speed-up (median of rounds) "
             "| rounds' range |", "|---|---|---|---:|---:|---:|---:|---:|---|"]
    for row in rows:
        ratios = [b / a for a, b in zip(row["float32"], row["bfloat16"], strict=True)]
        lines.append(f"| {row['class']} | {row['weights']} | {row['decoder']} | {row['bs']} | {row['context']} | "
                     f"{statistics.median(row['float32']):.1f} | {statistics.median(row['bfloat16']):.1f} | "
                     f"**{statistics.median(ratios):.2f}x** | {min(ratios):.2f}-{max(ratios):.2f} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path = PLOT) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for key in sorted({(r["class"], r["weights"], r["bs"]) for r in rows}):
        case = [r for r in rows if (r["class"], r["weights"], r["bs"]) == key]
        ax.plot([r["context"] for r in case],
                [statistics.median(b / a for a, b in zip(r["float32"], r["bfloat16"], strict=True)) for r in case],
                marker="o", label=f"{key[0]} {key[1]} batch {key[2]}")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context tokens per request")
    ax.set_ylabel("decode tok/s, bf16 cache / float32 cache")
    ax.set_title("SmolLM2-135M decode, float32 compute: a bf16 KV cache")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


VARIANTS = {  # --accuracy: each against float32 weights and a float32 cache (ServerArgs keywords)
    "bf16 cache": {"kv_cache_dtype": "bfloat16"},
    "bf16 weights": {"linear_method": "bf16_weights", "kv_cache_dtype": "float32"},
    "bf16 weights + bf16 cache": {"linear_method": "bf16_weights", "kv_cache_dtype": "bfloat16"},
}


def accuracy(args: argparse.Namespace) -> str:
    """Teacher-forced agreement with float32 weights and cache under float32 compute (see the docstring)."""
    import torch
    from direct import DirectDriver

    from radixserve.model_executor.model_runner import ModelRunner
    from radixserve.server_args import ServerArgs

    torch.set_num_threads(args.threads)
    contexts = _ints(args.contexts)
    pool = max(contexts) + args.steps + 8
    configs = {"reference": {"kv_cache_dtype": "float32"}, **VARIANTS}
    runners = {name: ModelRunner(ServerArgs(dtype="float32", max_total_tokens=pool, log_level="warning", **kw))
               for name, kw in configs.items()}
    text = "\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    ids = runners["reference"].tokenizer.encode(text)
    lines = ["| against float32 weights and cache | context | prompts x steps | same top-1 token | mean KL (nats) "
             "| max KL | max logit difference | free greedy answers identical | first parting step (median of those "
             "that part) |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for context in contexts:
        stats = {name: {"same": 0, "kl": [], "diff": [], "identical": 0, "parts": []} for name in VARIANTS}
        for i in range(args.prompts):
            start = (i * 7919 * (1 + context // 256)) % (len(ids) - context)
            prompt = ids[start : start + context]
            drivers = {name: DirectDriver(runner) for name, runner in runners.items()}
            reqs = {name: driver.new_request() for name, driver in drivers.items()}
            logits = {name: drivers[name].extend([reqs[name]], [prompt])[0] for name in runners}
            parted: dict[str, int | None] = dict.fromkeys(VARIANTS)  # NOTE: where its free greedy answer parts
            for step in range(args.steps):
                ref = logits["reference"].float()
                token = int(ref.argmax())
                for name, st in stats.items():
                    other = logits[name].float()
                    st["same"] += int(other.argmax()) == token
                    st["kl"].append(float(torch.sum(ref.softmax(-1) * (ref.log_softmax(-1) - other.log_softmax(-1)))))
                    st["diff"].append(float((ref - other).abs().max()))
                    if parted[name] is None and int(other.argmax()) != token:
                        parted[name] = step
                logits = {name: drivers[name].decode([reqs[name]], [token])[0] for name in runners}
            for name, st in stats.items():
                st["identical"] += parted[name] is None
                st["parts"] += [] if parted[name] is None else [parted[name]]
            for driver in drivers.values():
                driver.release_all()
        n = args.prompts * args.steps
        for name, st in stats.items():
            parting = f"{statistics.median(st['parts']):g}" if st["parts"] else "-"
            lines.append(f"| {name} | {context} | {args.prompts} x {args.steps} | {st['same'] / n:.1%} | "
                         f"{statistics.mean(st['kl']):.2e} | {max(st['kl']):.2e} | {max(st['diff']):.3f} | "
                         f"{st['identical']}/{args.prompts} | {parting} |")
    cmd = "python benchmarks/bench_kv_cache_dtype.py " + " ".join(sys.argv[1:])
    from radixserve.bench.docs import cpu_header

    return "\n".join([f"Measured with `{cmd}` ({cpu_header()}; SmolLM2-135M, float32 compute; the prompts are "
                      "cut from this repository's docs):", "", *lines])


def main() -> None:
    args = parse_args()
    if args.worker:
        return worker(args)
    if args.accuracy:
        body = accuracy(args)
        print(body)
        if not args.no_docs:
            from radixserve.bench.docs import write_doc_section

            write_doc_section(ACCURACY_DOC, ACC_BEGIN, ACC_END, body)
        return None
    from radixserve.bench.docs import class_env, cpu_header

    load = [os.getloadavg()[0]]
    rows = [row for cpu_class in args.classes.split(",") for weights in args.weights.split(",")
            for row in run_class(cpu_class, weights, args)]
    load.append(os.getloadavg()[0])
    cmd = "python benchmarks/bench_kv_cache_dtype.py " + " ".join(sys.argv[1:])
    body = "\n".join([
        "## KV cache in bf16 under float32 compute (`--kv-cache-dtype bfloat16`)", "",
        f"{cpu_header()}. Classes forced with " + "; ".join(
            f"{c}: `{' '.join(f'{k}={v}' for k, v in class_env(c).items())}`" for c in args.classes.split(","))
        + f". torch {__import__('torch').__version__}, {args.threads} threads; load average "
        f"{load[0]:.2f} -> {load[1]:.2f}. Command: `{cmd}`.", "",
        "SmolLM2-135M, decode tokens/s after `context` tokens per request; each class run as that class (our "
        "kernels and torch's), both caches in one process, alternating every round; speed-up = the median of the "
        f"rounds' own ratios over {args.rounds} rounds of {args.steps} steps.", "", table(rows), "",
        "![bf16 KV cache](bench_kv_cache_dtype.png)"])
    print(body)
    if not args.no_docs:
        from radixserve.bench.docs import write_doc_section

        write_doc_section(DOCS, BEGIN, END, body)
        plot(rows)


if __name__ == "__main__":
    main()
