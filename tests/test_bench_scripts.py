"""The benchmark scripts' own plumbing: the CPU-support table (bench_cpu_support.py) reads the default path's forward
figures by name, and the shape ladder (bench_ladder.py) hands the peer harness (bench_peers.py) every option it reads."""

from __future__ import annotations

import argparse
import inspect
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_ladder  # noqa: E402
import bench_peers  # noqa: E402
from bench_cpu_support import FORWARD_LINE, forward_command  # noqa: E402


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
