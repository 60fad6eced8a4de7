"""The benchmark scripts' own plumbing: the CPU-support table (bench_cpu_support.py) reads the default path's forward
figures by name, and the shape ladder (bench_ladder.py) hands the peer harness (bench_peers.py) every option it reads."""

from __future__ import annotations

import argparse
import ctypes
import inspect
import re
import sys
from pathlib import Path

import pytest
import torch

from radixserve import platform
from radixserve.kernels import attention as attn
from radixserve.kernels.build import build_level_library

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_ladder  # noqa: E402
import bench_peers  # noqa: E402
from bench_cold_prefill import BaselineKernel  # noqa: E402
from bench_cpu_support import FORWARD_LINE, forward_command  # noqa: E402
from bench_extend_attention import has_window  # noqa: E402


def _read(output: str) -> dict[str, float]:
    return {m.group(1): float(m.group(3)) for m in FORWARD_LINE.finditer(output)}


def test_the_after_figure_is_read_whether_or_not_other_paths_ran_first():
    both = ("prefill 1024 (1 threads): before 2392.9 tok/s, after 3191.4 tok/s\n"
            "decode bs=1 ctx=1024 (1 threads): before 17.9 tok/s, after 43.6 tok/s\n")
    assert _read(both) == {"prefill 1024": 3191.4, "decode bs=1 ctx=1024": 43.6}
    alone = "decode bs=32 ctx=1024 (2 threads): after 479.4 tok/s\n"
    assert _read(alone) == {"decode bs=32 ctx=1024": 479.4}
    assert _read("decode bs=1 ctx=1024 (1 threads): before 17.9 tok/s\n") == {}  # never another path's


def test_the_forward_run_asks_for_the_default_path_alone():
    args = argparse.Namespace(prefill_len=1024, context=1024, threads=1)
    cmd = forward_command(args, "auto")
    assert cmd[cmd.index("--paths") + 1] == "after"


def test_the_ladder_passes_every_option_the_peer_harness_reads(monkeypatch, tmp_path):
    read = {name for fn in (bench_peers.run_rounds, bench_peers.run_engine)
            for name in re.findall(r"\bargs\.(\w+)", inspect.getsource(fn))}
    seen = {}
    monkeypatch.setattr(bench_peers, "run_rounds", lambda args, folder: seen.setdefault("args", args) and [])
    monkeypatch.setattr(bench_peers, "summarize", lambda results: {})
    monkeypatch.setattr(sys, "argv", ["bench_ladder.py", "--vllm-kernel-class", "avx2", "--radixserve-dtype", "auto"])
    bench_ladder.run_shape("qwen2.5-0.5b", tmp_path, bench_ladder.parse_args())
    handed = seen["args"]
    assert read and not read - set(vars(handed)), f"bench_peers reads {sorted(read - set(vars(handed)))}, not handed"
    assert handed.vllm_kernel_class == "avx2" and handed.radixserve_dtype == "auto" and handed.scale == 0.25


def test_the_cold_prefill_baseline_calls_a_revision_kernel_with_its_signature():
    """bench_cold_prefill.py's `before` kernel (bench_extend_attention.baseline_extend, with the window argument
    where the revision's extend kernel takes one) runs a library built from kernel sources, here this tree's own,
    and gives the current kernel's output."""
    kernel = attn.load_decode_kernel(platform.kernel_isa())
    if kernel is None:
        pytest.skip("no C compiler here, so the native kernels cannot be built")
    lib = ctypes.CDLL(str(build_level_library("attention", attn.SOURCES, kernel.isa, attn.HEADERS)))
    before = BaselineKernel(kernel, lib, has_window(list(attn.SOURCES)))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(40, heads, 64, generator=g) for heads in (6, 2, 2))
    slots, reqs = torch.arange(40, dtype=torch.int32), torch.tensor([(0, 40, 0, 40)])
    got, _ = before.extend(q, k, v, slots, reqs, 0.125)
    want, _ = kernel.extend(q, k, v, slots, reqs, 0.125)
    assert torch.equal(got, want)
