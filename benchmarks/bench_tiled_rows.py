"""The tiled int4/int8 product (csrc/quant_tiled.c) at decode batch sizes, read as GB/s of weight, against the
same sources at another git revision.

80 weights of Qwen2.5-1.5B's decoder shapes (60 of 3072 x 1536, 20 of 1536 x 8960; ~349 MB in int4, ~628 MB in
int8: more than the last-level cache) are multiplied one after another by --rows activation rows; a sweep over
all of them is timed. The kernel of this tree and the one built from --baseline's sources (same level, same
flags) run in one process, sweeps alternating (radixserve.bench.timing), and must agree bit for bit. Medians
of --rounds sweeps.

    python benchmarks/bench_tiled_rows.py --level avx512_vnni --bits 4 --rows 1 --baseline HEAD
    python benchmarks/bench_tiled_rows.py --level avx2 --bits 8 --rows 1,4,32 --baseline 1a48fb0
"""

from __future__ import annotations

import argparse
import functools
import tempfile
from pathlib import Path

import torch
from bench_extend_attention import baseline_csrc

from radixserve.bench.timing import median_times
from radixserve.kernels.build import CSRC, load_library
from radixserve.kernels.quant_tiled import HEADERS, SOURCE, TiledKernel
from radixserve.layers.quantization.formats import quantize
from radixserve.layers.quantization.tiled import TiledWeight, tile_weight
from radixserve.platform import QUANT_ISA_FLAGS

SHAPES = [(3072, 1536)] * 60 + [(1536, 8960)] * 20


def build(level: str, source_dir: Path, stem: str) -> TiledKernel:
    headers = tuple(source_dir / h.name for h in HEADERS)
    lib = load_library(source_dir / SOURCE.name, stem, QUANT_ISA_FLAGS[level], "tiled kernels", "none", headers)
    if lib is None:
        raise SystemExit(f"could not build the tiled kernels at {level}")
    return TiledKernel(lib, level)


def sweep(kernel: TiledKernel, weights: list[TiledWeight], xs: dict[int, torch.Tensor]) -> None:
    for w in weights:
        kernel.matmul(w, xs[w.shape[1]], torch.bfloat16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--level", default="avx512_vnni", help="avx512_vnni, avx_vnni or avx2 (the CPU must run it)")
    parser.add_argument("--bits", type=int, default=4, choices=(4, 8))
    parser.add_argument("--rows", default="1")
    parser.add_argument("--baseline", default="HEAD", help="git revision whose kernel sources to time beside")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    weights = [tile_weight(quantize(torch.randn(n, k) * 0.02, args.bits, per_channel=False)) for n, k in SHAPES]
    total = sum(w.data.numel() * w.data.element_size() for w in weights)
    with tempfile.TemporaryDirectory() as tmp:
        kernels = {"before": build(args.level, baseline_csrc(args.baseline, Path(tmp)), f"bench-tiled-base-{args.level}"),
                   "after": build(args.level, CSRC, f"bench-tiled-{args.level}")}
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(rows, k, dtype=torch.bfloat16) for k in {k for _, k in SHAPES}}
        for w in weights[:3] + weights[-1:]:
            x = xs[w.shape[1]]
            assert torch.equal(kernels["before"].matmul(w, x, torch.bfloat16), kernels["after"].matmul(w, x, torch.bfloat16))
        times = median_times({name: functools.partial(sweep, k, weights, xs) for name, k in kernels.items()},
                             args.rounds)
        cells = [f"{name} {t * 1e3:.2f} ms = {total / t / 1e9:.1f} GB/s" for name, t in times.items()]
        print(f"{args.level} int{args.bits} rows={rows} ({total / 1e6:.0f} MB): " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
