"""float32 decode-sized linear products: our float32 GEMV (`f32_gemv`, the method `--dtype float32` can time
in) against torch's float32 products, with the bf16-weight kernel (`--dtype auto` on CPUs without bf16
products) beside them.

For each of SmolLM2-135M's weight shapes and each row count (--rows), microseconds per product of:
`F.linear` (MKL), oneDNN's prepacked float32 product, `f32_gemv` (csrc/f32_gemv.c, the weight in its own
layout) and `bf16w_gemv` (csrc/bf16w_gemv.c, the weight rounded to bf16, half the bytes). Each product cycles
through --copies weights of its shape (the LM head: 3), so weights come from memory, as in a model; calls
alternate between the kernels; medians of --rounds. The kernel level is this process's
(RADIXSERVE_CPU_ISA forces a lower one; force torch's too, as bench_cpu_support.py does, to see that class).

    python benchmarks/bench_f32_linear.py              # table + docs/benchmarks.md section
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from bench_decode_linear import DOC, SHAPES, measure  # the same shapes and timing loop

from radixserve import platform as rs_platform
from radixserve.bench.docs import cpu_header, write_doc_section
from radixserve.kernels import gemv as gemv_kernels
from radixserve.layers.linear import pack_onednn_weight

START, END = "<!-- bench_f32_linear:start -->", "<!-- bench_f32_linear:end -->"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,4,16,32,63,64,128")
    p.add_argument("--copies", type=int, default=30, help="weights per shape cycled through (LM head: 3)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-docs", action="store_true")
    return p.parse_args()


def kernels_for(shape: tuple[int, int], copies: int) -> dict[str, object]:
    n, k = shape
    weights = [torch.randn(n, k) * 0.05 for _ in range(copies)]
    onednn = [pack_onednn_weight(w) for w in weights]
    fns = {"F.linear": lambda x: [F.linear(x, w) for w in weights],
           "onednn": lambda x: [torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "") for w in onednn]}
    f32 = gemv_kernels.load_f32_kernel()
    if f32 is not None:
        fns["f32_gemv"] = lambda x: [f32(w, x, None) for w in weights]
    bf16w = gemv_kernels.load_bf16w_kernel()
    if bf16w is not None:
        packed = [gemv_kernels.pack_gemv_weight(w.bfloat16(), gemv_kernels.BF16W_TILE) for w in weights]
        fns["bf16w_gemv"] = lambda x: [bf16w(w, x, None, n) for w in packed]
    return fns


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    results: dict[tuple[str, int], dict[str, float]] = {}
    with torch.inference_mode():
        for name, shape in SHAPES.items():
            copies = 3 if name == "lm_head" else args.copies
            fns = kernels_for(shape, copies)
            for m in rows:
                results[name, m] = measure(fns, torch.randn(m, shape[1]), copies, args.rounds)
                print(f"{name} {shape[0]}x{shape[1]}, {m} rows: "
                      + ", ".join(f"{k} {v:.0f} us" for k, v in results[name, m].items()), flush=True)
    body = render(results, args)
    print(body)
    if not args.no_docs:
        write_doc_section(DOC, START, END, body)
        print(f"wrote {DOC}")


def render(results: dict[tuple[str, int], dict[str, float]], args: argparse.Namespace) -> str:
    kernels = list(dict.fromkeys(k for r in results.values() for k in r))
    lines = [
        "## float32 decode-sized linear products (`benchmarks/bench_f32_linear.py`)", "",
        f"{cpu_header()}; torch {torch.__version__}, {args.threads} threads, our kernels at "
        f"{rs_platform.kernel_isa()}. Microseconds per product, median of {args.rounds} rounds, each cycling "
        f"through {args.copies} weights of the shape (LM head: 3). `bf16w_gemv` reads the weight rounded to bf16 "
        "(what `--dtype auto` keeps on CPUs without bf16 products); the others read float32.", "",
        f"Command: `python benchmarks/bench_f32_linear.py --rows {args.rows} --copies {args.copies} "
        f"--rounds {args.rounds} --threads {args.threads}`", "",
        "| weight | rows | " + " | ".join(kernels) + " | f32_gemv / best torch |",
        "|---|---:|" + "---:|" * (len(kernels) + 1),
    ]
    for (name, m), timing in results.items():
        best_torch = min(timing["F.linear"], timing["onednn"])
        ratio = f"{timing['f32_gemv'] / best_torch:.2f}" if "f32_gemv" in timing else "-"
        lines.append(f"| {name} {SHAPES[name][0]}x{SHAPES[name][1]} | {m} | "
                     + " | ".join(f"{timing[k]:.0f}" if k in timing else "-" for k in kernels) + f" | {ratio} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
