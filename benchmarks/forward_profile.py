"""Where a forward's time goes, and what the machine can do: helpers of bench_forward.py and bench_roofline.py.

`machine_limits` measures the bf16 and float32 GEMM peak (a large square matmul) and the memory read
bandwidth (summing 1 GiB). `profile_step` runs one forward under torch.profiler and sorts the self
CPU time of its ops into GEMMs, attention, fused ops, the C decoder (all decoder layers of a decode
step in one call: its GEMMs, attention and passes are not told apart), other ops; whatever of the step's wall time (timed
without the profiler) no op accounts for is Python and dispatch between ops. It also counts the process's minor
page faults per step (`getrusage`): a block over malloc's mmap threshold, mapped afresh at every call, shows there
(cpu_memory.serve_from_heap). `instrument` marks the LM head and sampling (profiler ranges `bench::lm_head`,
`bench::sampling` around the runner's own calls): every op under such a range counts there instead of by its name.
"""

from __future__ import annotations

import contextlib
import resource
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

GEMM_OPS = {"aten::mm", "aten::addmm", "aten::matmul", "mkldnn::_linear_pointwise"}
ATTENTION_OPS = {"aten::_scaled_dot_product_flash_attention_for_cpu", "aten::bmm", "aten::_softmax",
                 "aten::index_select"}
KV_WRITE_OPS = {"aten::_index_put_impl_", "aten::index_put_"}
CATEGORIES = ("GEMM", "attention", "KV write", "fused ops", "C decoder", "LM head", "sampling", "other ops",
              "Python & dispatch")
MARKS = {"bench::lm_head": "LM head", "bench::sampling": "sampling"}  # profiler ranges set by `instrument`


@dataclass(frozen=True)
class Limits:
    bf16_gemm_gflops: float
    fp32_gemm_gflops: float
    read_gb_s: float


def machine_limits(size: int = 2048, seconds: float = 1.0) -> Limits:
    """Best-of timings: GEMM peak per dtype, and the read bandwidth of a 1 GiB float32 tensor."""
    def best(fn: Callable[[], object]) -> float:
        fn()
        times, deadline = [], time.perf_counter() + seconds
        while time.perf_counter() < deadline or len(times) < 3:
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    gflops = {}
    for dtype in (torch.bfloat16, torch.float32):
        a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
        gflops[dtype] = 2 * size**3 / best(lambda a=a, b=b: a @ b) / 1e9
    big = torch.ones(256 * 2**20)
    read = big.numel() * 4 / best(big.sum) / 1e9
    return Limits(gflops[torch.bfloat16], gflops[torch.float32], read)


def categorize(name: str) -> str:
    if name == "radixserve::decode_step":  # every decoder layer of a decode step, in one call
        return "C decoder"
    if name in GEMM_OPS or name.startswith("radixserve::linear::"):
        return "GEMM"
    if name.startswith("radixserve::fused::"):
        return "fused ops"
    if (name.startswith("radixserve::") and "attention" in name) or name in ATTENTION_OPS:
        return "attention"
    if name in KV_WRITE_OPS:
        return "KV write"
    return "other ops"


@dataclass(frozen=True)
class StepProfile:
    title: str
    path: str
    step_ms: float  # wall time of one step without the profiler (median)
    ms: dict[str, float]  # category -> ms per step
    gemm_gflops: float  # the step's linear-layer FLOPs over its time in GEMM ops
    table: str  # torch.profiler's own table, for stdout
    page_faults: float  # minor page faults of the process per step, median (a large tensor mapped afresh each time)

    def share(self, category: str) -> float:
        return self.ms[category] / self.step_ms if self.step_ms else 0.0


def profile_step(title: str, path: str, step: Callable[[], None], linear_flops: float, repeats: int = 3,
                 reset: Callable[[], None] | None = None) -> StepProfile:
    """Profiles `step` (a forward; `reset` undoes its state after each call) and splits its time."""
    from torch.profiler import ProfilerActivity, profile

    faults: list[int] = []

    def run_once() -> float:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        step()
        elapsed = time.perf_counter() - start
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        if reset is not None:
            reset()
        return elapsed

    run_once()
    faults.clear()
    wall = statistics.median(run_once() for _ in range(repeats)) * 1e3
    step_faults = statistics.median(faults)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(repeats):
            run_once()
    ms = dict.fromkeys(CATEGORIES, 0.0)
    # NOTE: record_function ranges (our fused ops) have no children, so self time is their time; an op under a
    # `bench::` mark counts as the mark's.
    for event in prof.events():
        ms[_marked(event) or categorize(event.name)] += event.self_cpu_time_total / 1e3 / repeats
    ms["Python & dispatch"] = max(0.0, wall - sum(ms.values()))
    gemm_s = ms["GEMM"] / 1e3
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14)
    return StepProfile(title, path, wall, ms, linear_flops / gemm_s / 1e9 if gemm_s else 0.0, table, step_faults)


def _marked(event) -> str | None:
    while event is not None:
        if event.name in MARKS:
            return MARKS[event.name]
        event = event.cpu_parent
    return None


@contextlib.contextmanager
def instrument(runner) -> Iterator[None]:
    """Marks the runner's LM head and sampling calls with profiler ranges (restored on exit)."""
    from torch.profiler import record_function

    head, sample = runner.model.lm_head, runner.sample
    head_forward = head.forward

    def marked_head(x: torch.Tensor) -> torch.Tensor:
        with record_function("bench::lm_head"):
            return head_forward(x)

    def marked_sample(*args, **kwargs) -> torch.Tensor:
        with record_function("bench::sampling"):
            return sample(*args, **kwargs)

    head.forward, runner.sample = marked_head, marked_sample
    try:
        yield
    finally:
        del head.forward, runner.sample


def linear_flops(model: torch.nn.Module, tokens: int, head_rows: int) -> float:
    """FLOPs of the linear layers of one forward of `tokens` tokens (`head_rows` rows reach the LM head)."""
    from radixserve.layers.linear import linear_layers

    total = 0.0
    for name, layer in linear_layers(model):
        rows = head_rows if name.endswith("lm_head") else tokens
        total += 2 * rows * layer.in_features * layer.out_features
    return total


def render_profiles(profiles: list[StepProfile], limits: Limits, dtype: str) -> str:
    peak = limits.bf16_gemm_gflops if dtype == "bfloat16" else limits.fp32_gemm_gflops
    lines = [f"Measured here: {dtype} GEMM peak {peak:.0f} GFLOP/s (2048^3 matmul, "
             f"{torch.get_num_threads()} threads; float32 {limits.fp32_gemm_gflops:.0f}, bf16 "
             f"{limits.bf16_gemm_gflops:.0f}), memory read {limits.read_gb_s:.1f} GB/s (sum of 1 GiB).", "",
             "| step | path | wall ms | " + " | ".join(CATEGORIES) + " | GEMM GFLOP/s (of peak) | page faults |",
             "|---|---|---:|" + "---:|" * len(CATEGORIES) + "---:|---:|"]
    for p in profiles:
        cells = [f"{p.ms[c]:.1f} ({100 * p.share(c):.0f}%)" for c in CATEGORIES]
        lines.append(f"| {p.title} | {p.path} | {p.step_ms:.1f} | " + " | ".join(cells)
                     + f" | {p.gemm_gflops:.0f} ({100 * p.gemm_gflops / peak:.0f}%) | {p.page_faults:.0f} |")
    return "\n".join(lines)
