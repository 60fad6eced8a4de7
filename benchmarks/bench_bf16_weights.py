"""bf16 weights with float32 compute (layers/bf16_weights.py) against float32 weights, per weight shape and row count.

For each shape: the `bf16_weights` method (its kernel up to `RowTable.bf16_weights_rows` rows, the widened copy and oneDNN's float32
product from there, the copy written in oneDNN's blocked order; also the copy in plain order, which oneDNN reorders
itself, and F.linear as that product), float32 weights through `F.linear` (MKL) and through oneDNN's prepacked
weight, fastest of --calls calls, interleaved. Run it under a CPU class's environment to measure that class, e.g. AVX2:

    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 RADIXSERVE_CPU_ISA=avx2 \\
        python benchmarks/bench_bf16_weights.py --threads 1
"""

from __future__ import annotations

import argparse
import time

import torch

from radixserve.layers import bf16_weights
from radixserve.layers.bf16_weights import Bf16WeightLinearMethod
from radixserve.layers.linear import LinearBase, OneDNNLinearMethod

# SmolLM2-135M's qkv and gate_up, and Qwen2.5-1.5B's qkv, o and gate_up / down
SHAPES = ((960, 576), (3072, 576), (2048, 1536), (17920, 1536), (1536, 8960))
ROWS = (1, 4, 16, 32, 64, 128, 255, 256, 1024)


def _layer(method, weight: torch.Tensor) -> LinearBase:
    layer = LinearBase(weight.shape[1], weight.shape[0])
    layer.weight.data = weight.clone()
    layer.method = method()
    layer.method.process_weights_after_loading(layer)
    return layer


def _with_path(layer: LinearBase, path: str):
    """The layer with its prefill product forced to one of bf16_weights.prefill_path's paths."""
    def run(x: torch.Tensor) -> torch.Tensor:
        saved = bf16_weights.prefill_path
        bf16_weights.prefill_path = lambda n, k: path
        try:
            return layer(x)
        finally:
            bf16_weights.prefill_path = saved
    return run


def timings(shape: tuple[int, int], rows: int, calls: int) -> dict[str, float]:
    weight = torch.randn(*shape) * 0.02
    bf16 = _layer(Bf16WeightLinearMethod, weight)
    runs = {"bf16_weights": bf16, "bf16_weights plain": _with_path(bf16, "onednn"),
            "bf16_weights F.linear": _with_path(bf16, "linear"),
            "onednn": _layer(OneDNNLinearMethod, weight), "F.linear": lambda x: torch.nn.functional.linear(x, weight)}
    x = torch.randn(rows, shape[1])
    best = dict.fromkeys(runs, float("inf"))
    with torch.inference_mode():
        for call in range(calls + 1):
            for name, run in runs.items():
                start = time.perf_counter()
                run(x)
                if call:  # NOTE: call 0 warms up
                    best[name] = min(best[name], time.perf_counter() - start)
    return best


def main() -> None:
    from radixserve.bench.docs import cpu_header
    from radixserve.kernels.gemv import load_bf16w_kernel

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--calls", type=int, default=7)
    p.add_argument("--prefill", action="store_true", help="only prefill rows (256, 512, 1,024), where the widened "
                                                          "weight's product is oneDNN's or F.linear's")
    p.add_argument("--shapes", default="", help="weights as OUTxIN, comma-separated (default: SmolLM2's and "
                                                 "Qwen2.5-1.5B's)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{cpu_header('float32')}; torch capability {torch.backends.cpu.get_cpu_capability()}; kernel level "
          f"{load_bf16w_kernel().level}; {args.threads} thread(s); fastest of {args.calls}, ms\n")
    print("| weight (out x in) | rows | bf16_weights | its product on F.linear | float32 F.linear | float32 onednn | "
          "best float32 / bf16_weights | plain copy / blocked copy | F.linear product / oneDNN product |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")] if args.shapes else SHAPES
    for shape in shapes:
        for rows in (256, 512, 1024) if args.prefill else ROWS:
            t = timings(shape, rows, args.calls)
            f32 = min(t["F.linear"], t["onednn"])
            print(f"| {shape[0]} x {shape[1]} | {rows} | {t['bf16_weights'] * 1e3:.2f} | "
                  f"{t['bf16_weights F.linear'] * 1e3:.2f} | {t['F.linear'] * 1e3:.2f} | {t['onednn'] * 1e3:.2f} | "
                  f"{f32 / t['bf16_weights']:.2f}x | {t['bf16_weights plain'] / t['bf16_weights']:.2f}x | "
                  f"{t['bf16_weights F.linear'] / t['bf16_weights']:.2f}x |",
                  flush=True)


if __name__ == "__main__":
    main()
