"""The LoRA products of one layer, C kernel (csrc/lora_sgmv.c) against the torch path (lora/layers.py), side by
side in one process on the same inputs: `LoraLinear.add_to` both ways, so each side pays its own Python
overhead. The C side runs the kernel for every segment (--as-served: as the layer chooses, torch matmuls for
segments over `RowTable.lora_segment_rows` rows). Shapes are SmolLM2-135M's fused layers (--model small) or a
1B-class Llama's (--model 1b); batches are decode steps whose rows alternate over several adapters (index
segments) and prefills of contiguous runs (slices). Prints a markdown table: median microseconds per call
(the best of 3 alternated medians) and torch / C.

    python benchmarks/bench_lora_kernel.py
    python benchmarks/bench_lora_kernel.py --model 1b --dtypes bfloat16 --ranks 16 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from radixserve.configs.row_table import DEFAULT_ROWS, RowTable
from radixserve.kernels.lora import load_lora_kernel
from radixserve.lora.layers import LoraLinear, LoraSegments, PackedLora, group_rows

# name -> (hidden, q size, kv size, intermediate)
MODELS = {"small": (576, 576, 192, 1536), "1b": (2048, 2048, 512, 8192)}
# name -> (rows per request, requests, adapters): request i runs adapter i mod adapters
BATCHES = {"decode 8 rows / 4 adapters": (1, 8, 4), "decode 32 rows / 8 adapters": (1, 32, 8),
           "prefill 2 x 32 rows / 2 adapters": (32, 2, 2), "prefill 4 x 32 rows / 4 adapters": (32, 4, 4),
           "prefill 4 x 128 rows / 4 adapters": (128, 4, 4)}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=list(MODELS), default="small")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--ranks", default="8,16,64")
    p.add_argument("--threads", type=int, default=None, help="torch/OpenMP threads (default: torch's)")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--batches", default=",".join(BATCHES), help="which batches, comma-separated")
    p.add_argument("--as-served", action="store_true",
                   help="the C side as the layer serves it: segments over `RowTable.lora_segment_rows` rows run torch "
                        "(default: the kernel takes every segment)")
    return p.parse_args(argv)


def layers(model: str) -> dict[str, tuple[int, int, int]]:
    """fused layer -> (in, out, modules) for `model`'s shapes."""
    hidden, q, kv, inter = MODELS[model]
    return {"qkv_proj": (hidden, q + 2 * kv, 3), "gate_up_proj": (hidden, 2 * inter, 2), "down_proj": (inter, hidden, 1)}


def median_us(layer: LoraLinear, x: torch.Tensor, y: torch.Tensor, repeats: int) -> float:
    layer.add_to(x, y)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        layer.add_to(x, y)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def one_case(kernel, fused: str, k: int, n: int, modules: int, batch: tuple[int, int, int], rank: int,
             dtype: torch.dtype, repeats: int, rows_table: RowTable = DEFAULT_ROWS) -> tuple[float, float]:
    """(torch us, C us) for one layer shape, batch, rank and dtype."""
    rows, requests, adapters = batch
    g = torch.Generator().manual_seed(rank)
    key = (0, fused)

    def pair() -> tuple[torch.Tensor, torch.Tensor]:
        return ((torch.randn(modules * rank, k, generator=g) * 0.05).to(dtype),
                (torch.randn(modules * rank, n, generator=g) * 0.05).to(dtype))

    packed = {str(i): PackedLora(None, {key: pair()}) for i in range(adapters)}
    segments = group_rows([str(i % adapters) for i in range(requests)], [rows] * requests, packed,
                          torch.device("cpu"))
    x = torch.randn(rows * requests, k, generator=g).to(dtype)
    y = torch.randn(rows * requests, n, generator=g).to(dtype)
    by_c = LoraLinear(*key, LoraSegments(segments, kernel=kernel, rows=rows_table))
    by_torch = LoraLinear(*key, LoraSegments(segments))
    t_torch, t_c = [], []
    for _ in range(3):  # NOTE: alternated, so that a busy moment of a shared machine hits both
        t_torch.append(median_us(by_torch, x, y, repeats))
        t_c.append(median_us(by_c, x, y, repeats))
    return min(t_torch), min(t_c)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    # NOTE: without --as-served, every segment on the kernel (the served table sends large ones to torch)
    table = DEFAULT_ROWS if args.as_served else RowTable(lora_segment_rows_f32=1 << 62, lora_segment_rows_bf16=1 << 62)
    kernel = load_lora_kernel()
    if kernel is None:
        raise SystemExit("the LoRA kernel does not build here (no C compiler)")
    print(f"kernel level {kernel.level}, {torch.get_num_threads()} threads, model shapes {args.model}\n")
    print("| layer (in -> out) | batch | dtype | rank | torch us | C us | torch / C |")
    print("|---|---|---|---:|---:|---:|---:|")
    ratios = []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for rank in map(int, args.ranks.split(",")):
            for fused, (k, n, modules) in layers(args.model).items():
                for batch in args.batches.split(","):
                    torch_us, c_us = one_case(kernel, fused, k, n, modules, BATCHES[batch], rank, dtype,
                                              args.repeats, table)
                    ratios.append(torch_us / c_us)
                    print(f"| {fused} ({k} -> {n}) | {batch} | {dtype_name} | {rank} | {torch_us:.0f} | {c_us:.0f} | "
                          f"{torch_us / c_us:.2f} |", flush=True)
    print(f"\ngeometric mean of torch / C over {len(ratios)} cases: "
          f"{statistics.geometric_mean(ratios):.2f}")


if __name__ == "__main__":
    main()
