"""A flood of keyless calls to the rate-limited routes, run as its own process, and what a tenant feels meanwhile.

`python tests/keyless_flood.py PORT --loops N --seconds S [--paths /get_load,/health_generate]` opens N
keep-alive connections to 127.0.0.1:PORT (loopback only) and on each sends GETs without an API key, one
after another, until S seconds have passed or each connection has sent `--max-per-loop` requests; then it
prints one JSON line (`FloodReport`): answers by status, whether every 429 carried Retry-After and the
server's error shape, connection failures, and the flood's own CPU seconds. The client speaks HTTP/1.1 on raw
asyncio streams, so it costs the shared cores as little as a client can (an httpx client costs several times
the server's work per call).

`tenant_latencies` sends small completions with a valid key one after another and returns their seconds;
`process_cpu_s(pid)` reads a process's user + system CPU seconds from /proc (the HTTP server's, per 429).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

DEFAULT_PATHS = ("/get_load", "/health_generate")
ANSWER_TIMEOUT_S = 30.0
_CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass
class FloodReport:
    """What one flood got back."""

    statuses: dict[str, int] = field(default_factory=dict)  # "429" -> answers
    retry_after_missing: int = 0  # 429s without a Retry-After header
    bad_error_body: int = 0  # 429s whose body is not {"error": {message, type, param, code: rate_limited}}
    connect_errors: int = 0  # connections refused or reset before an answer
    dropped: int = 0  # requests sent on a connection that closed (or timed out) before answering
    seconds: float = 0.0  # wall time of the flood
    client_cpu_s: float = 0.0  # this process's CPU (the flood's own share of the cores)
    sample_429: dict[str, Any] = field(default_factory=dict)  # one 429's headers and body
    samples: dict[str, str] = field(default_factory=dict)  # status -> the body of one answer (other than 200, 429)

    @property
    def refused(self) -> int:
        return self.statuses.get("429", 0)


async def _read_answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return status, headers, body


def _is_error_shape(body: bytes) -> bool:
    try:
        error = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(error, dict) and set(error) == {"message", "type", "param", "code"} and \
        error["code"] == "rate_limited" and error["type"] == "rate_limit_error"


async def _one_loop(port: int, request: bytes, deadline: float, max_requests: int, report: FloodReport,
                    statuses: Counter) -> None:
    """One keep-alive connection sending `request` again and again (reconnecting when the server closes it)."""
    writer: asyncio.StreamWriter | None = None
    reader: asyncio.StreamReader | None = None
    sent = 0
    while sent < max_requests and time.monotonic() < deadline:
        if writer is None:
            try:
                reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port),
                                                        max(0.1, deadline - time.monotonic()))
            except (OSError, asyncio.TimeoutError):
                report.connect_errors += 1
                await asyncio.sleep(0.05)
                continue
        sent += 1
        try:
            writer.write(request)
            status, headers, body = await asyncio.wait_for(_read_answer(reader), ANSWER_TIMEOUT_S)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError, ValueError):
            report.dropped += 1
            writer.close()
            writer = None
            continue
        statuses[str(status)] += 1
        if status not in (200, 429):
            report.samples.setdefault(str(status), body.decode("utf-8", "replace")[:500])
        elif status == 429:
            if "retry-after" not in headers:
                report.retry_after_missing += 1
            if not _is_error_shape(body):
                report.bad_error_body += 1
            if not report.sample_429:
                report.sample_429 = {"headers": headers, "body": body.decode("utf-8", "replace")}
        if headers.get("connection", "").lower() == "close":
            writer.close()
            writer = None
    if writer is not None:
        writer.close()


async def flood(port: int, loops: int, seconds: float, paths: tuple[str, ...] = DEFAULT_PATHS,
                max_per_loop: int = 100_000) -> FloodReport:
    """`loops` keep-alive connections to 127.0.0.1:`port`, each cycling over one of `paths` without a key."""
    report = FloodReport()
    statuses: Counter = Counter()
    started = time.monotonic()
    deadline = started + seconds
    requests = [f"GET {p} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAccept: */*\r\n\r\n".encode() for p in paths]
    await asyncio.gather(*(_one_loop(port, requests[i % len(requests)], deadline, max_per_loop, report, statuses)
                           for i in range(loops)))
    report.statuses = dict(statuses)
    report.seconds = time.monotonic() - started
    usage = resource.getrusage(resource.RUSAGE_SELF)
    report.client_cpu_s = usage.ru_utime + usage.ru_stime
    return report


def start_flood(port: int, loops: int, seconds: float, paths: tuple[str, ...] = DEFAULT_PATHS) -> subprocess.Popen:
    """This module as a separate process (its own GIL); read its report with `flood_result`."""
    cmd = [sys.executable, os.path.abspath(__file__), str(port), "--loops", str(loops), "--seconds", str(seconds),
           "--paths", ",".join(paths)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def flood_result(proc: subprocess.Popen, timeout_s: float) -> FloodReport:
    out, err = proc.communicate(timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"the flood process exited with {proc.returncode}: {err[-2000:]}")
    data = json.loads(out.strip().splitlines()[-1])
    return FloodReport(**data)


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid`, all its threads (fields 14 and 15 of /proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def tenant_latencies(base_url: str, key: str, count: int, pause_s: float = 0.05,
                     deadline: float | None = None) -> list[float]:
    """Seconds of `count` one-token completions sent one after another with `key`, each on a new connection
    (as a client of its own would); stops early at `deadline` (time.monotonic). Raises on a non-200."""
    out: list[float] = []
    for _ in range(count):
        if deadline is not None and time.monotonic() > deadline:
            break
        started = time.monotonic()
        r = httpx.post(base_url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 1},
                       headers={"Authorization": f"Bearer {key}"}, timeout=120)
        if r.status_code != 200:
            raise AssertionError(f"tenant request answered {r.status_code}: {r.text[:300]}")
        out.append(time.monotonic() - started)
        time.sleep(pause_s)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("port", type=int)
    parser.add_argument("--loops", type=int, default=300)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--max-per-loop", type=int, default=100_000)
    parser.add_argument("--paths", default=",".join(DEFAULT_PATHS))
    args = parser.parse_args()
    paths = tuple(p for p in args.paths.split(",") if p)
    report = asyncio.run(flood(args.port, args.loops, args.seconds, paths, args.max_per_loop))
    print(json.dumps(asdict(report)), flush=True)


if __name__ == "__main__":
    main()
