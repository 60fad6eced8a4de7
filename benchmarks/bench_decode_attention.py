"""Decode attention alone: the C decode kernel (csrc/decode_attention.c) now against the same kernel at git revision
--baseline, built at the same level with the same flags and timed in the same process (calls alternate; medians).

Cases are batch x context tokens, on a pool with scattered slots (a long-running server's pool), for three head
shapes: SmolLM2-135M (dim 64, 9 query / 3 kv heads), Qwen2.5-0.5B/1.5B-like (dim 128, 14 / 2) and Gemma-3-1B-like
(dim 256, 4 / 1). A decode unit is a (request, kv head) pair at a batch smaller than the thread count, so a model
with fewer kv heads than threads leaves threads idle at batch 1 unless a long context is split into parts
(`context_parts` in decode_attention.c); these cases show what the split wins there and what it costs where the
batch already keeps every thread busy.

    python benchmarks/bench_decode_attention.py --baseline 01c6474            # table + docs/benchmarks.md section
    python benchmarks/bench_decode_attention.py --baseline main --isas avx2 --dtypes float32 --no-docs
"""

from __future__ import annotations

import argparse
import ctypes
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from bench_extend_attention import baseline_sources

from radixserve import platform as rs_platform
from radixserve.bench.docs import cpu_header, write_doc_section
from radixserve.bench.timing import median_times
from radixserve.kernels import attention as attn
from radixserve.kernels.build import build_level_library

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
START, END = "<!-- bench_decode_attention:start -->", "<!-- bench_decode_attention:end -->"
HEADS = {"d64 9/3": (64, 9, 3), "d128 14/2": (128, 14, 2), "d256 4/1": (256, 4, 1)}  # dim, heads, kv heads
CASES = {"1 x 2048": (1, 2048), "1 x 8192": (1, 8192), "8 x 1200": (8, 1200), "32 x 1000": (32, 1000)}
MIN_CALL_SECONDS = 2e-3  # one timed sample repeats the call until it lasts about this long
Fn = Callable[[], object]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", required=True, help="git revision whose kernel sources to time beside")
    p.add_argument("--isas", default=rs_platform.runnable_isas()[0], help="kernel levels to time")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--heads", default=",".join(HEADS), help="of: " + ", ".join(HEADS))
    p.add_argument("--cases", default=",".join(CASES), help="requests x context tokens, of: " + ", ".join(CASES))
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--no-docs", action="store_true")
    return p.parse_args()


def repeated(fn: Fn) -> tuple[Fn, int]:
    """fn called enough times per sample that one sample lasts about MIN_CALL_SECONDS, and that count."""
    fn()
    start = time.perf_counter()
    fn()
    reps = max(1, int(MIN_CALL_SECONDS / max(time.perf_counter() - start, 1e-7)))

    def run() -> None:
        for _ in range(reps):
            fn()

    return run, reps


def case(batch: int, context: int, head: tuple[int, int, int], dtype: torch.dtype, kernel: attn.DecodeKernel,
         baseline: ctypes.CDLL) -> dict[str, tuple[Fn, int]]:
    """name -> (fn running one decode batch that many times); asserts that both kernels agree first."""
    dim, heads, kv_heads = head
    g = torch.Generator().manual_seed(0)
    slots = batch * context + 64
    k_buf, v_buf = (torch.randn(slots, kv_heads, dim, generator=g).to(dtype) for _ in "kv")
    table = ((torch.randperm(slots - 1, generator=g) + 1)[: batch * context]).to(torch.int32).contiguous()
    q = torch.randn(batch, heads, dim, generator=g).to(dtype)
    seq_lens = torch.full((batch,), context, dtype=torch.int64)
    scale = dim**-0.5
    old = attn._bind(baseline, f"decode_attention_{attn._DTYPE_SUFFIX[dtype]}_{kernel.isa}", pointers=8, sizes=5)

    def before() -> torch.Tensor:
        out = torch.empty_like(q)
        status = old(q.data_ptr(), k_buf.data_ptr(), v_buf.data_ptr(), table.data_ptr(), seq_lens.data_ptr(), None,
                     None, out.data_ptr(), batch, context, heads, kv_heads, dim, scale, torch.get_num_threads())
        assert status == 0
        return out

    def now() -> torch.Tensor:
        return kernel(q, k_buf, v_buf, table, seq_lens, context, scale)

    assert torch.allclose(before().float(), now().float(), atol=2e-2 if dtype == torch.bfloat16 else 1e-5)
    return {"before": repeated(before), "now": repeated(now)}


Key = tuple[str, str, str, str]  # isa, dtype, heads, case


def run(args: argparse.Namespace, tmp: Path) -> dict[Key, dict[str, float]]:
    sources, headers = baseline_sources(args.baseline, tmp)
    torch.set_num_threads(args.threads)
    results: dict[Key, dict[str, float]] = {}
    for isa in args.isas.split(","):
        kernel = attn.load_decode_kernel(isa)
        assert kernel is not None and kernel.isa == isa, f"no {isa} kernels here"
        baseline = ctypes.CDLL(str(build_level_library("attention-baseline", sources, isa, headers)))
        for dtype_name in args.dtypes.split(","):
            for head in args.heads.split(","):
                for name in args.cases.split(","):
                    fns = case(*CASES[name], HEADS[head], getattr(torch, dtype_name), kernel, baseline)
                    times = median_times({n: fn for n, (fn, _) in fns.items()}, args.rounds)
                    key = (isa, dtype_name, head, name)
                    results[key] = {n: 1e6 * t / fns[n][1] for n, t in times.items()}
                    print(" ".join(key) + ": " + ", ".join(f"{n} {t:.1f} us" for n, t in results[key].items())
                          + f", before / now {results[key]['before'] / results[key]['now']:.2f}x", flush=True)
    return results


def render(results: dict[Key, dict[str, float]], args: argparse.Namespace, load: tuple[float, float]) -> str:
    lines = [
        "## Decode attention: the kernel now against an earlier revision (`benchmarks/bench_decode_attention.py`)", "",
        f"{cpu_header()} torch {torch.__version__}, {args.threads} threads; load average {load[0]:.1f} at "
        f"start, {load[1]:.1f} at end. One decode batch (requests x context tokens) over a pool with scattered "
        f"slots; `before` is the decode kernel of `{args.baseline}`, built at the same level and timed in the same "
        "process, calls alternating; microseconds per call, medians.", "",
        f"Command: `python benchmarks/bench_decode_attention.py --baseline {args.baseline} --isas {args.isas} "
        f"--threads {args.threads} --dtypes {args.dtypes} --rounds {args.rounds}`", "",
        "| level | dtype | heads (dim q/kv) | requests x context | before us | now us | before / now |",
        "|---|---|---|---|---:|---:|---:|",
    ]
    for (isa, dtype, head, name), t in results.items():
        lines.append(f"| {isa} | {dtype} | {head} | {name} | {t['before']:.1f} | {t['now']:.1f} | "
                     f"**{t['before'] / t['now']:.2f}x** |")
    return "\n".join(lines) + "\n"


def main() -> None:
    args = parse_args()
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        results = run(args, Path(tmp))
    body = render(results, args, (load0, os.getloadavg()[0]))
    print(body)
    if not args.no_docs:
        write_doc_section(DOC, START, END, body)


if __name__ == "__main__":
    main()
