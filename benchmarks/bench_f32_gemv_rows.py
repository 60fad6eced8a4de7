"""`--dtype float32` decode with the float32 GEMV's row limit at its default and at another value, side by side.

The row table's `f32_gemv_rows` (configs/row_table.py) is where `f32_gemv` hands a product to oneDNN, and so the
largest decode batch the float32 C decoder takes. One process holds two Engines, one per limit
(RADIXSERVE_F32_GEMV_MAX_ROWS, read when each plans), and times them in alternating rounds so that a busy moment of
a shared machine falls on both; a batch's decode rate is its requests' tokens after the first over the wall of
generating `--new-tokens` less the wall of generating one (the prompts are unique 100-token ones, the same per round).

    python benchmarks/bench_f32_gemv_rows.py --rows 32 --batches 8,16,32,64 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from radixserve import Engine
from radixserve.configs.row_table import DEFAULT_ROWS


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=32, help="the other f32_gemv_rows, against the table's default")
    p.add_argument("--batches", default="8,16,32,64")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=32)
    return p.parse_args()


def decode_rate(engine: Engine, batch: int, new_tokens: int) -> float:
    prompts = [[(7 * i + 3 * j) % 5000 + 10 for j in range(100)] for i in range(batch)]

    def wall(n: int) -> float:
        start = time.perf_counter()
        engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": n, "ignore_eos": True, "temperature": 0})
        return time.perf_counter() - start

    return batch * (new_tokens - 1) / (wall(new_tokens) - wall(1))


def main() -> None:
    args = parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    limits = (DEFAULT_ROWS.f32_gemv_rows, args.rows)
    engines = {}
    for rows in limits:
        os.environ["RADIXSERVE_F32_GEMV_MAX_ROWS"] = str(rows)
        engine = Engine(dtype="float32", max_total_tokens=16384, max_running_requests=128, log_level="warning")
        step = engine.model_runner.model.c_decoder
        print(f"f32_gemv_rows {rows}: the C decoder takes up to {step.max_rows if step else 0} rows", flush=True)
        engines[rows] = engine
    rates: dict[tuple[int, int], list[float]] = {(r, b): [] for r in limits for b in batches}
    for k in range(args.rounds):
        for batch in batches:
            for rows, engine in engines.items():
                rates[(rows, batch)].append(decode_rate(engine, batch, args.new_tokens))
        print(f"round {k + 1} of {args.rounds} done", flush=True)
    print(f"\n| batch | f32_gemv_rows {limits[0]} tok/s | f32_gemv_rows {limits[1]} tok/s | ratio | rounds |")
    print("|---:|---:|---:|---:|---|")
    for batch in batches:
        base, other = (statistics.median(rates[(r, batch)]) for r in limits)
        rounds = " / ".join(f"{a:.0f}:{b:.0f}" for a, b in zip(rates[(limits[0], batch)], rates[(limits[1], batch)],
                                                              strict=True))
        print(f"| {batch} | {base:.1f} | {other:.1f} | {other / base:.2f}x | {rounds} |")
    for engine in engines.values():
        engine.shutdown()


if __name__ == "__main__":
    main()
