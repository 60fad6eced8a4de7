"""Causal extend (prefill) attention alone: the C extend kernel (csrc/extend_attention.c) against torch's SDPA.

Shapes: 1 request x 1,024 and 4 x 256 new tokens (no cached prefix), for head dim 64 with 9 query / 3 kv
heads (SmolLM2-135M) and head dim 128 with 8 / 2, in bf16 and float32, at every kernel level this CPU runs
(--isas) and each --threads count. The kernel reads K/V in place from a pool through slots; SDPA (causal,
`is_causal=True`, GQA) runs per request over the same data, gathered contiguous beforehand (untimed), as
the backend's torch path does. With --baseline REV the kernel sources of git revision REV are built too
(same level, same flags) and timed beside the current ones, so the before/after ratio comes from one
process. Calls alternate; medians of --rounds. torch runs at this CPU's own level whatever --isas says
(force torch's with ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA, bench.docs.TORCH_ISA_ENV).

    python benchmarks/bench_extend_attention.py                    # table + docs/benchmarks.md section
    python benchmarks/bench_extend_attention.py --baseline main --no-docs
"""

from __future__ import annotations

import argparse
import ctypes
import io
import os
import subprocess
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from radixserve import platform as rs_platform
from radixserve.bench.docs import cpu_header, write_doc_section
from radixserve.bench.timing import median_times
from radixserve.kernels import attention as attn
from radixserve.kernels.build import build_level_library
from radixserve.layers.attention.torch_backend import _causal_sdpa

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
START, END = "<!-- bench_extend_attention:start -->", "<!-- bench_extend_attention:end -->"
HEADS = {"d64 9/3": (64, 9, 3), "d128 8/2": (128, 8, 2)}  # head dim, query heads, kv heads
SHAPES = {"1 x 1024": [1024], "4 x 256": [256] * 4, "1 x 2048": [2048]}
Fn = Callable[[], object]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--isas", default=",".join(rs_platform.runnable_isas()), help="kernel levels to time")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--heads", default=",".join(HEADS), help="head shapes, of: " + ", ".join(HEADS))
    p.add_argument("--shapes", default="1 x 1024,4 x 256", help="requests x new tokens, of: " + ", ".join(SHAPES))
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--baseline", default="", help="git revision whose kernel sources to time beside (e.g. main)")
    p.add_argument("--no-docs", action="store_true")
    return p.parse_args()


def baseline_csrc(rev: str, into: Path) -> Path:
    """The kernel sources folder (radixserve/kernels/csrc) of git revision `rev`, extracted under `into`."""
    tar = subprocess.run(["git", "archive", rev, "radixserve/kernels/csrc"], cwd=ROOT, capture_output=True,
                         check=True).stdout
    tarfile.open(fileobj=io.BytesIO(tar)).extractall(into, filter="data")
    return into / "radixserve" / "kernels" / "csrc"


def baseline_sources(rev: str, into: Path) -> tuple[list[Path], list[Path]]:
    """The attention kernel sources and headers of git revision `rev`, extracted under `into`."""
    csrc = baseline_csrc(rev, into)
    headers = [csrc / p.name for p in attn.HEADERS if (csrc / p.name).exists()]  # an older revision has fewer
    return [csrc / p.name for p in attn.SOURCES], headers


def baseline_extend(lib: ctypes.CDLL, isa: str, dtype: torch.dtype, windowed: bool) -> Callable[..., torch.Tensor]:
    """extend(q, k, v, slots, reqs, scale) with the baseline library's C signature: with the sliding-window size
    (passed 0, none) before the scale where the revision has it (`windowed`), else without."""
    fn = attn._bind(lib, f"extend_attention_{attn._DTYPE_SUFFIX[dtype]}_{isa}", pointers=9, sizes=5 if windowed else 4)

    def extend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, reqs: torch.Tensor,
               scale: float) -> torch.Tensor:
        out = torch.empty_like(q)
        sizes = (reqs.shape[0], q.shape[1], k.shape[1], q.shape[2]) + ((0,) if windowed else ())
        status = fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), slots.data_ptr(), reqs.data_ptr(), 0, 0,
                    out.data_ptr(), 0, *sizes, scale, torch.get_num_threads())
        assert status == 0
        return out

    return extend


def has_window(sources: list[Path]) -> bool:
    """Whether the extend kernel among `sources` takes a sliding-window size (added after the first version)."""
    text = next(p for p in sources if p.name == "extend_attention.c").read_text()
    signature = text[text.index("EXPORT(extend_attention_f32)"):]
    return "int64_t window" in signature[: signature.index(")", signature.index("num_threads"))]


def case(lengths: list[int], head: tuple[int, int, int], dtype: torch.dtype, kernel: attn.DecodeKernel,
         baseline: ctypes.CDLL | None, windowed: bool = True) -> dict[str, Fn]:
    """name -> fn running one batch of requests (`lengths` new tokens each, nothing cached)."""
    dim, heads, kv_heads = head
    g = torch.Generator().manual_seed(0)
    total, scale = sum(lengths), dim**-0.5
    q = torch.randn(total, heads, dim, generator=g).to(dtype)
    pool = total + 64  # a pool with other rows; each request's slots are contiguous, as after a fresh prefill
    k_buf, v_buf = (torch.randn(pool, kv_heads, dim, generator=g).to(dtype) for _ in "kv")
    slots = (torch.arange(total, dtype=torch.int32) + 32).contiguous()
    k, v = k_buf[slots.long()], v_buf[slots.long()]  # SDPA's gathered copy (untimed)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    reqs = torch.tensor([(s, n, s, n) for s, n in zip(starts, lengths, strict=True)], dtype=torch.int64)

    def sdpa() -> None:
        out = torch.empty_like(q)
        for s, n in zip(starts, lengths, strict=True):
            out[s : s + n] = _causal_sdpa(q[s : s + n], k[s : s + n], v[s : s + n], None, scale)

    fns: dict[str, Fn] = {"sdpa": sdpa, "kernel": lambda: kernel.extend(q, k_buf, v_buf, slots, reqs, scale)}
    if baseline is not None:
        old = baseline_extend(baseline, kernel.isa, dtype, windowed)
        fns["baseline"] = lambda: old(q, k_buf, v_buf, slots, reqs, scale)
        assert torch.allclose(old(q, k_buf, v_buf, slots, reqs, scale).float(),
                              kernel.extend(q, k_buf, v_buf, slots, reqs, scale)[0].float(), atol=2e-2)
    return fns


def measure(fns: dict[str, Fn], rounds: int) -> dict[str, float]:
    """Median milliseconds per call of each fn, the calls alternating."""
    return {name: 1e3 * t for name, t in median_times(fns, rounds).items()}


Key = tuple[str, int, str, str, str]  # isa, threads, dtype, heads, shape


def run(args: argparse.Namespace, tmp: Path) -> dict[Key, dict[str, float]]:
    old_sources = baseline_sources(args.baseline, tmp) if args.baseline else None
    results: dict[Key, dict[str, float]] = {}
    for isa in args.isas.split(","):
        kernel = attn.load_decode_kernel(isa)
        assert kernel is not None and kernel.isa == isa, f"no {isa} kernels here"
        baseline = None
        if old_sources is not None:
            baseline = ctypes.CDLL(str(build_level_library("attention-baseline", old_sources[0], isa,
                                                           old_sources[1])))
        for threads in map(int, args.threads.split(",")):
            torch.set_num_threads(threads)
            for dtype_name in args.dtypes.split(","):
                for head in args.heads.split(","):
                    for shape in args.shapes.split(","):
                        fns = case(SHAPES[shape], HEADS[head], getattr(torch, dtype_name), kernel, baseline,
                                   old_sources is not None and has_window(old_sources[0]))
                        key = (isa, threads, dtype_name, head, shape)
                        results[key] = measure(fns, args.rounds)
                        print(" ".join(map(str, key)) + ": "
                              + ", ".join(f"{n} {t:.2f} ms" for n, t in results[key].items()), flush=True)
    return results


def render(results: dict[Key, dict[str, float]], args: argparse.Namespace, load: tuple[float, float]) -> str:
    old = bool(args.baseline)
    lines = [
        "## Extend (prefill) attention kernel vs SDPA (`benchmarks/bench_extend_attention.py`)", "",
        f"{cpu_header()}; {os.cpu_count()} logical CPUs; torch {torch.__version__} (its SDPA at this CPU's own "
        f"level whatever our level); load average {load[0]:.1f} at start, {load[1]:.1f} at end. Causal attention "
        "of fresh prompts; SDPA over the gathered K/V, per request; the kernel over the pool through slots. "
        f"Milliseconds per batch, median of {args.rounds} alternating calls."
        + (f" `before` is the kernel of `{args.baseline}`, built at the same level and timed in the same "
           "process." if old else ""), "",
        f"Command: `python benchmarks/bench_extend_attention.py --isas {args.isas} --threads {args.threads} "
        f"--dtypes {args.dtypes} --rounds {args.rounds}" + (f" --baseline {args.baseline}" if old else "") + "`", "",
        "| level | threads | dtype | heads | requests x tokens | SDPA ms | "
        + ("before ms | " if old else "") + "kernel ms | SDPA / kernel |" + (" before / kernel |" if old else ""),
        "|---|---:|---|---|---|---:|" + "---:|" * (4 if old else 2),
    ]
    for (isa, threads, dtype, head, shape), t in results.items():
        cells = [f"{t['sdpa']:.2f}"] + ([f"{t['baseline']:.2f}"] if old else []) + [f"{t['kernel']:.2f}",
                                                                                   f"{t['sdpa'] / t['kernel']:.2f}x"]
        if old:
            cells.append(f"{t['baseline'] / t['kernel']:.2f}x")
        lines.append(f"| {isa} | {threads} | {dtype} | {head} | {shape} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    load_start = os.getloadavg()[0]
    with torch.inference_mode(), tempfile.TemporaryDirectory() as tmp:
        results = run(args, Path(tmp))
    body = render(results, args, (load_start, os.getloadavg()[0]))
    print(body)
    if not args.no_docs:
        write_doc_section(DOC, START, END, body)
        print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
