"""Decode speed of one configuration through the offline Engine, at batch 1 and 8 (--batches): a quick probe for A/B
runs.

    python benchmarks/bench_decode_probe.py embedded int4                 # model (or a folder), --quantization
    PYTHONPATH=<worktree of the base> python benchmarks/bench_decode_probe.py <folder> int4    # the same, before

Prompts of 100 tokens, their prefixes cached by a first call. Per batch size and round, the same prompts run
once with 1 new token and once with --new tokens (greedy, no EOS), so the difference of the two walls is decode:
tokens/s = batch x (new - 1) / (wall with new - wall with one). Best of --rounds. Prints one line,
`RESULT <model> <quantization> bs1=<tok/s> bs8=<tok/s>` (one figure per batch size).
"""

from __future__ import annotations

import argparse
import time

from radixserve import Engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="'embedded' or a Hugging Face folder")
    parser.add_argument("quantization", nargs="?", default="none")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--new", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", default="1,8", help="comma-separated batch sizes")
    args = parser.parse_args()
    engine = Engine(dtype=args.dtype, quantization=args.quantization,
                    **({} if args.model == "embedded" else {"model_path": args.model}))
    params = {"temperature": 0.0, "ignore_eos": True}
    engine.generate(input_ids=[list(range(1000, 1040))], sampling_params={**params, "max_new_tokens": 4})
    figures = []
    for bs in (int(b) for b in args.batches.split(",")):
        prompts = [[i * 7 + 1000 + j for j in range(100)] for i in range(bs)]
        engine.generate(input_ids=prompts, sampling_params={**params, "max_new_tokens": 1})  # NOTE: caches them
        best = 0.0
        for _ in range(args.rounds):
            start = time.perf_counter()
            engine.generate(input_ids=prompts, sampling_params={**params, "max_new_tokens": 1})
            one = time.perf_counter() - start
            start = time.perf_counter()
            engine.generate(input_ids=prompts, sampling_params={**params, "max_new_tokens": args.new})
            full = time.perf_counter() - start
            best = max(best, bs * (args.new - 1) / (full - one))
        figures.append(f"bs{bs}={best:.1f}")
    print("RESULT", args.model.rstrip("/").split("/")[-1], args.quantization, " ".join(figures), flush=True)
    engine.shutdown()


if __name__ == "__main__":
    main()
