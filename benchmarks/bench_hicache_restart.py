"""TTFT of a long shared system prompt, cold vs after a restart over the same disk tier (docs/hicache.md).

Each run is a new process (a real restart: empty KV pool, empty tree) with `--enable-hierarchical-cache` on one
directory: run 1 computes the prompt and stores its pages; run 2 loads them. Both generate greedily; the tokens
must be identical. A third process with the tier off gives the plain cold TTFT.

    python benchmarks/bench_hicache_restart.py [--system-tokens 4000] [--dtype auto] [--repeat 1]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time


def one_run(args: argparse.Namespace) -> None:
    """The child: one Engine, one request; prints a JSON line."""
    import torch

    from radixserve import Engine

    if args.threads:
        torch.set_num_threads(args.threads)
    system = " ".join(f"rule{i}: answer politely." for i in range(args.system_tokens // 9))  # ~9 tokens each
    extra = {} if args.directory is None else {"enable_hierarchical_cache": True,
                                               "hicache_storage_dir": args.directory}
    started = time.perf_counter()
    with Engine(dtype=args.dtype, device="cpu", max_total_tokens=8192 + 1024,
                context_length=8192, log_level="warning", **extra) as engine:
        ready = time.perf_counter() - started
        messages = [{"role": "system", "content": system}, {"role": "user", "content": "What is rule 7?"}]
        ids = engine.apply_chat_template(messages)
        greedy = {"max_new_tokens": 16, "temperature": 0.0}
        out = engine.generate(input_ids=ids, sampling_params=greedy)
        # NOTE: the same request again in this process: a hit in the in-memory tree, the baseline a restart's
        # disk hit is compared with (a cached prefix changes how the suffix's attention is summed, in any cache)
        again = engine.generate(input_ids=ids, sampling_params=greedy)
        meta = out["meta_info"]
    print(json.dumps({"ttft": meta["ttft"], "prompt_tokens": meta["prompt_tokens"],
                      "cached_tokens": meta["cached_tokens"], "output_ids": out["output_ids"], "start_s": ready,
                      "memory_hit_ttft": again["meta_info"]["ttft"], "memory_hit_ids": again["output_ids"]}))


def child(args: argparse.Namespace, directory: str | None) -> dict:
    cmd = [sys.executable, __file__, "--one", "--system-tokens", str(args.system_tokens), "--dtype", args.dtype,
           "--threads", str(args.threads)]
    if directory is not None:
        cmd += ["--directory", directory]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def first_difference(a: dict, b: dict) -> int | None:
    pairs = zip(a["output_ids"], b["output_ids"], strict=False)
    return next((i for i, (x, y) in enumerate(pairs) if x != y), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--system-tokens", type=int, default=4000)
    parser.add_argument("--dtype", default="auto", help="the server's default (auto); float32 doubles the page bytes")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--repeat", type=int, default=1, help="cold/restart pairs, each on a fresh directory")
    parser.add_argument("--with-plain", action="store_true", help="also time a process with the tier off")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--directory", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        one_run(args)
        return
    plain = child(args, None) if args.with_plain else None
    if plain is not None:
        print(f"tier off : prompt {plain['prompt_tokens']} tokens, TTFT {plain['ttft']:.3f} s")
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory(prefix="hicache-bench-") as folder:
            cold, warm = child(args, folder), child(args, folder)
        same = warm["output_ids"] == cold["memory_hit_ids"]
        print(f"cold     : TTFT {cold['ttft']:.3f} s (cached {cold['cached_tokens']}, pages written); the same "
              f"request again in that process (in-memory tree hit): TTFT {cold['memory_hit_ttft']:.3f} s")
        print(f"restart  : TTFT {warm['ttft']:.3f} s (cached {warm['cached_tokens']} of {warm['prompt_tokens']} "
              f"tokens loaded from disk)")
        print(f"ratio cold / restart TTFT: {cold['ttft'] / warm['ttft']:.1f}x")
        print(f"greedy tokens: restart == in-memory hit: {same}; restart == cold: "
              f"{warm['output_ids'] == cold['output_ids']} (first difference at {first_difference(warm, cold)})")
        if not same:
            sys.exit(1)


if __name__ == "__main__":
    main()
