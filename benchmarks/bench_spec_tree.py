"""Would a token tree beat a chain? The ceiling of tree verification for n-gram drafts, measured.

A chain verifies one continuation per request: the tokens after the latest earlier occurrence of its last n
tokens. A token tree would verify several (the continuations of other occurrences, as branches sharing their
common first tokens) in the same forward, under a tree attention mask, and keep the longest accepted path.
It yields more tokens per verify step only where a later-than-latest occurrence would have been right, and it
always costs more rows.

This benchmark answers it in two measured halves, without building the tree into the scheduler:
1. Acceptance: the workloads of bench_speculative.py are answered greedily (speculation off: the tokens every
   exact method must reproduce), then each drafter is replayed over them, step by step, exactly as the engine
   drafts (the shipped `NgramIndex` for the chain and as every tree's first branch, `DraftBudget` for its
   length): tokens yielded and rows run per verify step, per request.
2. Cost: the time of a verify step of R rows of one request (a decode-shaped forward, R = 1 .. the most any
   drafter ran), measured on this machine with the model runner, alternating R within each round.
Their product is each drafter's batch-1 decode rate; a tree's rows cost what a chain's do (the same kernels
with a mask), so the estimate is the tree's best case. Batch 1 is where rows are cheapest; at larger batches
rows cost more and a tree can only do worse.

    python benchmarks/bench_spec_tree.py                 # native class, updates docs/benchmarks.md
    python benchmarks/bench_spec_tree.py --class avx2    # forced to the AVX2 class (kernels and torch)
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
BEGIN, END = "<!-- bench_spec_tree:begin -->", "<!-- bench_spec_tree:end -->"
# (branches, tokens per extra branch): a chain is (1, 0)
TREES = [(1, 0), (2, 1), (2, 2), (3, 2), (2, 6), (3, 6)]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=8, help="requests per workload")
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument("--num-draft-tokens", type=int, default=6, help="K: the chain's and each tree's first branch's")
    p.add_argument("--rounds", type=int, default=5, help="rounds of the step-time measurement")
    p.add_argument("--class", dest="cpu_class", default="", help="force a lower CPU class (avx2, avx512, ...)")
    p.add_argument("--no-docs", action="store_true")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args()


# ---- acceptance: replaying drafters over greedy answers ---------------------------------------------------------
def continuations(tokens: list[int], k: int, branches: int, min_match: int = 2, max_match: int = 8) -> list[list[int]]:
    """Up to `branches` continuations of earlier occurrences of the sequence's suffix, with distinct first tokens:
    the longest suffix's latest occurrence first (the chain's draft), then later-found ones, longest suffix first."""
    end, out = len(tokens), []
    for n in range(max_match, min_match - 1, -1):
        if n > end - 1:
            continue
        suffix = tokens[end - n:]
        for e in range(end - 1, n - 1, -1):  # NOTE: ends before `end`: the suffix does not match itself
            if tokens[e - n: e] == suffix and all(tokens[e] != c[0] for c in out):
                out.append(tokens[e: e + k])
                if len(out) == branches:
                    return out
    return out


def tree_rows(paths: list[list[int]]) -> int:
    """Rows of a verify step of these branches: one per distinct tree node, plus the request's last token."""
    return 1 + len({tuple(p[:i]) for p in paths for i in range(1, len(p) + 1)})


def replay(prompt: list[int], answer: list[int], k: int, shape: tuple[int, int]) -> list[tuple[int, int]]:
    """(rows, tokens yielded) of each decode step of one request, drafting as the engine does."""
    from radixserve.speculative.ngram import DraftBudget, NgramIndex

    branches, extra = shape
    index, budget = NgramIndex(2, 8), DraftBudget(k)
    index.extend(prompt)
    steps, i = [], 0
    while i < len(answer):
        budget.tick()
        length = min(budget.next_length(), len(answer) - i - 1)
        chain = index.propose(length) if length > 0 else []
        paths = []
        if chain:
            found = continuations(index.tokens, length, branches)
            assert found[0] == chain, "the replay's first branch must be the shipped drafter's chain"
            paths = [chain] + [c[:extra] for c in found[1:]]
        best = max((_matched(p, answer[i:]) for p in paths), default=0)
        if paths:
            budget.record(len(chain), min(best, len(chain)))
        steps.append((tree_rows(paths), best + 1))
        index.extend(answer[i: i + best + 1])
        i += best + 1
    return steps


def _matched(path: list[int], truth: list[int]) -> int:
    n = 0
    while n < len(path) and n < len(truth) and path[n] == truth[n]:
        n += 1
    return n


# ---- cost: the verify step's time by rows -----------------------------------------------------------------------
def step_seconds(max_rows: int, context: int, rounds: int) -> dict[int, float]:
    """Median seconds of a decode-shaped forward of R rows of one request over `context` cached tokens."""
    import torch
    from direct import DirectDriver

    from radixserve.forward_batch import ForwardBatch
    from radixserve.model_executor.model_runner import ModelRunner
    from radixserve.server_args import ServerArgs

    runner = ModelRunner(ServerArgs(dtype="auto", max_total_tokens=context + 4 * max_rows, log_level="warning"))
    driver = DirectDriver(runner)
    req = driver.new_request()
    gen = torch.Generator().manual_seed(0)
    vocab = runner.model_config.vocab_size
    driver.extend([req], [torch.randint(0, vocab, (context,), generator=gen).tolist()])
    allocator, table = runner.token_to_kv_pool_allocator, runner.req_to_token_pool.req_to_token
    times: dict[int, list[float]] = {r: [] for r in range(1, max_rows + 1)}
    for rnd in range(rounds + 1):  # NOTE: round 0 warms every row count up and is not counted
        for rows in range(1, max_rows + 1):
            slots = allocator.alloc(rows)
            table[req.row, context: context + rows] = slots
            fb = ForwardBatch.for_decode(torch.randint(0, vocab, (rows,), generator=gen).tolist(),
                                         [req.row] * rows, list(range(context + 1, context + rows + 1)), slots,
                                         runner.device)
            started = time.perf_counter()
            runner.forward(fb)
            if rnd:
                times[rows].append(time.perf_counter() - started)
            allocator.free(slots)
    driver.release_all()
    return {r: statistics.median(t) for r, t in times.items()}


def worker(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_speculative import workloads

    from radixserve import Engine

    engine = Engine(dtype="auto", log_level="warning")
    tok = engine.tokenizer
    answers = {}
    for name, msgs in workloads(args.prompts).items():
        prompts = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in msgs]
        outs = engine.generate(prompts, {"temperature": 0, "max_new_tokens": args.max_new_tokens})
        answers[name] = [(tok.encode(p), o["output_ids"]) for p, o in zip(prompts, outs, strict=True)]
        print(f"answered {name}", file=sys.stderr, flush=True)
    engine.shutdown()
    steps = {name: {str(shape): [s for p, a in pairs for s in replay(p, a, args.num_draft_tokens, shape)]
                    for shape in TREES} for name, pairs in answers.items()}
    max_rows = max(r for per in steps.values() for ss in per.values() for r, _ in ss)
    context = int(statistics.median(len(p) + len(a) // 2 for pairs in answers.values() for p, a in pairs))
    print(f"timing verify steps of 1..{max_rows} rows over {context} tokens", file=sys.stderr, flush=True)
    seconds = step_seconds(max_rows, context, args.rounds)
    print(json.dumps({"steps": steps, "seconds": seconds, "context": context}))


# ---- the report -------------------------------------------------------------------------------------------------
def summarize(steps: list[list[int]], seconds: dict[int, float]) -> tuple[float, float, float]:
    """(tokens per step, rows per step, tokens/s) of a drafter's replay."""
    tokens = sum(t for _, t in steps)
    return tokens / len(steps), sum(r for r, _ in steps) / len(steps), tokens / sum(seconds[r] for r, _ in steps)


def report(data: dict, args: argparse.Namespace) -> str:
    from radixserve.bench.docs import cpu_header

    seconds = {int(r): s for r, s in data["seconds"].items()}
    cls = args.cpu_class or "native"
    title = "## Token tree or chain: the ceiling of tree verification for n-gram drafts"
    lines = [f"{title}{' (' + cls + ' class)' if args.cpu_class else ''} (`benchmarks/bench_spec_tree.py`)", "",
             cpu_header(), "",
             f"Class: {cls}. `python benchmarks/bench_spec_tree.py{' --class ' + args.cpu_class if args.cpu_class else ''}`"
             f" ({args.prompts} requests per workload, {args.max_new_tokens} greedy tokens, K = "
             f"{args.num_draft_tokens}, step times the median of {args.rounds} rounds over {data['context']} cached "
             "tokens). A tree (b, x): the chain plus b - 1 branches of up to x tokens from other occurrences of the "
             "suffix, each with another first token. Rate: tokens / sum of the measured time of each step's rows "
             "(batch 1); plain decoding is one row per token.", "",
             "Verify-step time by rows (ms): " + ", ".join(f"{r}: {1e3 * s:.1f}" for r, s in sorted(seconds.items())),
             "", "| workload | drafter | tokens / step | rows / step | est. tok/s | vs plain | vs chain |",
             "|---|---|---:|---:|---:|---:|---:|"]
    plain = 1.0 / seconds[1]
    for name, per in data["steps"].items():
        chain_rate = summarize(per[str(TREES[0])], seconds)[2]
        for shape in TREES:
            tps, rps, rate = summarize(per[str(shape)], seconds)
            label = "chain" if shape == TREES[0] else f"tree ({shape[0]}, {shape[1]})"
            lines.append(f"| {name} | {label} | {tps:.3f} | {rps:.2f} | {rate:.1f} | {rate / plain:.2f}x | "
                         f"{rate / chain_rate:.3f}x |")
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    if args.worker:
        return worker(args)
    from radixserve.bench.docs import class_env, write_doc_section

    env = {**os.environ, **(class_env(args.cpu_class) if args.cpu_class else {})}
    out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--worker"], env=env, check=True,
                         capture_output=True, text=True)
    data = json.loads(out.stdout.strip().splitlines()[-1])
    body = report(data, args)
    print(body)
    if not args.no_docs:
        tag = f"_{args.cpu_class}" if args.cpu_class else ""
        write_doc_section(DOCS, BEGIN.replace(":begin", f"{tag}:begin"), END.replace(":end", f"{tag}:end"), body)


if __name__ == "__main__":
    main()
