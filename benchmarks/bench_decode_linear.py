"""Decode-sized linear products at SmolLM2-135M's shapes: each kernel against the one it replaces.

For each weight shape (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536, LM head 49152x576) and
row count (--rows), the time per product of:
* bfloat16: oneDNN's prepacked product (`onednn`), our GEMV kernel (`gemv`, layers/gemv.py: register-blocked
  vdpbf16ps; 1-32 rows in the model without AMX) and our AMX kernel on the same layout (`amx`, where the CPU has AMX-BF16;
  2-32 rows in the model);
* int4 g32 (decoder shapes) / int8 g32 (LM head): the row-layout kernel of quant_matmul.c (`rows`: integer
  dot products up to 4 rows, weight expansion + dense GEMM above) and the tiled kernel
  (`tiled`, layers/quantization/tiled.py; up to 32 rows in the model).
Each product cycles through --copies different weights of its shape, as a model's 30 layers do, so the
weights come from memory (or the last-level cache, which on a shared VM may be large), not from L2.
Calls alternate between the kernels; medians of --rounds. Two threads by default (the Engine's setting).

    python benchmarks/bench_decode_linear.py            # table + docs/benchmarks.md section + PNG
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from radixserve.bench.docs import cpu_header, write_doc_section
from radixserve.configs.row_table import DEFAULT_ROWS
from radixserve.kernels import gemv as gemv_kernels
from radixserve.kernels.quant import load_quant_kernel
from radixserve.kernels.quant_tiled import load_tiled_kernel
from radixserve.layers.linear import pack_onednn_weight
from radixserve.layers.quantization import linear as qlinear
from radixserve.layers.quantization.formats import quantize
from radixserve.layers.quantization.tiled import tile_weight

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
START, END = "<!-- bench_decode_linear:start -->", "<!-- bench_decode_linear:end -->"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,4,8,16,32")
    p.add_argument("--copies", type=int, default=30, help="weights per shape cycled through (LM head: 3)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-docs", action="store_true")
    return p.parse_args()


def kernels_for(name: str, shape: tuple[int, int], copies: int) -> dict[str, Callable[[torch.Tensor], object]]:
    """kernel name -> fn(x) running one product on each copy of the weight."""
    n, k = shape
    weights = [torch.randn(n, k) * 0.05 for _ in range(copies)]
    fns: dict[str, Callable[[torch.Tensor], object]] = {}
    onednn = [pack_onednn_weight(w.bfloat16()) for w in weights]
    fns["bf16 onednn"] = lambda x: [torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "") for w in onednn]
    kernel = gemv_kernels.load_gemv_kernel()
    if kernel is not None:
        packed = [gemv_kernels.pack_gemv_weight(w.bfloat16()) for w in weights]
        fns["bf16 gemv"] = lambda x: [kernel(w, x, None, n) for w in packed]
        amx = gemv_kernels.load_amx_kernel()
        if amx is not None:
            fns["bf16 amx"] = lambda x: [amx(w, x, None, n) for w in packed]
    bits = 8 if name == "lm_head" else 4
    rows = [quantize(w, bits, per_channel=False) for w in weights]
    quant = load_quant_kernel()
    fns[f"int{bits} rows"] = lambda x: [qlinear.packed_linear(w, x, quant) for w in rows]
    if load_tiled_kernel() is not None:
        tiled = [tile_weight(w) for w in rows]
        fns[f"int{bits} tiled"] = lambda x: [qlinear.tiled_linear(w, x, DEFAULT_ROWS.tiled_rows) for w in tiled]
    return fns


def measure(fns: dict[str, Callable], x: torch.Tensor, copies: int, rounds: int) -> dict[str, float]:
    """Median microseconds per product (one weight), calls alternating between the kernels."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn(x)
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn(x)
            times[name].append((time.perf_counter() - start) / copies * 1e6)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    results: dict[tuple[str, int], dict[str, float]] = {}
    with torch.inference_mode():
        for name, shape in SHAPES.items():
            copies = 3 if name == "lm_head" else args.copies
            fns = kernels_for(name, shape, copies)
            for m in rows:
                results[name, m] = measure(fns, torch.randn(m, shape[1]).bfloat16(), copies, args.rounds)
                cells = ", ".join(f"{k} {v:.0f} us" for k, v in results[name, m].items())
                print(f"{name} {shape[0]}x{shape[1]}, {m} rows: {cells}", flush=True)
    body = render(results, args)
    print(body)
    if not args.no_docs:
        write_doc_section(DOC, START, END, body)
        plot(results, rows)
        print(f"wrote {DOC} and {DOC.parent / 'bench_decode_linear.png'}")


def render(results: dict[tuple[str, int], dict[str, float]], args: argparse.Namespace) -> str:
    kernels = list(dict.fromkeys(k.replace("int8", "intN").replace("int4", "intN") for r in results.values() for k in r))
    lines = [
        "## Decode-sized linear products (`benchmarks/bench_decode_linear.py`)", "",
        f"{cpu_header()}; torch {torch.__version__}, {args.threads} threads. Microseconds per product, median "
        f"of {args.rounds} rounds, each cycling through {args.copies} weights of the shape (LM head: 3). "
        "Quantized columns: int4 g32 for the decoder shapes, int8 g32 for the LM head (the model's formats); "
        "`rows` above 4 rows and `tiled` above 32 expand the weight for a dense GEMM.", "",
        f"Command: `python benchmarks/bench_decode_linear.py --rows {args.rows} --copies {args.copies} "
        f"--rounds {args.rounds} --threads {args.threads}`", "",
        "| weight | rows | " + " | ".join(kernels) + " |",
        "|---|---:|" + "---:|" * len(kernels),
    ]
    for (name, m), timing in results.items():
        cells = {k.replace("int8", "intN").replace("int4", "intN"): v for k, v in timing.items()}
        lines.append(f"| {name} {SHAPES[name][0]}x{SHAPES[name][1]} | {m} | "
                     + " | ".join(f"{cells[k]:.0f}" if k in cells else "-" for k in kernels) + " |")
    lines += ["", "![decode linear](bench_decode_linear.png)"]
    return "\n".join(lines)


def plot(results: dict[tuple[str, int], dict[str, float]], rows: list[int]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(SHAPES), figsize=(4 * len(SHAPES), 3.6))
    for ax, name in zip(axes, SHAPES, strict=True):
        kernels = list(results[name, rows[0]])
        width = 0.8 / len(kernels)
        for i, kernel in enumerate(kernels):
            ax.bar([j + i * width for j in range(len(rows))], [results[name, m][kernel] for m in rows], width,
                   label=kernel)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))], [str(m) for m in rows])
        ax.set_title(name)
        ax.set_xlabel("rows")
    axes[0].set_ylabel("us per product")
    axes[-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(DOC.parent / "bench_decode_linear.png", dpi=110)


if __name__ == "__main__":
    main()
