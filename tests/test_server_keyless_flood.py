"""Issue 55 (part 5): 1,200 concurrent keyless loops on /health_generate and /get_load got their 429s, but
another tenant's one-token completion then took 7.7-9.8 s (0.4 s under one tenant's load). Each refusal
went through h11, FastAPI's routing, dependency solving and exception handlers: 0.71-0.75 ms of the HTTP
process's CPU per 429, and the event loop served every flooding connection once per turn, so the tenant's
request waited 12.4 s (median; up to 20 s) on a 2-core EPYC. The refusal is now answered before all of
that (entrypoints/keyless_gate.py): 0.10-0.12 ms per 429, and the tenant waits 1.2-1.3 s (docs/server.md,
"Keyless floods").

A flood process (keyless_flood.py: raw keep-alive sockets, bounded in count and time, loopback only) floods a
server with API keys while a tenant sends small completions; then the server still serves and KV is
conserved. What is asserted: the flood's 429s carry Retry-After and the error shape, the rate holds, the
server's CPU per 429 stays under a bound the old path measured 2.5x over, and the tenant's median latency
stays under one the old path missed (one answer in 8 s, 10 s) on the same machine."""

from __future__ import annotations

import socket
import statistics
import time
from collections.abc import Iterator

import pytest
from keyless_flood import flood_result, process_cpu_s, start_flood, tenant_latencies
from server_harness import ServerHandle, check_idle_conservation, small_completion_s, start_server

pytestmark = pytest.mark.slow

LOOPS = 600  # concurrent keyless connections (1,200 measured by hand: docs/server.md)
FLOOD_S = 12.0
RATE = 20.0  # --keyless-rate-limit's default, which this server keeps
MAX_CPU_PER_429_S = 0.3e-3  # measured 0.10-0.15 ms (its 200s and the tenant's requests included); old path 0.77
MAX_TENANT_MEDIAN_S = 4.0  # measured 1.3-1.5 s beside this flood; old path 10 s (one answer in 8 s)
TENANT_KEYS = ("flood-tenant-one", "flood-tenant-two")
ADMIN_KEY = "flood-admin"  # the conservation check reads the scheduler's state


@pytest.fixture(scope="module")
def server() -> Iterator[ServerHandle]:
    # NOTE: a server of its own (the shared tenant server's 1.5 s health timeout turns a scheduler slowed by a
    # loaded machine into 503s), its scheduler on one intra-op thread: two would spin against the flood
    # process for the 2 cores and measure OpenMP, not the HTTP path.
    handle = start_server("--dtype", "float32", "--max-total-tokens", "1024", "--api-key", ",".join(TENANT_KEYS),
                          "--admin-api-key", ADMIN_KEY, api_key=TENANT_KEYS[0], admin_key=ADMIN_KEY,
                          env={"OMP_NUM_THREADS": "1"})
    yield handle
    handle.stop()


def test_a_keyless_flood_is_refused_cheaply_and_a_tenant_is_still_served(server: ServerHandle) -> None:
    port = int(server.base_url.rsplit(":", 1)[1])
    alone = statistics.median(small_completion_s(server, TENANT_KEYS[1]) for _ in range(3))
    time.sleep(1.1)  # the keyless bucket full again after the tests before
    cpu_before = process_cpu_s(server.proc.pid)
    flood = start_flood(port, LOOPS, FLOOD_S)
    try:
        time.sleep(2.0)  # every loop connected and refused
        beside = tenant_latencies(server.base_url, TENANT_KEYS[1], 10, deadline=time.monotonic() + FLOOD_S - 4.0)
    finally:
        report = flood_result(flood, FLOOD_S + 60)
    cpu_s = process_cpu_s(server.proc.pid) - cpu_before

    assert report.refused > 1000 and report.retry_after_missing == 0 and report.bad_error_body == 0, report
    assert report.sample_429["headers"]["retry-after"] == "1", report.sample_429
    assert report.connect_errors == 0 and report.dropped == 0, report
    assert set(report.statuses) <= {"200", "429"}, report.statuses
    # NOTE: the rate holds: the burst, then RATE a second (one token's slack for the clock between the two)
    assert report.statuses.get("200", 0) <= RATE * (report.seconds + 1) + RATE, report.statuses
    per_429 = cpu_s / report.refused
    print(f"flood of {LOOPS} loops: {report.statuses} in {report.seconds:.1f} s; server CPU {cpu_s:.2f} s = "
          f"{per_429 * 1e3:.3f} ms per 429; the flood's own CPU {report.client_cpu_s:.2f} s; tenant alone "
          f"{alone:.2f} s, beside the flood {[round(t, 2) for t in beside]}")
    assert per_429 < MAX_CPU_PER_429_S, (per_429, cpu_s, report.statuses)
    # NOTE: fewer than 3 answered in the flood's 8 s is a median over the bound too
    assert len(beside) >= 3 and statistics.median(beside) < MAX_TENANT_MEDIAN_S, (beside, alone)

    assert server.get("/health").status_code == 200
    time.sleep(1.1)
    for path in ("/get_load", "/health_generate"):
        r = server.get(path, headers={})
        assert r.status_code == 200, (path, r.text[:300])
    check_idle_conservation(server)


def _exchange(sock: socket.socket, data: bytes, answers: int = 1) -> list[tuple[int, dict[str, str], bytes]]:
    sock.sendall(data)
    reader = sock.makefile("rb")
    out = []
    for _ in range(answers):
        status = int(reader.readline().split()[1])
        headers: dict[str, str] = {}
        while (line := reader.readline()) != b"\r\n":
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        out.append((status, headers, reader.read(int(headers.get("content-length", "0")))))
    return out


def test_one_keep_alive_connection_is_refused_then_served_with_a_key(server: ServerHandle) -> None:
    """On one connection: keyless calls past the burst are refused, pipelined ones too; a valid key's call,
    a wrong method and a request h11 must judge (no Host) get what they always got."""
    port = int(server.base_url.rsplit(":", 1)[1])
    keyless = b"GET /get_load HTTP/1.1\r\nHost: x\r\nUser-Agent: flood\r\n\r\n"
    time.sleep(1.1)
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        statuses = [_exchange(sock, keyless)[0][0] for _ in range(int(RATE) + 10)]
        assert statuses.count(429) >= 10 and set(statuses) == {200, 429}, statuses
        status, headers, body = _exchange(sock, keyless)[0]
        assert status == 429 and headers["retry-after"] == "1" and headers["content-type"] == "application/json"
        assert b'"code":"rate_limited"' in body and "date" in headers and "server" in headers, (headers, body)
        assert [a[0] for a in _exchange(sock, keyless * 2, answers=2)] == [429, 429]  # pipelined
        assert _exchange(sock, b"GET /health_generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer wrong\r\n\r\n"
                         )[0][0] == 429
        keyed = f"GET /get_load HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TENANT_KEYS[0]}\r\n\r\n".encode()
        assert _exchange(sock, keyed)[0][0] == 200
        assert _exchange(sock, b"POST /get_load HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")[0][0] == 405
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        assert _exchange(sock, b"GET /get_load HTTP/1.1\r\n\r\n")[0][0] == 400  # no Host: h11's 400, as before
    check_idle_conservation(server)
