"""Prompt scoring with n choices: completions `echo` + `logprobs` on a long prompt, n=1 against n=N, on a
running server (radixserve or any OpenAI-compatible one that serves `echo`).

    python -m radixserve.launch_server --dtype float32 --max-total-tokens 65536 --context-length 4096 &
    python benchmarks/bench_echo_choices.py --base-url http://127.0.0.1:30000 [--prompt-tokens 2000] [--n 16]

Each choice used to score the whole prompt again; now choice 0 scores it and the others carry a copy, so
the n=N time should stay close to n=1's (docs/benchmarks.md has the figures, old and new side by side)."""

from __future__ import annotations

import argparse
import time

import httpx

TEXT = "the river flows past the old mill and the miller sings a song about the harvest moon "


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:30000")
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--logprobs", type=int, default=20)
    args = parser.parse_args()
    with httpx.Client(base_url=args.base_url, timeout=1800) as client:
        text = TEXT * (args.prompt_tokens // 10 + 1)
        ids = client.post("/tokenize", json={"prompt": text}).json()["tokens"][: args.prompt_tokens]
        for n in (1, args.n):
            started = time.monotonic()
            r = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 1, "echo": True, "n": n,
                                                     "logprobs": args.logprobs, "temperature": 0.7, "seed": 1})
            r.raise_for_status()
            print(f"n={n}: {time.monotonic() - started:.2f} s ({len(ids)} prompt tokens, logprobs {args.logprobs})",
                  flush=True)


if __name__ == "__main__":
    main()
