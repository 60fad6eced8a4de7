"""`radixserve bench`: W1/W2/W3 with the radix cache on and off, side by side in one run."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import re
import shlex
import statistics
import sys
import time
from typing import Any

from radixserve.bench import report, roofline
from radixserve.bench.docs import cpu_header
from radixserve.bench.runner import Backend, EngineBackend, WorkloadResult, run_workload
from radixserve.bench.workloads import Prompt, build_workloads
from radixserve.server_args import ServerArgs

# Bench defaults that differ from a server's: a pool that holds W1 with the cache off (32 x 1,072 tokens).
BENCH_SERVER_DEFAULTS = {"max_total_tokens": 40960, "log_level": "warning"}
W2_MIN_REPEATS = 3


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workloads", default="w1,w2,w3", help="comma-separated workloads (default: %(default)s)")
    parser.add_argument("--modes", default="on,off",
                        help="radix cache modes to compare: on, off or both (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs per workload and mode, modes alternating; the median wall is kept; W2, whose "
                             f"criterion is a 3%% difference, runs at least {W2_MIN_REPEATS} times "
                             "(default: %(default)s)")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="shrink every workload length and count by this factor, for a smoke run "
                             "(default: %(default)s)")
    parser.add_argument("--backend", choices=("engine", "http"), default="engine",
                        help="engine: in-process Engine per mode; http: a running server at --base-url "
                             "(default: %(default)s)")
    parser.add_argument("--base-url", default="http://127.0.0.1:30000",
                        help="server for --backend http (default: %(default)s)")
    parser.add_argument("--label", default=None,
                        help="mode label of the http run, e.g. 'on' or 'off' (default: the first of --modes)")
    parser.add_argument("--output", default="docs/benchmarks.md",
                        help="markdown file whose bench section is replaced; '' to skip (default: %(default)s)")
    parser.add_argument("--plot", default="docs/bench_radix_cache.png",
                        help="PNG of wall time and TTFT; '' to skip (default: %(default)s)")
    ServerArgs.add_cli_args(parser)
    for action in parser._actions:  # NOTE: keep --help truthful about the bench's own defaults
        if action.dest in BENCH_SERVER_DEFAULTS:
            action.default = BENCH_SERVER_DEFAULTS[action.dest]
            action.help = re.sub(r"\(default: [^)]*\)", f"(default: {action.default}, for the bench)", action.help)


class _FreshEngines:
    """A new Engine (same weights in memory) for every run, so each run starts from an identical, empty pool.

    Reusing one engine would let a run inherit the previous run's slot layout and memory state, which
    showed up as a systematic few-percent difference between modes that had nothing to do with the cache.
    """

    def __init__(self, server_args: ServerArgs) -> None:
        self.server_args = server_args
        print("[bench] loading the model ...", flush=True)
        start = time.perf_counter()
        first = self.open("on")
        self.loaded, self.tokenizer = first.engine.model_runner.loaded, first.engine.tokenizer
        runner = first.engine.model_runner
        print(f"[bench] ready in {time.perf_counter() - start:.1f} s: {self.loaded.name}, {runner.dtype}, "
              f"KV pool {runner.max_total_num_tokens} tokens", flush=True)
        self.config, self.formats = runner.model_config, roofline.Formats.of_runner(runner)
        self.close(first)
        # NOTE: measured with no engine running, before the workloads: the roofline's bandwidth and GEMM rate.
        self.rates = roofline.measure_rates(self.config, [self.formats.compute]) if self.formats else None
        if self.rates:
            print(f"[bench] roofline: {self.rates.describe()}; {self.formats.describe()}", flush=True)

    def open(self, mode: str) -> EngineBackend:
        from radixserve.entrypoints.engine import Engine

        kwargs = dataclasses.asdict(self.server_args.replace(disable_radix_cache=mode == "off"))
        engine = Engine(loaded_model=getattr(self, "loaded", None), **kwargs)
        _warm_up(engine)
        return EngineBackend(engine, mode)

    @staticmethod
    def close(backend: Backend) -> None:
        backend.engine.shutdown()
        del backend
        gc.collect()


class _OneServer:
    """An HTTP server: the same backend for every run (one mode per server)."""

    def __init__(self, args: argparse.Namespace, modes: list[str]) -> None:
        try:
            from radixserve.bench.http_backend import HttpBackend  # written by the server work
        except ImportError as e:
            raise SystemExit(f"--backend http is not available in this build: {e}") from e
        self.backend = HttpBackend(args.base_url, args.label or modes[0])
        self.tokenizer = self.backend.tokenizer

    def open(self, mode: str) -> Backend:
        return self.backend

    def close(self, backend: Backend) -> None:
        pass


def _warm_up(engine: Any) -> None:
    """One short request (first-call costs), then an empty tree so no workload starts warm."""
    engine.generate(input_ids=list(range(1000, 1064)), sampling_params={"max_new_tokens": 4, "temperature": 0})
    engine.flush_cache()


def run_bench(args: argparse.Namespace) -> dict[tuple[str, str], WorkloadResult]:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in ("on", "off") for m in modes):
        raise SystemExit(f"--modes must list on and/or off, got {args.modes!r}")
    if args.backend == "engine":
        print(f"[bench] {cpu_header(args.dtype)}", flush=True)
        backends: Any = _FreshEngines(ServerArgs.from_cli_args(args))
    else:
        backends = _OneServer(args, modes)
        modes = [args.label or modes[0]]
    workloads = build_workloads(backends.tokenizer, [w.strip() for w in args.workloads.split(",")], args.scale)
    results = _run_all(backends, modes, workloads, max(args.repeats, 1))
    _report(args, results, backends)
    return results


def _roofline(results: dict[tuple[str, str], WorkloadResult], backends: Any) -> str:
    """The roofline section (engine backend with float weights only: the config, formats and rates are its)."""
    rates = getattr(backends, "rates", None)
    table = rates and report.roofline_table(results, backends.config, backends.formats, rates)
    if not table:
        return ""
    return (f"Roofline (radixserve/bench/roofline.py; measured at the start: {rates.describe()}; "
            f"{backends.formats.describe()}):\n\n{table}")


def _run_all(backends: Any, modes: list[str], workloads: list, repeats: int) -> dict[tuple[str, str], WorkloadResult]:
    runs: dict[tuple[str, str], list[WorkloadResult]] = {}
    for workload in workloads:
        print(f"[bench] {workload.name}: {workload.description}, {workload.max_new_tokens} new tokens, "
              f"{workload.num_requests} requests", flush=True)
        runs_here = max(repeats, W2_MIN_REPEATS) if workload.name == "W2" and len(modes) > 1 else repeats
        for rep in range(runs_here):
            for mode in modes if rep % 2 == 0 else modes[::-1]:
                backend = backends.open(mode)
                try:
                    backend.flush_cache()
                    res = run_workload(backend, workload)
                finally:
                    backends.close(backend)
                s = res.summary()
                print(f"[bench]   cache {mode:3s} run {rep + 1}/{runs_here}: wall {s['wall_s']:.2f} s, mean TTFT "
                      f"{s['ttft_mean_s']:.3f} s, hit rate {s['hit_rate']:.1%}, prefill computed "
                      f"{s['prefill_computed']}", flush=True)
                runs.setdefault((workload.name, mode), []).append(res)
    return {key: _median_run(rs) for key, rs in runs.items()}


def _median_run(runs: list[WorkloadResult]) -> WorkloadResult:
    walls = sorted(r.wall_s for r in runs)
    median = statistics.median_low(walls)
    return next(r for r in runs if r.wall_s == median)


def _report(args: argparse.Namespace, results: dict[tuple[str, str], WorkloadResult], backends: Any) -> None:
    table = report.table(results)
    checks = report.threshold_checks(results)
    print("\n" + table + "\n")
    if checks:
        print(report.format_checks(checks) + "\n")
    bounds = _roofline(results, backends)
    if bounds:
        print(bounds + "\n")
    if args.plot:
        if report.plot(results, args.plot):
            print(f"[bench] wrote {args.plot}")
        else:
            args.plot = ""  # NOTE: the markdown links the plot only when it was drawn
    if args.output:
        report.write_section(args.output, _markdown(args, table, checks, results, bounds))
        print(f"[bench] wrote the bench section of {args.output}")


def _markdown(args: argparse.Namespace, table: str, checks: list, results: dict, bounds: str = "") -> str:
    command = "radixserve " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:2] == ["bench"] \
        else "radixserve bench"
    server_args = ServerArgs.from_cli_args(args)
    parts = [
        "## Scheduler: radix cache on vs off (`radixserve bench`)",
        f"Machine: {report.machine_line(server_args.dtype)}. Backend: {args.backend}; model "
        f"{server_args.model_path or 'embedded SmolLM2-135M-Instruct (Q4_1 GGUF)'}, "
        f"KV pool {server_args.max_total_tokens} tokens, chunked prefill {server_args.chunked_prefill_size}, "
        f"policy {server_args.schedule_policy}, overlap schedule "
        f"{'off' if server_args.disable_overlap_schedule else 'on'}; greedy with ignore_eos; {args.repeats} run(s) "
        f"per cell, W2 at least {W2_MIN_REPEATS} (modes alternating, median wall kept).",
        f"Command: `{command}`",
        table,
        "Acceptance targets:\n" + (report.format_checks(checks) or "- (needs both modes of W1/W2)"),
        "Against the references measured on this machine (wall seconds):\n" + report.reference_comparison(results),
    ]
    if bounds:
        parts.append(bounds)
    breakdown = report.time_breakdown(results)
    if breakdown:
        parts.append("Where the time goes:\n" + breakdown)
    parts.append("Analysis (what the cache removes, what dominates what is left, the gap to vLLM): "
                 "`docs/scheduler.md`, section \"Performance\".")
    if args.plot:
        parts.append(f"![radix cache on vs off]({_relative(args.plot, args.output)})")
    return "\n\n".join(parts)


def _relative(plot: str, output: str) -> str:
    from pathlib import Path

    try:
        return str(Path(plot).resolve().relative_to(Path(output).resolve().parent))
    except ValueError:
        return plot


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="radixserve bench", description=__doc__)
    add_bench_args(parser)
    run_bench(parser.parse_args(argv))


__all__ = ["Prompt", "add_bench_args", "main", "run_bench"]
