"""Cold prefill tokens/s of the embedded model, the extend attention of git revision --baseline against this tree's,
side by side in one process.

One ModelRunner (default path, --dtype) prefills a fresh prompt of each --lengths length, alternating two
settings of its attention backend round by round: `before` runs the C extend kernel built from the --baseline
sources (same level and flags) under that revision's new-token cap (--before-cap: longer prompts go to torch's
SDPA; 2,048 since the kernel's float32 and AVX2 paths got faster, 512 before), `after` this tree's kernel and cap
(`RowTable.extend_kernel_new_tokens`, configs/row_table.py). Force a lower CPU class as elsewhere (RADIXSERVE_CPU_ISA and
ONEDNN_MAX_CPU_ISA).
Everything else (weights, GEMMs, pool) is shared. Medians of --rounds.

    python benchmarks/bench_cold_prefill.py --dtype bfloat16 --threads 1,2
    python benchmarks/bench_cold_prefill.py --dtype float32 --threads 2 --lengths 512,1024,2048 --baseline HEAD~1
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import tempfile
from pathlib import Path

import torch
from bench_extend_attention import baseline_extend, baseline_sources, has_window
from bench_forward import prefill_prompt, time_rounds
from direct import DirectDriver

from radixserve.bench.docs import cpu_header
from radixserve.kernels.attention import DecodeKernel
from radixserve.kernels.build import build_level_library
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.server_args import ServerArgs


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--lengths", default="512,1024,2048")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--baseline", default="main", help="git revision of the `before` kernel")
    p.add_argument("--before-cap", type=int, default=2048, help="the baseline's extend_kernel_new_tokens")
    return p.parse_args()


class BaselineKernel:
    """The baseline library's extend kernel behind DecodeKernel's extend interface (no window, no seed)."""

    def __init__(self, current: DecodeKernel, lib: ctypes.CDLL, windowed: bool) -> None:
        self.isa, self._current = current.isa, current
        self._fns = {dtype: baseline_extend(lib, current.isa, dtype, windowed)
                     for dtype in (torch.bfloat16, torch.float32)}

    def extend_supports(self, q: torch.Tensor, k_buf: torch.Tensor) -> bool:
        return self._current.extend_supports(q, k_buf)

    def extend(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, kv_indices: torch.Tensor,
               reqs: torch.Tensor, scale: float, seed=None, with_lse: bool = False,
               window: int = 0) -> tuple[torch.Tensor, None]:
        assert seed is None and not with_lse and window <= 0
        return self._fns[q.dtype](q.contiguous(), k_buf, v_buf, kv_indices.to(torch.int32).contiguous(),
                                  reqs.contiguous(), scale), None


def main() -> None:
    args = parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    runner = ModelRunner(ServerArgs(dtype=args.dtype, max_total_tokens=max(lengths) + 64))
    backend = runner.attn_backend
    current, plan = backend.extend_kernel, backend.plan
    cap = plan.rows.extend_kernel_new_tokens
    assert current is not None, "the C extend kernel is not in use here"
    with tempfile.TemporaryDirectory() as tmp:
        sources, headers = baseline_sources(args.baseline, Path(tmp))
        lib = ctypes.CDLL(str(build_level_library("attention-baseline", sources, current.isa, headers)))
        before = BaselineKernel(current, lib, has_window(sources))
    driver = DirectDriver(runner)

    def run(prompt: list[int], kernel: object, max_new: int) -> None:
        backend.extend_kernel = kernel
        backend.plan = dataclasses.replace(plan, rows=dataclasses.replace(plan.rows, extend_kernel_new_tokens=max_new))
        req = driver.new_request()
        driver.extend([req], [prompt])
        driver.release([req])

    rows = []
    for threads in map(int, args.threads.split(",")):
        torch.set_num_threads(threads)
        for n in lengths:
            prompt = prefill_prompt(runner, n)
            secs = time_rounds({"before": lambda p=prompt: run(p, before, args.before_cap),
                                "after": lambda p=prompt: run(p, current, cap)}, args.rounds)
            rows.append((threads, n, n / secs["before"], n / secs["after"]))
            print(f"{threads} thread(s), {n} tokens: before {rows[-1][2]:.0f} tok/s, after {rows[-1][3]:.0f} tok/s, "
                  f"{secs['before'] / secs['after']:.2f}x", flush=True)
    backend.extend_kernel, backend.plan = current, plan
    print(f"\n{cpu_header()}; torch {torch.__version__}; {args.dtype}; kernels at {current.isa}; "
          f"before = {args.baseline} (cap {args.before_cap}), after = this tree (cap {cap}); median of {args.rounds}\n")
    print("| threads | prompt tokens | before tok/s | after tok/s | after / before |\n|---:|---:|---:|---:|---:|")
    for threads, n, old, new in rows:
        print(f"| {threads} | {n} | {old:.0f} | {new:.0f} | {new / old:.2f}x |")


if __name__ == "__main__":
    main()
