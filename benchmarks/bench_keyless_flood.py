"""A keyless flood against a server with API keys: the HTTP process's CPU per 429, and another tenant's latency.

Starts `python -m radixserve.launch_server --api-key ...` from this checkout ("new") and, with --old-tree, from
another one ("old", e.g. `git archive <commit> | tar -x -C /tmp/old_http`), each from its own tree on a free
loopback port, the scheduler on one intra-op thread. Then, per round and per server (alternating, so both see
the same noise): 10 one-token completions with a tenant key one after another ("alone"); a flood process
(tests/keyless_flood.py: N keep-alive connections looping keyless GETs of /get_load and /health_generate) for
`--seconds`, and beside it, after 3 s, up to 20 more completions ("beside"); the HTTP process's user + system
CPU over the flood (/proc/PID/stat) divided by the 429s it served (its 200s and the tenant's requests counted
in, so an upper bound). Prints one markdown row per run.

    python benchmarks/bench_keyless_flood.py --old-tree /tmp/old_http --loops 1200 --seconds 25 --rounds 2
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from keyless_flood import flood_result, process_cpu_s, start_flood, tenant_latencies  # noqa: E402

KEY = "bench-tenant"
SERVER_ARGS = ("--dtype", "float32", "--max-total-tokens", "2048", "--log-level", "warning",
               "--max-scheduler-restarts", "0", "--api-key", KEY)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(tree: Path) -> tuple[subprocess.Popen, int]:
    """A server from `tree` (its own code: PYTHONPATH and cwd), once /health answers."""
    port = _free_port()
    log = tempfile.NamedTemporaryFile(prefix="bench-keyless-", suffix=".log", delete=False)
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "radixserve.launch_server", "--host", "127.0.0.1", "--port",
                             str(port), *SERVER_ARGS], stdout=log, stderr=subprocess.STDOUT, cwd=tree, env=env)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server from {tree} exited: {Path(log.name).read_text()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc, port
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError(f"server from {tree} did not start")


def measure(proc: subprocess.Popen, port: int, loops: int, seconds: float) -> dict[str, float]:
    url = f"http://127.0.0.1:{port}"
    alone = tenant_latencies(url, KEY, 10)
    time.sleep(1.2)  # the keyless bucket full again
    cpu = process_cpu_s(proc.pid)
    flood = start_flood(port, loops, seconds)
    time.sleep(3.0)
    beside = tenant_latencies(url, KEY, 20, deadline=time.monotonic() + seconds - 4.0)
    report = flood_result(flood, seconds + 120)
    cpu = process_cpu_s(proc.pid) - cpu
    assert report.retry_after_missing == 0 and report.bad_error_body == 0, report
    return {"alone_median": statistics.median(alone), "alone_max": max(alone),
            "beside_median": statistics.median(beside), "beside_max": max(beside), "beside_n": len(beside),
            "refused": report.refused, "answered": report.statuses.get("200", 0), "server_cpu_s": cpu,
            "ms_per_429": 1e3 * cpu / max(1, report.refused), "flood_cpu_s": report.client_cpu_s,
            "seconds": report.seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old-tree", type=Path, help="another checkout to measure beside this one")
    parser.add_argument("--loops", type=int, default=1200)
    parser.add_argument("--seconds", type=float, default=25.0)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    trees = {"new": REPO} | ({"old": args.old_tree.resolve()} if args.old_tree else {})
    servers = {name: start(tree) for name, tree in trees.items()}
    print(f"| server | round | tenant alone median / max (s) | beside {args.loops} keyless loops median / max (s)"
          " | 429s | 200s | HTTP CPU (s) | ms CPU per 429 | flood CPU (s) |")
    print("|---|---|---|---|---|---|---|---|---|")
    try:
        for round_ in range(args.rounds):
            order = list(servers) if round_ % 2 == 0 else list(reversed(servers))
            for name in order:
                m = measure(*servers[name], args.loops, args.seconds)
                print(f"| {name} | {round_ + 1} | {m['alone_median']:.2f} / {m['alone_max']:.2f} | "
                      f"{m['beside_median']:.2f} / {m['beside_max']:.2f} ({m['beside_n']:.0f} answered) | "
                      f"{m['refused']:.0f} | {m['answered']:.0f} | {m['server_cpu_s']:.2f} | {m['ms_per_429']:.3f} | "
                      f"{m['flood_cpu_s']:.2f} |", flush=True)
    finally:
        for proc, _ in servers.values():
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    main()
