"""Greedy output ids of a 64-request mixed run under several scheduler configurations, one hash each.

For a refactor that must not change behaviour: run it at the old commit and the new one, each from its own
tree, and compare the hashes (`PYTHONPATH=<tree> python benchmarks/greedy_identity.py out.json`). The
prompts share three system prefixes cut at random lengths, then 1-59 tokens of their own; 12 greedy tokens
each, offline Engine, float32, a 6,000-token pool. Configurations: page size 1 and 4 x the overlap loop on
and off x the radix cache on and off, and int4 weights.

With `--enable-deterministic-inference` every configuration runs in that mode (docs/deterministic.md): then the
eight float32 configurations must hash alike (batch shapes, pages, loops and the cache change no bit), and int4
the same from run to run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random

from radixserve import Engine

CONFIGS = [{"page_size": p, "disable_overlap_schedule": not overlap, "disable_radix_cache": not radix}
           for p in (1, 4) for overlap in (True, False) for radix in (True, False)]
CONFIGS.append({"page_size": 1, "quantization": "int4"})


def prompts(num: int = 64, seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(100, 40000) for _ in range(n)] for n in (40, 120, 300)]
    out = []
    for i in range(num):
        head = systems[i % 3][: rng.randrange(10, len(systems[i % 3]) + 1)]
        out.append(head + [rng.randrange(100, 40000) for _ in range(rng.randrange(1, 60))])
    return out


def run(config: dict, deterministic: bool = False) -> str:
    engine = Engine(dtype="float32", max_total_tokens=6000, log_level="warning",
                    enable_deterministic_inference=deterministic, **config)
    try:
        outs = engine.generate(input_ids=prompts(), sampling_params={"max_new_tokens": 12, "temperature": 0,
                                                                      "ignore_eos": True})
    finally:
        engine.shutdown()
    return hashlib.sha256(json.dumps([o["output_ids"] for o in outs]).encode()).hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", help="JSON file: configuration -> hash of the output ids")
    parser.add_argument("--enable-deterministic-inference", action="store_true")
    args = parser.parse_args()
    results = {}
    for config in CONFIGS:
        key = json.dumps(config, sort_keys=True)
        results[key] = run(config, args.enable_deterministic_inference)
        print(key, results[key], flush=True)
    float32 = {h for key, h in results.items() if "quantization" not in key}
    print(f"float32 configurations: {len(float32)} distinct hash(es)", flush=True)
    with open(args.output, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
