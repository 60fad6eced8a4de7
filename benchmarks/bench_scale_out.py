"""Scale-out: 1 worker vs 2 workers behind SGLang's model gateway with cache_aware vs round_robin routing.

A multi-tenant shared-prefix workload: P system prompts of ~T tokens (one per tenant), R chat requests
spread evenly over them, in a random order with Poisson arrivals. Each configuration is started the way
`radixserve serve --dp N` starts it (workers pinned to their share of the CPUs, the gateway in front),
run once, then stopped; all in one invocation. Prints and writes this script's section of
docs/benchmarks.md with a PNG: aggregate cache hit rate, prefill tokens computed, throughput, TTFT.

    flock /tmp/radixserve-bench.lock python benchmarks/bench_scale_out.py [--requests 64] [--rate 2.0]

Needs `pip install 'radixserve[router]'` (sglang-router==0.3.2).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import httpx

from radixserve.bench import report
from radixserve.bench.docs import write_doc_section
from radixserve.bench.http_backend import load_tokenizer
from radixserve.entrypoints.dp_launcher import DPConfig, DPLauncher, allowed_cpus
from radixserve.server_args import ServerArgs

REPO = Path(__file__).resolve().parents[1]
SECTION_START = "<!-- bench_scale_out:start -->"
SECTION_END = "<!-- bench_scale_out:end -->"
CONFIGS = (("1 worker", 1, "cache_aware"), ("2 workers, cache_aware", 2, "cache_aware"),
           ("2 workers, round_robin", 2, "round_robin"))
TOPICS = ("billing disputes", "shipping delays", "warranty claims", "account security", "refund policy",
          "product sizing", "loyalty points", "store hours", "gift cards", "bulk orders")


@dataclass(frozen=True)
class Request:
    tenant: int
    question: str
    arrival_s: float


@dataclass
class Outcome:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_s: float
    latency_s: float


def system_prompts(tokenizer: object, n: int, tokens: int) -> list[str]:
    """n tenants' system prompts of about `tokens` tokens each, different from their first words."""
    prompts = []
    for i in range(n):
        rng = random.Random(i)
        text = f"Tenant {i} ({rng.randrange(10**6):06d}) runs this assistant. Rules:"
        while len(tokenizer.encode(text)) < tokens:
            topic = rng.choice(TOPICS)
            text += f" Rule {rng.randrange(1000)}: on {topic}, answer in {rng.randrange(2, 9)} sentences and cite " \
                    f"section {rng.randrange(100)}.{rng.randrange(10)} of manual {chr(65 + i)}."
        prompts.append(text)
    return prompts


def arrivals(n_tenants: int, n_requests: int, rate: float, seed: int) -> list[Request]:
    rng = random.Random(seed)
    tenants = [i % n_tenants for i in range(n_requests)]
    rng.shuffle(tenants)
    t, out = 0.0, []
    for k, tenant in enumerate(tenants):
        out.append(Request(tenant, f"Customer {k} asks about {rng.choice(TOPICS)}. What do I do?", t))
        t += rng.expovariate(rate)
    return out


async def replay(url: str, prompts: list[str], requests: list[Request], max_tokens: int) -> tuple[list[Outcome], float]:
    async with httpx.AsyncClient(base_url=url, timeout=1800) as client:
        started = time.monotonic()

        async def one(req: Request) -> Outcome:
            await asyncio.sleep(max(0.0, req.arrival_s - (time.monotonic() - started)))
            sent = time.monotonic()
            body = {"messages": [{"role": "system", "content": prompts[req.tenant]},
                                 {"role": "user", "content": req.question}],
                    "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            first, usage = None, None
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if first is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                        first = time.monotonic()
                    usage = chunk.get("usage") or usage
            end = time.monotonic()
            return Outcome(usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"],
                           usage["completion_tokens"], (first or end) - sent, end - sent)

        outcomes = await asyncio.gather(*[one(r) for r in requests])
        return list(outcomes), time.monotonic() - started


def run_config(name: str, n: int, policy: str, server_args: ServerArgs, prompts: list[str],
               requests: list[Request], max_tokens: int) -> dict:
    launcher = DPLauncher(server_args, DPConfig(n, policy), [])
    try:
        launcher.start_workers()
        launcher.wait_workers_healthy()
        launcher.start_gateway()
        launcher.wait_gateway_ready()
        for worker in launcher.workers:  # first-call costs on each worker, then an empty tree
            httpx.post(worker.url + "/generate", json={"text": "warm up", "sampling_params": {"max_new_tokens": 2}},
                       timeout=300)
            httpx.post(worker.url + "/flush_cache", timeout=60).raise_for_status()
        before = _states(launcher)
        print(f"[bench_scale_out] {name}: {len(requests)} requests ...", flush=True)
        outcomes, wall = asyncio.run(replay(launcher.gateway_url, prompts, requests, max_tokens))
        counters = [{k: after[k] - was[k] for k in ("num_requests", "prefill_tokens_computed")}
                    for was, after in zip(before, _states(launcher), strict=True)]
    finally:
        launcher.stop_all()
    row = summarize(name, n, policy, outcomes, wall, counters, [w.cores for w in launcher.workers])
    print(f"[bench_scale_out] {name}: hit rate {row['hit_rate']:.1%}, prefill computed {row['prefill_computed']:,}, "
          f"{row['out_tok_per_s']:.1f} out tok/s, mean TTFT {row['ttft_mean_s']:.2f} s", flush=True)
    return row


def _states(launcher: DPLauncher) -> list[dict]:
    return [httpx.get(w.url + "/get_server_info", timeout=60).json()["scheduler_state"] for w in launcher.workers]


def summarize(name: str, n: int, policy: str, outcomes: list[Outcome], wall: float, states: list[dict],
              cores: list) -> dict:
    prompt = sum(o.prompt_tokens for o in outcomes)
    cached = sum(o.cached_tokens for o in outcomes)
    ttfts = sorted(o.ttft_s for o in outcomes)
    return {
        "name": name, "workers": n, "policy": policy, "cores": cores, "wall_s": wall,
        "hit_rate": cached / prompt, "prompt_tokens": prompt, "cached_tokens": cached,
        "prefill_computed": sum(s["prefill_tokens_computed"] for s in states),
        "per_worker_requests": [s["num_requests"] for s in states],
        "per_worker_prefill": [s["prefill_tokens_computed"] for s in states],
        "req_per_s": len(outcomes) / wall, "out_tok_per_s": sum(o.completion_tokens for o in outcomes) / wall,
        "ttft_mean_s": statistics.fmean(ttfts), "ttft_p50_s": ttfts[len(ttfts) // 2],
        "ttft_p90_s": ttfts[int(0.9 * (len(ttfts) - 1))],
    }


def table(rows: list[dict]) -> str:
    lines = ["| configuration | CPUs per worker | cache hit rate | prefill tokens computed | requests per worker | "
             "throughput (req/s, out tok/s) | TTFT mean / p50 / p90 (s) | wall (s) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cpus = " + ".join(str(len(c)) for c in r["cores"])
        split = " + ".join(f"{p:,}" for p in r["per_worker_prefill"])
        prefill = f"{r['prefill_computed']:,}" + (f" ({split})" if len(r["per_worker_prefill"]) > 1 else "")
        lines.append(f"| {r['name']} | {cpus} | {r['hit_rate']:.1%} | {prefill} | "
                     f"{' / '.join(map(str, r['per_worker_requests']))} | {r['req_per_s']:.2f}, {r['out_tok_per_s']:.1f} | "
                     f"{r['ttft_mean_s']:.2f} / {r['ttft_p50_s']:.2f} / {r['ttft_p90_s']:.2f} | {r['wall_s']:.1f} |")
    return "\n".join(lines)


def reading(rows: list[dict], rate: float, last_arrival_s: float) -> str:
    single, aware, rr = rows
    cores = sum(len(c) for c in single["cores"])
    return (f"Reading: the two workers share the {cores} cores the single worker had, so scale-out adds no compute "
            "here; what it shows is what routing does to the caches. round_robin computed "
            f"{rr['prefill_computed'] / max(aware['prefill_computed'], 1):.2f}x the prefill tokens of cache_aware, "
            f"and cache_aware {aware['prefill_computed'] / max(single['prefill_computed'], 1):.2f}x those of one "
            f"worker. cache_aware put {' / '.join(map(str, aware['per_worker_requests']))} requests on the workers: "
            "it sends a tenant it has not seen to the less loaded worker at that moment, then keeps it there. "
            f"The last request arrives at {last_arrival_s:.1f} s and every configuration finished within "
            f"{max(r['wall_s'] for r in rows) - last_arrival_s:.1f} s of it, so throughput is bounded by the "
            f"arrivals ({rate:g}/s). TTFT and throughput are one run each on a machine shared with other jobs (load "
            "average above); differences of tens of percent between them are within its noise.")


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["name"].replace(", ", "\n") for r in rows]
    panels = (("cache hit rate (%)", [100 * r["hit_rate"] for r in rows]),
              ("prefill tokens computed", [r["prefill_computed"] for r in rows]),
              ("throughput (output tokens/s)", [r["out_tok_per_s"] for r in rows]),
              ("mean TTFT (s)", [r["ttft_mean_s"] for r in rows]))
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.8))
    for ax, (title, values) in zip(axes, panels, strict=True):
        ax.bar(names, values, color=["#777777", "#2a7ab9", "#d9822b"][: len(rows)])
        ax.set_title(title, fontsize=10)
        ax.tick_params(axis="x", labelsize=8)
        for i, v in enumerate(values):
            ax.annotate(f"{v:.2f}" if v < 10 else f"{v:,.1f}" if v < 1000 else f"{v:,.0f}", (i, v), ha="center", va="bottom", fontsize=8)
    fig.suptitle("Scale-out behind SGLang's model gateway (shared-prefix multi-tenant workload)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8, help="tenants / system prompts (default: 8)")
    parser.add_argument("--prompt-tokens", type=int, default=800, help="tokens per system prompt (default: 800)")
    parser.add_argument("--requests", type=int, default=64, help="requests, spread evenly (default: 64)")
    parser.add_argument("--rate", type=float, default=2.0, help="mean arrivals per second, Poisson (default: 2.0)")
    parser.add_argument("--max-tokens", type=int, default=32, help="output tokens per request (default: 32)")
    parser.add_argument("--dtype", default="auto", help="worker dtype (default: auto)")
    parser.add_argument("--max-total-tokens", type=int, default=16384, help="KV pool per worker (default: 16384)")
    parser.add_argument("--seed", type=int, default=0, help="arrival order and gaps (default: 0)")
    parser.add_argument("--output", default=str(REPO / "docs" / "benchmarks.md"))
    parser.add_argument("--plot", default=str(REPO / "docs" / "bench_scale_out.png"))
    args = parser.parse_args()
    server_args = ServerArgs(dtype=args.dtype, max_total_tokens=args.max_total_tokens, log_level="warning")
    tokenizer = load_tokenizer()
    prompts = system_prompts(tokenizer, args.prompts, args.prompt_tokens)
    requests = arrivals(args.prompts, args.requests, args.rate, args.seed)
    rows = [run_config(name, n, policy, server_args, prompts, requests, args.max_tokens) for name, n, policy in CONFIGS]
    text = table(rows)
    single, aware, rr = rows
    gap = 100 * (single["hit_rate"] - aware["hit_rate"])
    verdict = (f"- cache_aware keeps the hit rate within 5 points of one worker: {aware['hit_rate']:.1%} vs "
               f"{single['hit_rate']:.1%} ({gap:+.1f} points): {'PASS' if gap <= 5 else 'FAIL'}\n"
               f"- round_robin loses {100 * (single['hit_rate'] - rr['hit_rate']):.1f} points and computes "
               f"{rr['prefill_computed'] / max(aware['prefill_computed'], 1):.2f}x the prefill tokens of cache_aware")
    print("\n" + text + "\n\n" + verdict)
    plot(rows, args.plot)
    command = "flock /tmp/radixserve-bench.lock python benchmarks/bench_scale_out.py " + \
        " ".join(shlex.quote(a) for a in sys.argv[1:])
    prompt_len = statistics.fmean(len(tokenizer.encode(p)) for p in prompts)
    write_doc_section(Path(args.output), SECTION_START, SECTION_END, "\n\n".join([
        "## Scale-out: workers behind SGLang's model gateway (`benchmarks/bench_scale_out.py`)",
        f"Machine: {report.machine_line()}, shared with other jobs; this process may use "
        f"{len(allowed_cpus())} CPUs, so **1 worker gets both cores (2 torch threads) and each of 2 workers gets "
        f"one core** (CPU affinity and 1 torch thread): the same hardware split differently. sglang-router "
        f"{version('sglang-router')}; workers `radixserve.launch_server --dtype {args.dtype} --max-total-tokens "
        f"{args.max_total_tokens}` on the embedded SmolLM2-135M-Instruct, started and pinned as by "
        "`radixserve serve --dp N`, the gateway in front with the launcher's fault settings.",
        f"Workload: {args.prompts} tenants, each with its own system prompt of {prompt_len:.0f} tokens on average; "
        f"{args.requests} streaming chat requests spread evenly over them, in a random order (seed {args.seed}) "
        f"with Poisson arrivals at {args.rate}/s; each asks its own question and generates {args.max_tokens} "
        "tokens (greedy, `ignore_eos`). Hit rate = cached / prompt tokens summed over all requests "
        "(`usage.prompt_tokens_details.cached_tokens`); prefill tokens computed = the workers' own counter; "
        "TTFT = first content chunk on the client. One run of each configuration, one after another.",
        f"Command: `{command.strip()}`",
        text,
        verdict,
        reading(rows, args.rate, requests[-1].arrival_s),
        "The gateway's cache_aware policy keeps an approximate radix tree of the request texts it sent to each "
        "worker and sends a request to the worker with the longest match (when the match is over 30% of the "
        "text and the load is balanced), so each tenant's prompt is computed on one worker only; round_robin "
        "spreads each tenant over both workers, which then compute every prompt twice.",
        f"![Scale-out bench]({Path(args.plot).name})",
    ]))
    print(f"[bench_scale_out] wrote {args.output} and {args.plot}")


if __name__ == "__main__":
    main()
