"""TTFT of a long prefix on one `serve --dp 2` worker, cold vs loaded from the disk tier another worker wrote.

The workers are started as `radixserve serve --dp 2 --enable-hierarchical-cache --hicache-storage-dir <tmp>`
starts them (the launcher's own code: pinned CPU shares, the same storage directory; the gateway too when
sglang-router is installed), and the requests go straight to each worker's URL:

1. worker 0 computes prefix A (~3,000 tokens) + a question: its pages are written to the shared directory;
2. worker 1 computes a fresh prefix B of the same length: its cold TTFT;
3. worker 1 gets prefix A: its pages are loaded from disk (the loaded TTFT), and then A again (an in-memory hit).

Greedy tokens of 3 must equal worker 0's for the same prompt. Prints one line per step, the ratio and a verdict.

    python benchmarks/bench_hicache_dp.py [--prefix-tokens 3000] [--dtype float32] [--max-new-tokens 16]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from radixserve.entrypoints.dp_launcher import DPConfig, DPLauncher, router_installed  # noqa: E402
from radixserve.server_args import ServerArgs  # noqa: E402


def prefix(tokens: int) -> str:
    """About `tokens` tokens of text (~25 tokens per clause), its head unique so no two prefixes share a page."""
    tag = f"{random.randrange(10**8):08d}"  # NOTE: digits, one token each: every prefix has the same length
    clauses = " ".join(f"Clause {i} of manual {tag}: log every crate on shelf {i * 7 % 97}." for i in range(tokens // 25))
    return f"Manual {tag}. {clauses}"


def generate(url: str, text: str, max_new_tokens: int) -> dict:
    """One greedy streamed completion on a worker: TTFT (the client's: sent to first text chunk), the text, the
    prompt and cached tokens (`usage`)."""
    body = {"model": "SmolLM2-135M-Instruct", "prompt": text, "max_tokens": max_new_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    sent, first, usage, pieces = time.perf_counter(), None, None, []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=1800) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:300]!r}")
        for raw in r.iter_lines():
            if not raw.startswith("data: {"):
                continue
            chunk = json.loads(raw[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                first = first or time.perf_counter()
                pieces.append(chunk["choices"][0]["text"])
            usage = chunk.get("usage") or usage
    end = time.perf_counter()
    assert usage is not None, "no usage chunk"
    return {"ttft": (first or end) - sent, "e2e_client": end - sent, "prompt": usage["prompt_tokens"],
            "cached": usage["prompt_tokens_details"]["cached_tokens"], "text": "".join(pieces)}


def hicache_counters(url: str) -> dict:
    """The worker's disk-tier counters from /metrics (radixserve:hicache_*)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    pairs = (ln.split() for ln in text.splitlines() if ln.startswith("radixserve:hicache_"))
    return {name.removeprefix("radixserve:hicache_").removesuffix("_total"): float(value) for name, value, *_ in pairs}


def line(name: str, out: dict) -> str:
    return (f"{name:<34}: TTFT {out['ttft']:8.3f} s (cached {out['cached']} of {out['prompt']} tokens; "
            f"client e2e {out['e2e_client']:.3f} s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix-tokens", type=int, default=3000, help="tokens of each prefix (default: 3000)")
    parser.add_argument("--dtype", default="float32", help="worker dtype (default: float32)")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="greedy tokens per request (default: 16)")
    parser.add_argument("--max-total-tokens", type=int, default=8192, help="KV pool per worker (default: 8192)")
    args = parser.parse_args()
    storage = tempfile.mkdtemp(prefix="radixserve-hicache-dp-")
    server_args = ServerArgs(dtype=args.dtype, max_total_tokens=args.max_total_tokens, log_level="warning",
                             enable_hierarchical_cache=True, hicache_storage_dir=storage, hicache_storage_size="4GiB")
    launcher = DPLauncher(server_args, DPConfig(2), [])
    a, b = prefix(args.prefix_tokens), prefix(args.prefix_tokens)
    question = "\nQuestion: which shelf holds the crates of clause 12? Answer:"
    try:
        launcher.start_workers()
        launcher.wait_workers_healthy()
        if router_installed():
            launcher.start_gateway()
            launcher.wait_gateway_ready()
        w0, w1 = (w.url for w in launcher.workers)
        for url in (w0, w1):  # first-call costs on each worker (too short to store a page)
            generate(url, "warm up", 2)
        computed = generate(w0, a + question, args.max_new_tokens)
        cold = generate(w1, b + question, args.max_new_tokens)
        loaded = generate(w1, a + question, args.max_new_tokens)
        memory = generate(w1, a + question, args.max_new_tokens)
        counters = hicache_counters(w1)
    finally:
        launcher.stop_all()
        shutil.rmtree(storage, ignore_errors=True)
    same = loaded["text"] == computed["text"]
    print(f"machine: {len(launcher.workers[0].cores or [])} CPU(s) per worker, dtype {args.dtype}, "
          f"storage pages of 32 tokens in {storage}")
    print(line("worker 0, prefix A (computed, stored)", computed))
    print(line("worker 1, prefix B (cold)", cold))
    print(line("worker 1, prefix A (loaded from disk)", loaded))
    print(line("worker 1, prefix A again (in memory)", memory))
    print(f"worker 1 disk tier: {counters}")
    print(f"ratio cold / loaded TTFT on worker 1: {cold['ttft'] / loaded['ttft']:.1f}x")
    print(f"greedy text: worker 1 loaded == worker 0 computed: {same}; in-memory == loaded: "
          f"{memory['text'] == loaded['text']} ({computed['text']!r})")
    print(f"verdict: {'PASS' if same and loaded['cached'] > 0.95 * loaded['prompt'] else 'FAIL'}")


if __name__ == "__main__":
    main()
