"""Cold prefill tokens/s over bf16 weights with float32 compute, with and without the resident blocked float32 copies
(RADIXSERVE_BF16W_PREFILL_COPY_MB), and over float32 weights, side by side in one process.

Three ModelRunners of the embedded model (or --model): `--dtype auto` with the copies off (each prefill chunk widens
every weight), `--dtype auto` with the copies (the default budget), and `--dtype float32` (float32 weights prepacked
for oneDNN, what vLLM runs at these classes). Each prefills a fresh prompt of each --lengths length, the three taking
turns round by round; medians of --rounds, the first round dropped. Meant for CPUs without bf16 products (or forced to
such a class with the switches of docs/benchmarks.md), where `--dtype auto` is float32 compute over bf16 weights.

    python benchmarks/bench_prefill_copies.py --lengths 512,1024,2048 --rounds 6
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from direct import DirectDriver

from radixserve.bench.docs import cpu_header
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.server_args import ServerArgs

SETTINGS = (("auto, no copies", "auto", "0"), ("auto, copies", "auto", "-1"), ("float32 weights", "float32", "-1"))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model folder or GGUF (default: the embedded SmolLM2-135M)")
    p.add_argument("--lengths", default="512,1024,2048")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--threads", type=int, default=2)
    return p.parse_args()


def build_runners(args: argparse.Namespace, tokens: int) -> dict[str, ModelRunner]:
    runners = {}
    for name, dtype, budget in SETTINGS:
        os.environ["RADIXSERVE_BF16W_PREFILL_COPY_MB"] = budget  # NOTE: read once, when the plan is made
        runners[name] = ModelRunner(ServerArgs(model_path=args.model, dtype=dtype, max_total_tokens=tokens))
        entry = runners[name].execution_plan.as_dict().get("bf16 prefill copies")
        print(f"{name}: copies {entry['choice'] if entry else '-'}", flush=True)
    del os.environ["RADIXSERVE_BF16W_PREFILL_COPY_MB"]
    return runners


def cold_prefill(runner: ModelRunner, length: int, seed: int) -> float:
    """Seconds to prefill a fresh random prompt of `length` tokens."""
    driver = DirectDriver(runner)
    prompt = torch.randint(10, runner.model_config.vocab_size, (length,),
                           generator=torch.Generator().manual_seed(seed)).tolist()
    req = driver.new_request()
    start = time.perf_counter()
    driver.extend([req], [prompt])
    elapsed = time.perf_counter() - start
    driver.release([req])
    return elapsed


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    lengths = [int(n) for n in args.lengths.split(",")]
    runners = build_runners(args, max(lengths) + 64)
    rows = []
    for n in lengths:
        times: dict[str, list[float]] = {name: [] for name in runners}
        for r in range(args.rounds):
            for name, runner in runners.items():
                times[name].append(cold_prefill(runner, n, 1000 * r + n))
        med = {name: statistics.median(t[1:] or t) for name, t in times.items()}
        rows.append((n, med))
        print(f"{n} tokens: " + ", ".join(f"{name} {n / s:.0f} tok/s" for name, s in med.items()), flush=True)
    print(f"\n{cpu_header('auto')}; torch {torch.__version__}; {args.threads} thread(s); median of {args.rounds - 1} "
          "rounds after the first\n")
    names = list(runners)
    print("| prompt tokens | " + " | ".join(f"{name} tok/s" for name in names)
          + " | copies / no copies (time) | copies / float32 weights (time) |")
    print("|---:|" + "---:|" * (len(names) + 2))
    for n, med in rows:
        cells = " | ".join(f"{n / med[name]:.0f}" for name in names)
        print(f"| {n} | {cells} | {med['auto, copies'] / med['auto, no copies']:.3f}x | "
              f"{med['auto, copies'] / med['float32 weights']:.3f}x |")


if __name__ == "__main__":
    main()
