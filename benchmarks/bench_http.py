"""The scheduler bench's workloads (W1/W2/W3) through the HTTP server, radix cache on and off.

Starts `python -m radixserve.launch_server` twice (cache on, and `--disable-radix-cache`) on free
loopback ports, replays the workloads with the OpenAI-API client of `radixserve bench --backend http`
(streaming, time to first token measured on the client), prints the table and replaces this script's
section of docs/benchmarks.md, with a PNG beside it.

    python benchmarks/bench_http.py [--scale 1.0] [--dtype auto] [--max-total-tokens 40960]

To measure another server (vLLM, SGLang, llama.cpp) the same way, run it yourself and use
`radixserve bench --backend http --base-url URL --label on`.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from radixserve.bench import report
from radixserve.bench.docs import write_doc_section
from radixserve.bench.http_backend import HttpBackend, load_tokenizer
from radixserve.bench.runner import WorkloadResult, run_workload
from radixserve.bench.workloads import build_workloads

REPO = Path(__file__).resolve().parents[1]
SECTION_START = "<!-- bench_http:start -->"
SECTION_END = "<!-- bench_http:end -->"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(server_args: list[str]) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    log = tempfile.NamedTemporaryFile(prefix="bench-http-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "radixserve.launch_server", "--port", str(port), "--log-level", "warning",
           *server_args]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {Path(log.name).read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError("server did not start")


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()


def run_all(server_args: list[str], workloads: list, tokenizer: object,
            repeats: int) -> dict[tuple[str, str], WorkloadResult]:
    """Both servers stay up; each workload runs on one then the other (order alternating), median wall kept."""
    servers = {mode: start_server(server_args + (["--disable-radix-cache"] if mode == "off" else []))
               for mode in ("on", "off")}
    backends = {mode: HttpBackend(url, mode, tokenizer=tokenizer) for mode, (_, url) in servers.items()}
    runs: dict[tuple[str, str], list[WorkloadResult]] = {}
    try:
        warm = build_workloads(tokenizer, ["w2"], scale=0.05)[0]  # first-call costs, then an empty tree
        for backend in backends.values():
            run_workload(backend, warm)
        for i, workload in enumerate(w for w in workloads for _ in range(repeats)):
            for mode in (("on", "off") if i % 2 == 0 else ("off", "on")):
                backends[mode].flush_cache()
                res = run_workload(backends[mode], workload)
                s = res.summary()
                print(f"[bench_http] {workload.name} cache {mode}: wall {s['wall_s']:.2f} s, mean TTFT "
                      f"{s['ttft_mean_s']:.3f} s, hit rate {s['hit_rate']:.1%}", flush=True)
                runs.setdefault((workload.name, mode), []).append(res)
    finally:
        for backend in backends.values():
            backend.close()
        for proc, _ in servers.values():
            stop_server(proc)
    return {key: sorted(rs, key=lambda r: r.wall_s)[(len(rs) - 1) // 2] for key, rs in runs.items()}


def write_section(path: Path, body: str) -> None:
    write_doc_section(path, SECTION_START, SECTION_END, body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", type=float, default=1.0, help="shrink the workloads (default: 1.0)")
    parser.add_argument("--workloads", default="w1,w2,w3", help="default: w1,w2,w3")
    parser.add_argument("--repeats", type=int, default=1, help="runs per workload and mode (default: 1)")
    parser.add_argument("--dtype", default="auto", help="server dtype (default: auto)")
    parser.add_argument("--max-total-tokens", default="40960", help="server KV pool (default: 40960)")
    parser.add_argument("--output", default=str(REPO / "docs" / "benchmarks.md"))
    parser.add_argument("--plot", default=str(REPO / "docs" / "bench_http.png"))
    args = parser.parse_args()
    server_args = ["--dtype", args.dtype, "--max-total-tokens", args.max_total_tokens]
    tokenizer = load_tokenizer()
    workloads = build_workloads(tokenizer, args.workloads.split(","), args.scale)
    results = run_all(server_args, workloads, tokenizer, max(args.repeats, 1))
    ordered = {k: results[k] for w in workloads for k in ((w.name, "on"), (w.name, "off"))}
    table = report.table(ordered)
    checks = report.format_checks(report.threshold_checks(ordered))
    print("\n" + table + "\n\n" + checks)
    report.plot(ordered, args.plot)
    command = "python benchmarks/bench_http.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    write_section(Path(args.output), "\n\n".join([
        "## Server: radix cache on vs off over HTTP (`benchmarks/bench_http.py`)",
        f"Machine: {report.machine_line()}, shared with other jobs (expect noise of tens of percent). Server: "
        f"`radixserve.launch_server {' '.join(server_args)}` (cache off adds `--disable-radix-cache`; both "
        "servers up, each workload run on one then the other, order alternating), embedded "
        "SmolLM2-135M-Instruct. Client: the OpenAI-API backend of `radixserve bench --backend http`: "
        "streaming `/v1/completions`, greedy with `ignore_eos`, all independent requests at once, TTFT = "
        f"first text chunk on the client; {args.repeats} run(s) per cell, median wall kept.",
        f"Command: `{command.strip()}`",
        table,
        "Acceptance targets of `radixserve bench`, measured through HTTP:\n"
        + (checks or "- (needs W1/W2)"),
        "Against the in-process Engine bench (`radixserve bench`), the difference is the HTTP path: tokenizing the text "
        "prompt, one ZMQ round trip per scheduler step, per-token detokenization and SSE framing.",
        f"![HTTP bench]({Path(args.plot).name})",
    ]))
    print(f"[bench_http] wrote {args.output} and {args.plot}")


if __name__ == "__main__":
    main()
