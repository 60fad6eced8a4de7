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
    p.add_argument("--no-docs", action="store_true")
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)
    return p.parse_args()


def worker(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_speculative import measure, workloads

    from radixserve import Engine

    engine = Engine(log_level="warning", dtype=args.dtype, speculative_num_draft_tokens=args.num_draft_tokens,
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
    runs: dict[tuple[str, int, str], list[dict]] = {}
    for r in range(args.rounds):
        for mode in (MODES if r % 2 == 0 else reversed(list(MODES))):
            out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--worker", mode], env=env, check=True,
                                 capture_output=True, text=True).stdout
            for line in out.splitlines():
                if line.startswith("{"):
                    rec = json.loads(line)
                    runs.setdefault((rec["workload"], rec["bs"], mode), []).append(rec)
                    print(f"round {r + 1} {mode} {rec['workload']} bs={rec['bs']}: {rec['result'][0]:.1f} tok/s, "
                          f"accept {rec['result'][1]:.2f}, {rec['result'][2]:.2f} tokens/verify", flush=True)
    os.environ.update(env)
    header = cpu_header(args.dtype)
    body = report(runs, args, header)
    print(body)
    if not args.no_docs:
        tag = "".join(f"_{t}" for t in (args.cpu_class, args.dtype if args.dtype != "auto" else "") if t)
        write_doc_section(DOCS, f"<!-- bench_draft_model{tag}:begin -->", f"<!-- bench_draft_model{tag}:end -->", body)


def report(runs: dict, args: argparse.Namespace, header: str) -> str:
    keys = sorted({(w, bs) for w, bs, _ in runs}, key=lambda k: (k[1], list(runs).index((k[0], k[1], "off"))))
    lines = [f"## Draft model against n-gram drafts, served in {args.dtype}"
             f"{f' ({args.cpu_class} class)' if args.cpu_class else ''} "
             "(`benchmarks/bench_draft_model.py`)", "", header, "",
             f"Command: `python benchmarks/bench_draft_model.py --max-new-tokens {args.max_new_tokens} --rounds "
             f"{args.rounds} --batch-sizes {args.batch_sizes} --num-draft-tokens {args.num_draft_tokens} --dtype {args.dtype}"
             f"{' --class ' + args.cpu_class if args.cpu_class else ''}`. Embedded SmolLM2-135M served with `--dtype "
             f"{args.dtype}`, the draft in `auto`'s dtype, greedy; "
             "medians of the rounds. Draft share: the draft model's forwards over the batch's wall time.", "",
             "| workload | batch | mode | tok/s | vs off | accept rate | tokens / verify | draft share | output |",
             "|---|---:|---|---:|---:|---:|---:|---:|---|"]
    for name, bs in keys:
        off = statistics.median(rec["result"][0] for rec in runs[(name, bs, "off")])
        digest = runs[(name, bs, "off")][0]["result"][3]
        for mode in MODES:
            recs = runs[(name, bs, mode)]
            speed = statistics.median(rec["result"][0] for rec in recs)
            accept = statistics.median(rec["result"][1] for rec in recs)
            per_verify = statistics.median(rec["result"][2] for rec in recs)
            share = statistics.median(rec["draft_s"] / rec["wall"] for rec in recs)
            same = all(rec["result"][3] == digest for rec in recs)
            lines.append(f"| {name} | {bs} | {mode} | {speed:.1f} | {speed / off:.2f}x | "
                         f"{accept:.2f} | {per_verify:.2f} | {share:.0%} | {'same' if same else 'DIFFERS'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
