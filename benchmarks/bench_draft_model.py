"""Decode speed with a draft model (`--speculative-algorithm standalone`) against n-gram drafts and no speculation.

The workloads of bench_speculative.py (a code edit, an agent quoting a tool's output, free text), greedy, on the
embedded SmolLM2-135M. There is one real model here, so the draft models are copies of it: the model drafting for
itself (every draft accepted but at ties; a draft token costs what a target step costs, so this is the mechanics'
price, not a speed-up) and its packed int4 copy (`--speculative-draft-model-quantization int4`: a cheaper draft
that mostly agrees with the served model, the setting where a draft model can pay off on text that does not
repeat). Each mode runs in its own process, rounds alternate; before each timed batch the cache is flushed and the
prompts computed, so the figure is decode: output tokens / wall time. Output ids are compared with the run
without speculation.

    python benchmarks/bench_draft_model.py                  # batch 1, 2 rounds; updates docs/benchmarks.md
    python benchmarks/bench_draft_model.py --class avx2     # forced to the AVX2 class
    python benchmarks/bench_draft_model.py --dtype float32  # a float32 model, its int4 copy drafting for it
    python benchmarks/bench_draft_model.py --target smollm2-1.1b-inflated --noise 0,0.3,1  # a ~1.1B target

`--target smollm2-1.1b-inflated` serves a ~1.1B Llama (radixserve/bench/inflate.py) that computes SmolLM2-135M's
function with 8x its weight bytes, so SmolLM2-135M drafts for a target of a real pair's cost ratio; each `--noise`
level writes a target that strays further from it (acceptance falls), giving the speed-up against acceptance.
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
MODES = {"off": {}, "ngram": {"speculative_algorithm": "ngram"},
         "draft: itself": {"speculative_algorithm": "standalone"},
         "draft: its int4 copy": {"speculative_algorithm": "standalone", "speculative_draft_model_quantization": "int4"}}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--batch-sizes", default="1")
    p.add_argument("--num-draft-tokens", type=int, default=6)
    p.add_argument("--dtype", default="auto", help="the served model's --dtype (the draft runs in auto's)")
    p.add_argument("--class", dest="cpu_class", default="", help="force a lower CPU class (avx2, avx512, ...)")
    p.add_argument("--target", default="", help="an inflated target (radixserve/bench/inflate.py) instead of "
                   "the embedded model")
    p.add_argument("--noise", default="0", help="with --target: comma-separated noise levels, one target each")
    p.add_argument("--folders", default=None, help="where the inflated targets go (default: the cache dir)")
    p.add_argument("--no-docs", action="store_true")
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)
    p.add_argument("--model-path", default=None, help=argparse.SUPPRESS)
    return p.parse_args()


def worker(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_speculative import measure, workloads

    from radixserve import Engine

    engine = Engine(args.model_path, log_level="warning", dtype=args.dtype, speculative_num_draft_tokens=args.num_draft_tokens,
                    **MODES[args.worker])
    tok = engine.tokenizer
    drafter = engine.scheduler.decode.drafter
    for name, msgs in workloads(max(int(b) for b in args.batch_sizes.split(","))).items():
        prompts = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in msgs]
        for bs in (int(b) for b in args.batch_sizes.split(",")):
            engine.flush_cache()
            engine.generate(prompts[:bs], {"temperature": 0, "max_new_tokens": 1})
            before, started = getattr(drafter, "seconds", 0.0), time.perf_counter()
            result = measure(engine, prompts[:bs], args.max_new_tokens)
            print(json.dumps({"workload": name, "bs": bs, "result": result, "wall": time.perf_counter() - started,
                              "draft_s": getattr(drafter, "seconds", 0.0) - before}), flush=True)
    engine.shutdown()


def main() -> None:
    args = parse_args()
    if args.worker:
        return worker(args)
    from radixserve.bench.docs import class_env, cpu_header, write_doc_section

    env = {**os.environ, **(class_env(args.cpu_class) if args.cpu_class else {})}
    targets = inflated_targets(args) if args.target else {"": None}
    runs: dict[tuple[str, str, int, str], list[dict]] = {}
    for r in range(args.rounds):
        for label, path in targets.items():
            for mode in (MODES if r % 2 == 0 else reversed(list(MODES))):
                cmd = [sys.executable, __file__, *sys.argv[1:], "--worker", mode, *(["--model-path", path] * bool(path))]
                out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
                for line in out.splitlines():
                    if line.startswith("{"):
                        rec = json.loads(line)
                        runs.setdefault((label, rec["workload"], rec["bs"], mode), []).append(rec)
                        print(f"round {r + 1} {label} {mode} {rec['workload']} bs={rec['bs']}: "
                              f"{rec['result'][0]:.1f} tok/s, accept {rec['result'][1]:.2f}, "
                              f"{rec['result'][2]:.2f} tokens/verify", flush=True)
    os.environ.update(env)
    header = cpu_header(args.dtype)
    body = report(runs, args, header)
    print(body)
    if not args.no_docs:
        tag = "".join(f"_{t}" for t in (args.target and "inflated", args.cpu_class,
                                        args.dtype if args.dtype != "auto" else "") if t)
        write_doc_section(DOCS, f"<!-- bench_draft_model{tag}:begin -->", f"<!-- bench_draft_model{tag}:end -->", body)


def inflated_targets(args: argparse.Namespace) -> dict[str, str]:
    """{"noise 0.3": folder} for each noise level: the inflated target, written on first use."""
    import torch

    from radixserve.bench.inflate import INFLATED, inflate
    from radixserve.model_loader.gguf_loader import cache_root, gguf_to_hf_folder
    from radixserve.models.loader import embedded_model_path

    source = gguf_to_hf_folder(embedded_model_path(), torch.float32)
    root = Path(args.folders) if args.folders else cache_root() / "inflated"
    return {f"noise {n}": str(inflate(source, root / f"{args.target}-noise{n}", INFLATED[args.target], float(n)))
            for n in args.noise.split(",")}


def mode_label(mode: str, args: argparse.Namespace) -> str:
    if not args.target:
        return mode
    return mode.replace("itself", "SmolLM2-135M").replace("its int4 copy", "SmolLM2-135M int4")


def report(runs: dict, args: argparse.Namespace, header: str) -> str:
    keys = sorted({(t, w, bs) for t, w, bs, _ in runs},
                  key=lambda k: (k[2], list(runs).index((k[0], k[1], k[2], "off"))))
    served = f"`{args.target}` (SmolLM2-135M's function at 8x its weight bytes)" if args.target else \
        "Embedded SmolLM2-135M"
    command = " ".join(sys.argv[1:])
    lines = [f"## Draft model against n-gram drafts, served in {args.dtype}"
             f"{', on an inflated ~1.1B target' if args.target else ''}"
             f"{f' ({args.cpu_class} class)' if args.cpu_class else ''} "
             "(`benchmarks/bench_draft_model.py`)", "", header, "",
             f"Command: `python benchmarks/bench_draft_model.py {command}`. {served} served with `--dtype "
             f"{args.dtype}`, the draft in `auto`'s dtype, greedy, {args.num_draft_tokens} draft tokens at most; "
             "medians of the rounds. Draft share: the draft model's forwards over the batch's wall time.", "",
             "| target | workload | batch | mode | tok/s | vs off | accept rate | tokens / verify | draft share | output |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|---|"]
    for target, name, bs in keys:
        off = statistics.median(rec["result"][0] for rec in runs[(target, name, bs, "off")])
        digest = runs[(target, name, bs, "off")][0]["result"][3]
        for mode in MODES:
            recs = runs[(target, name, bs, mode)]
            speed = statistics.median(rec["result"][0] for rec in recs)
            accept = statistics.median(rec["result"][1] for rec in recs)
            per_verify = statistics.median(rec["result"][2] for rec in recs)
            share = statistics.median(rec["draft_s"] / rec["wall"] for rec in recs)
            same = all(rec["result"][3] == digest for rec in recs)
            lines.append(f"| {target or 'embedded'} | {name} | {bs} | {mode_label(mode, args)} | {speed:.1f} | "
                         f"{speed / off:.2f}x | {accept:.2f} | {per_verify:.2f} | {share:.0%} | "
                         f"{'same' if same else 'DIFFERS'} |")
    if args.target and not args.no_docs:
        plot(runs, args, DOCS.with_name("bench_draft_model_inflated.png"))
        lines += ["", "![draft model speed-up against acceptance](bench_draft_model_inflated.png)"]
    return "\n".join(lines)


def plot(runs: dict, args: argparse.Namespace, path: Path) -> None:
    """Speed-up over no speculation against the accept rate, one line per workload and mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bs = min(b for _, _, b, _ in runs)  # NOTE: the smallest batch of the run (the plot's points are one batch size)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name in dict.fromkeys(w for _, w, _, _ in runs):
        for mode, marker in zip((m for m in MODES if m != "off"), "os^", strict=True):
            points = []
            for target in dict.fromkeys(t for t, w, _, _ in runs if w == name):
                off = statistics.median(r["result"][0] for r in runs[(target, name, bs, "off")])
                recs = runs.get((target, name, bs, mode), [])
                if recs:
                    points.append((statistics.median(r["result"][1] for r in recs),
                                   statistics.median(r["result"][0] for r in recs) / off))
            points.sort()
            ax.plot([p[0] for p in points], [p[1] for p in points], marker=marker,
                    label=f"{name}, {mode_label(mode, args)}")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("draft tokens accepted (fraction)")
    ax.set_ylabel(f"decode tok/s vs no speculation (batch {bs})")
    ax.set_title(f"{args.target}: one point per noise level")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
