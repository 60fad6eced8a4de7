"""The cache explorer under load: W1 with 48 streaming clients, `/cache/tree` polled vs not, side by side.

    flock /tmp/radixserve-bench.lock python benchmarks/bench_cache_explorer.py [--pairs 3] [--interval 0.5]

One server (`python -m radixserve.launch_server`, float32 by default so that greedy outputs are
reproducible to the token), W1 with 48 requests (one 1,000-token prefix + a unique 40-token question
each, 32 new tokens, greedy, all sent at once over streaming `/v1/completions`). Each pair runs W1
once with a poller fetching `/cache/tree?since=...` every `--interval` seconds, as the page does, and
once without, order alternating, the cache flushed before every run. Reports each run's wall time,
the on/off ratio per pair, the scheduler's time per snapshot, and whether every greedy output of
every run equals the first run's. Replaces its section of docs/benchmarks.md and writes a PNG.
"""

from __future__ import annotations

import argparse
import json
import pickle
import shlex
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx
from bench_http import start_server, stop_server  # noqa: I001 - benchmarks/ is the script's folder

from radixserve.bench import report
from radixserve.bench.docs import write_doc_section
from radixserve.bench.http_backend import HttpBackend, load_tokenizer
from radixserve.bench.runner import WorkloadResult, run_workload
from radixserve.bench.workloads import build_w1

REPO = Path(__file__).resolve().parents[1]
SECTION_START = "<!-- bench_cache_explorer:start -->"
SECTION_END = "<!-- bench_cache_explorer:end -->"


class Poller:
    """Fetches /cache/tree every `interval` seconds, like the page, until stopped; keeps what it saw."""

    def __init__(self, base_url: str, interval: float) -> None:
        self.base_url, self.interval = base_url, interval
        self.took_ms: list[float] = []
        self.http_ms: list[float] = []
        self.encode_ms: list[float] = []  # pickling (scheduler -> HTTP) + JSON encoding, redone here per snapshot
        self.latency_s: list[float] = []
        self.seqs: list[int] = []
        self.bytes: list[int] = []
        self.events = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Poller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        since = 0
        with httpx.Client(base_url=self.base_url, timeout=60) as http:
            while not self._stop.is_set():
                start = time.perf_counter()
                r = http.get("/cache/tree", params={"since": since})
                r.raise_for_status()
                snapshot = r.json()
                self.latency_s.append(time.perf_counter() - start)
                self.took_ms.append(snapshot["took_ms"])
                self.http_ms.append(snapshot["http_ms"])
                self.encode_ms.append(_encode_ms(snapshot))
                self.seqs.append(snapshot["event_seq"])
                self.bytes.append(len(r.content))
                self.events += len(snapshot["events"])
                since = snapshot["event_seq"]
                self._stop.wait(self.interval)


def _encode_ms(snapshot: dict) -> float:
    start = time.perf_counter()
    pickle.dumps(snapshot)
    json.dumps(snapshot)
    return (time.perf_counter() - start) * 1000


def run_once(backend: HttpBackend, workload, base_url: str, polling: bool, interval: float,
             ) -> tuple[WorkloadResult, Poller | None]:
    backend.flush_cache()
    if not polling:
        return run_workload(backend, workload), None
    with Poller(base_url, interval) as poller:
        result = run_workload(backend, workload)
    return result, poller


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=8, help="polled/unpolled pairs (default: 8)")
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between polls (default: 0.5, the page's)")
    parser.add_argument("--clients", type=int, default=48, help="W1 requests sent at once (default: 48)")
    parser.add_argument("--dtype", default="float32", help="server dtype (default: float32)")
    parser.add_argument("--max-total-tokens", default="40960", help="server KV pool (default: 40960)")
    parser.add_argument("--output", default=str(REPO / "docs" / "benchmarks.md"))
    parser.add_argument("--plot", default=str(REPO / "docs" / "bench_cache_explorer.png"))
    args = parser.parse_args()
    server_args = ["--dtype", args.dtype, "--max-total-tokens", args.max_total_tokens]
    tokenizer = load_tokenizer()
    workload = build_w1(tokenizer, num_requests=args.clients)
    proc, url = start_server(server_args)
    backend = HttpBackend(url, "explorer", tokenizer=tokenizer, send_token_ids=True)
    runs: list[tuple[bool, WorkloadResult, Poller | None]] = []
    try:
        run_workload(backend, build_w1(tokenizer, 4, 100, 10, 4))  # first-call costs
        for pair in range(args.pairs):
            for polling in ((False, True) if pair % 2 == 0 else (True, False)):
                result, poller = run_once(backend, workload, url, polling, args.interval)
                runs.append((polling, result, poller))
                extra = f", {len(poller.took_ms)} snapshots" if poller else ""
                print(f"[bench_cache_explorer] pair {pair + 1} polling {'on ' if polling else 'off'}: "
                      f"wall {result.wall_s:.2f} s{extra}", flush=True)
    finally:
        backend.close()
        stop_server(proc)
    body = summarize(runs, args, server_args)
    print("\n" + body)
    plot(runs, args.plot)
    write_doc_section(Path(args.output), SECTION_START, SECTION_END, body)
    print(f"[bench_cache_explorer] wrote {args.output} and {args.plot}")


def event_record_ns(n: int = 200_000) -> float:
    """What recording one event costs the tree (the `events is not None` test plus the ring append), in ns."""
    from radixserve.mem_cache.cache_events import CacheEventLog

    log = CacheEventLog()
    start = time.perf_counter()
    for _ in range(n):
        if log is not None:
            log.record("lock", 7, None, 4, 1)
    return (time.perf_counter() - start) / n * 1e9


def added_work_ms(poller: Poller, record_ns: float) -> tuple[float, int]:
    """The explorer's own work during a run (scheduler snapshots, HTTP decoding, event recording), and the events."""
    events = poller.seqs[-1] - poller.seqs[0] if poller.seqs else 0
    return sum(poller.took_ms) + sum(poller.http_ms) + sum(poller.encode_ms) + events * record_ns / 1e6, events


def summarize(runs: list, args: argparse.Namespace, server_args: list[str]) -> str:
    record_ns = event_record_ns()
    first = [r.output_ids for r in runs[0][1].records]
    rows = ["| pair | polling | wall s | mean TTFT s | snapshots | scheduler ms per snapshot (median / max) "
            "| HTTP ms per snapshot (median) | events recorded | explorer work ms (% of wall) | snapshot KiB "
            "| outputs = first run |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    shares = []
    for i, (polling, result, poller) in enumerate(runs):
        same = sum(a == b for a, b in zip((r.output_ids for r in result.records), first, strict=True))
        cells = ["-"] * 6
        if poller is not None and poller.took_ms:
            work, events = added_work_ms(poller, record_ns)
            shares.append(work / 1000 / result.wall_s)
            cells = [str(len(poller.took_ms)),
                     f"{statistics.median(poller.took_ms):.2f} / {max(poller.took_ms):.2f}",
                     f"{statistics.median(poller.http_ms):.2f}", str(events),
                     f"{work:.1f} ({work / 10 / result.wall_s:.3f}%)", f"{statistics.median(poller.bytes) / 1024:.1f}"]
        rows.append(f"| {i // 2 + 1} | {'on' if polling else 'off'} | {result.wall_s:.2f} | "
                    f"{result.summary()['ttft_mean_s']:.3f} | " + " | ".join(cells) + f" | {same}/{len(first)} |")
    ratios = []
    for i in range(0, len(runs) - 1, 2):
        on = next(r for p, r, _ in runs[i:i + 2] if p)
        off = next(r for p, r, _ in runs[i:i + 2] if not p)
        ratios.append(on.wall_s / off.wall_s)
    all_same = all(r.output_ids == f for _, res, _ in runs for r, f in zip(res.records, first, strict=True))
    median_ratio = statistics.median(ratios)
    on_walls = [r.wall_s for p, r, _ in runs if p]
    off_walls = [r.wall_s for p, r, _ in runs if not p]
    command = "flock /tmp/radixserve-bench.lock python benchmarks/bench_cache_explorer.py " + " ".join(
        shlex.quote(a) for a in sys.argv[1:])
    wall_verdict = "PASS" if median_ratio - 1 < 0.02 else "FAIL"
    work_verdict = "PASS" if max(shares) < 0.02 else "FAIL"
    return "\n\n".join([
        "## Cache explorer: `/cache/tree` polled under load (`benchmarks/bench_cache_explorer.py`)",
        f"Machine: {report.machine_line()}, shared with other jobs. Server: `radixserve.launch_server "
        f"{' '.join(server_args)}`, embedded SmolLM2-135M-Instruct. Workload: W1 with {args.clients} streaming "
        "clients at once (one 1,000-token prefix + a unique 40-token question each, 32 new tokens, greedy, "
        "`ignore_eos`, token ids sent), the cache flushed before every run. Polling on: one client fetches "
        f"`/cache/tree?since=<last event>` every {args.interval} s (the page's default), which makes the "
        "scheduler walk up to 400 nodes and the recent events between two steps and the HTTP process decode "
        "the shown tokens. Pairs alternate their order. \"Explorer work\" is what polling adds, measured "
        "where it happens: the scheduler's time per snapshot (`took_ms`), the HTTP process's filtering and "
        "decoding (`http_ms`), pickling the snapshot (scheduler to HTTP) and encoding it as JSON (both redone "
        f"on each received snapshot in the benchmark's process), and the events the tree recorded times "
        f"{record_ns:.0f} ns (one recording, timed in this process).",
        f"Command: `{command.strip()}`",
        "\n".join(rows),
        f"- Wall time, polling on / off, per pair: {', '.join(f'{r:.3f}' for r in ratios)}; median "
        f"**{median_ratio:.3f}** (**{(median_ratio - 1) * 100:+.1f}%**; required < +2%) — {wall_verdict}. Median wall "
        f"on {statistics.median(on_walls):.2f} s, off {statistics.median(off_walls):.2f} s.",
        f"- Explorer work, measured where it runs: at most **{max(shares) * 100:.3f}%** of a polled run's wall "
        f"(required < 2%) — {work_verdict}.",
        "- Greedy outputs: " + ("every request of every run equals the first run, token for token."
                                if all_same else "SOME OUTPUTS DIFFER (see the last column)."),
        f"![cache explorer bench]({Path(args.plot).name})",
    ])


def plot(runs: list, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2))
    labels = [f"{i // 2 + 1} {'on' if p else 'off'}" for i, (p, _, _) in enumerate(runs)]
    walls = [r.wall_s for _, r, _ in runs]
    ax.bar(labels, walls, color=["#c2410c" if p else "#94a3b8" for p, _, _ in runs])
    ax.set_ylabel("W1 wall s")
    ax.set_xlabel("pair, /cache/tree polling")
    ax.set_title("W1 (48 streaming clients), cache explorer polling on vs off")
    for i, w in enumerate(walls):
        ax.text(i, w, f"{w:.1f}", ha="center", va="bottom", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
