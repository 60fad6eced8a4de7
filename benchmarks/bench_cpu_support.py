"""What each CPU class gets: the dtype `auto` picks, the C kernels used, forward throughput, W1/W2/W3 wall.

One machine with AVX-512 BF16 and AMX stands in for every class of `radixserve.bench.docs.CPU_CLASSES`
(amx: the machine as it is; avx512_bf16: a Zen 4; avx512: Skylake-SP .. Ice Lake; avx2: AVX2-only EPYC
or Xeon; portable: no AVX2). Each class runs in its own processes with `class_env`: RADIXSERVE_CPU_ISA
for our kernels and dtype decision, and torch's own switches (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA,
MKL_ENABLE_INSTRUCTIONS) so that torch's GEMMs and SDPA run the code they would run there. A class in
--ours-only also gets a row with RADIXSERVE_CPU_ISA alone (torch keeps the machine's best code). Per
class: a probe (dtype and reason, kernels, bf16/float32 matmul time), `benchmarks/bench_forward.py
--only-ours` (prefill of --prefill-len tokens, decode at batch 1 and 32 with --context tokens) and
`radixserve bench --workloads w1,w2,w3 --modes on`, all with --threads torch threads. An --explicit
CLASS:DTYPE row runs that class with an explicit --dtype instead of auto (default: avx2 in bf16, the
choice `auto` used to make there).

    python benchmarks/bench_cpu_support.py                # table + docs/benchmarks.md "CPU support" section
    python benchmarks/bench_cpu_support.py --classes avx2 --no-docs
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

from radixserve.bench.docs import class_env, cpu_header, runnable_classes, write_doc_section

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- bench_cpu_support:begin -->", "<!-- bench_cpu_support:end -->"
# NOTE: bench_forward names each path it ran ("before 19.0 tok/s, after 42.4 tok/s"); the table is the default
# path's (`after`), asked for alone and read by its name, never the first figure on the line
FORWARD_LINE = re.compile(r"^(prefill \d+|decode bs=(\d+) ctx=\d+) \(\d+ threads\): (?:.*?, )?after ([0-9.]+) tok/s",
                          re.M)
WALL_ROW = re.compile(r"^\| (W\d) \| on \| ([0-9.]+) \|", re.M)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--classes", default=",".join(runnable_classes()))
    p.add_argument("--ours-only", default="avx2", help="classes also run with RADIXSERVE_CPU_ISA alone")
    p.add_argument("--explicit", default="avx2:bfloat16",
                   help="CLASS:DTYPE rows run with an explicit --dtype instead of auto (what auto avoids)")
    p.add_argument("--threads", type=int, default=1, help="torch threads everywhere (1: steadier when shared)")
    p.add_argument("--prefill-len", type=int, default=1024)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=1, help="rounds over all classes; medians per cell")
    p.add_argument("--probe", default=None, help=argparse.SUPPRESS)
    p.add_argument("--no-docs", action="store_true", help="do not touch docs/")
    return p.parse_args()


def probe(dtype: str) -> dict:
    """In this process's environment: the dtype `dtype` resolves to and why, the C kernels it uses, torch's view."""
    import torch

    from radixserve import platform
    from radixserve.layers.attention.registry import plan_attention

    choice = platform.choose_dtype(dtype, "cpu")
    plan = plan_attention("cpu", torch.device("cpu"))
    return {"dtype": choice.dtype, "reason": choice.reason, "kernels": plan.used(getattr(torch, choice.dtype)),
            "level": plan.level or "none", "class": platform.kernel_class(),
            "torch": torch.backends.cpu.get_cpu_capability(), "bf16_slowdown": platform.measure_bf16_slowdown()}


def forward_command(args: argparse.Namespace, dtype: str = "auto") -> list[str]:
    return ["benchmarks/bench_forward.py", "--only-ours", "--backend", "cpu",
            "--paths", "after", "--dtype", dtype, "--batches", "1,32", "--prefill-len", str(args.prefill_len), "--context",
            str(args.context), "--steps", "4", "--rounds", "3", "--threads", str(args.threads), "--no-docs"]


def bench_command(args: argparse.Namespace, dtype: str = "auto") -> list[str]:
    # NOTE: the CLI of this Python's environment, whether or not that environment is on PATH
    cli = Path(sys.executable).with_name("radixserve")
    return [str(cli) if cli.exists() else "radixserve", "bench", "--workloads", "w1,w2,w3", "--modes", "on", "--torch-threads", str(args.threads),
            "--dtype", dtype, "--output", "", "--plot", ""]


def run(cmd: list[str], env: dict[str, str]) -> str:
    done = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def measure(env: dict[str, str], dtype: str, args: argparse.Namespace) -> dict:
    facts = json.loads(run([sys.executable, str(Path(__file__).resolve()), "--probe", dtype], env).strip().splitlines()[-1])
    forward = run([sys.executable, *forward_command(args, dtype)], env)
    for match in FORWARD_LINE.finditer(forward):
        key = "prefill" if match.group(1).startswith("prefill") else f"decode bs{match.group(2)}"
        facts[key] = float(match.group(3))
    walls = run(bench_command(args, dtype), env)
    facts |= {w: float(wall) for w, wall in WALL_ROW.findall(walls)}
    print(f"# {env}: {facts}", file=sys.stderr, flush=True)
    return facts


def rows_to_measure(args: argparse.Namespace) -> list[tuple[str, dict[str, str], str]]:
    """(row name, environment, --dtype) of every row."""
    rows = [(c, class_env(c), "auto") for c in args.classes.split(",")]
    rows += [(f"{c}, ours only", class_env(c, torch_follows=False), "auto") for c in args.ours_only.split(",") if c]
    for spec in filter(None, args.explicit.split(",")):
        cpu_class, dtype = spec.split(":")
        rows.append((f"{cpu_class}, --dtype {dtype}", class_env(cpu_class), dtype))
    return rows


NUMBERS = ("prefill", "decode bs1", "decode bs32", "W1", "W2", "W3")


def render(results: dict[str, list[dict]], envs: dict[str, dict[str, str]], args: argparse.Namespace,
           load: tuple[float, float]) -> str:
    lines = [
        "## CPU support: what each CPU class gets (`benchmarks/bench_cpu_support.py`)", "",
        f"Measured on one machine standing in for each class: {cpu_header()}. Each class runs with the "
        "environment in its row: `RADIXSERVE_CPU_ISA` forces our kernel level and hides the features above it "
        "from `--dtype auto`; torch's own switches (`ATEN_CPU_CAPABILITY` for ATen's vectorized ops and SDPA, "
        "`ONEDNN_MAX_CPU_ISA` for oneDNN's GEMMs, bf16 included, `MKL_ENABLE_INSTRUCTIONS` for MKL's float32 "
        "GEMMs) make torch run the code it would run on such a CPU. **Forcing `RADIXSERVE_CPU_ISA` alone changes "
        "only our kernels**: torch's GEMMs keep AVX-512/AMX (the `ours only` row). oneDNN does not follow "
        "`ATEN_CPU_CAPABILITY`: it needs its own switch. "
        f"{args.threads} torch thread(s); load average {load[0]:.1f} at start, {load[1]:.1f} at end; "
        f"{args.rounds} round(s) over the classes, medians.", "",
        f"Command: `python benchmarks/bench_cpu_support.py --classes {args.classes} --ours-only {args.ours_only} "
        f"--threads {args.threads} --prefill-len {args.prefill_len} --context {args.context} --rounds "
        f"{args.rounds} --explicit {args.explicit}`; per class `python {shlex.join(forward_command(args))}` and "
        f"`{shlex.join(bench_command(args))}` (the `--dtype <dtype>` rows pass theirs instead of auto).",
        "", "| class | environment | torch | dtype (why) | C kernels used | bf16 / f32 matmul time | "
        f"prefill {args.prefill_len} tok/s | decode bs1 tok/s | decode bs32 tok/s | W1 wall s | W2 wall s | "
        "W3 wall s |", "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, runs in results.items():
        first = runs[0]
        env = " ".join(f"{k}={v}" for k, v in envs[name].items()) or "(none)"
        cells = [f"{statistics.median(r[key] for r in runs):.1f}" if all(key in r for r in runs) else "n/a"
                 for key in NUMBERS]
        lines.append(f"| {name} | `{env}` | {first['torch']} | {first['dtype']} ({first['reason']}) | "
                     f"{', '.join(first['kernels']) or 'none'} ({first['level']}) | {first['bf16_slowdown']:.2f} | "
                     + " | ".join(cells) + " |")
    lines += ["", "Which kernel runs where and why: [attention.md](attention.md#kernel-levels)."]
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    if args.probe:
        print(json.dumps(probe(args.probe)))
        return
    load_start = os.getloadavg()[0]
    plan = rows_to_measure(args)
    results: dict[str, list[dict]] = {name: [] for name, _, _ in plan}
    for _ in range(args.rounds):
        for name, env, dtype in plan:
            results[name].append(measure(env, dtype, args))
    section = render(results, {name: env for name, env, _ in plan}, args, (load_start, os.getloadavg()[0]))
    print("\n" + section)
    if not args.no_docs:
        write_doc_section(DOCS, BEGIN, END, section)
        print(f"wrote {DOCS}", file=sys.stderr)


if __name__ == "__main__":
    main()
