"""Starting the real server (`python -m radixserve.launch_server`) on a free loopback port, for tests.

Servers started with the same arguments are shared by every test module of the session (the
embedded model loads once); `stop()` or interpreter exit ends them.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from radixserve.entrypoints.dp_processes import free_port

REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 240.0
_POLL_S = 0.05
_SHARED: dict[tuple[str, ...], ServerHandle] = {}


@dataclass
class ServerHandle:
    proc: subprocess.Popen
    base_url: str
    log_path: str
    api_key: str | None = None
    admin_key: str | None = None  # for /get_server_info, /metrics and /flush_cache when keys are set

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @property
    def admin_headers(self) -> dict[str, str]:
        key = self.admin_key or self.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def client(self, **kwargs: Any) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, headers=self.headers, timeout=kwargs.pop("timeout", 60.0),
                            **kwargs)

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        with self.client() as c:
            return c.get(path, **kwargs)

    def post(self, path: str, **kwargs: Any) -> httpx.Response:
        with self.client() as c:
            return c.post(path, **kwargs)

    def info(self) -> dict[str, Any]:
        r = self.get("/get_server_info", headers=self.admin_headers)
        r.raise_for_status()
        return r.json()

    def scheduler_pid(self) -> int:
        return int(self.info()["model"]["pid"])

    def metrics(self) -> dict[str, float]:
        text = self.get("/metrics", headers=self.admin_headers).text
        return {s.name + _labels(s.labels): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def log_tail(self, chars: int = 4000) -> str:
        return Path(self.log_path).read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def _labels(labels: dict[str, str]) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else ""


def start_server(*args: str, api_key: str | None = None, admin_key: str | None = None,
                 env: dict[str, str] | None = None) -> ServerHandle:
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="radixserve-server-", suffix=".log", delete=False)
    # NOTE: no scheduler restarts unless a test asks for them: a scheduler that dies (a leak under strict
    # checks) ends the server, so tests fail instead of carrying on with fresh pools.
    restarts = () if "--max-scheduler-restarts" in args else ("--max-scheduler-restarts", "0")
    cmd = [sys.executable, "-m", "radixserve.launch_server", "--host", "127.0.0.1", "--port", str(port), *args,
           *restarts]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {}))
    env.setdefault("OMP_NUM_THREADS", "2")
    # NOTE: the scheduler checks double frees and, when idle, raises on a conservation failure: a
    # leak kills the scheduler process, so the tests see it as 503s rather than passing quietly.
    env.setdefault("RADIXSERVE_DEBUG_ALLOC", "1")
    env.setdefault("RADIXSERVE_STRICT_CHECKS", "1")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    handle = ServerHandle(proc, f"http://127.0.0.1:{port}", log.name, api_key, admin_key)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{handle.log_tail()}")
        if _healthy(handle):
            return _reachable_at_once(handle)
        time.sleep(_POLL_S)
    handle.stop()
    raise TimeoutError(f"server not healthy after {START_TIMEOUT_S} s:\n{handle.log_tail()}")


def _healthy(handle: ServerHandle) -> bool:
    try:
        return httpx.get(handle.base_url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _reachable_at_once(handle: ServerHandle) -> ServerHandle:
    """A server that answers /health must reach its scheduler from its first request on."""
    # NOTE: asked right after the first 200 (polled every 50 ms), so a server that went live before
    # the scheduler's connection existed fails here instead of in a random test with a 503.
    if not handle.info()["scheduler_alive"]:
        handle.stop()
        raise RuntimeError(f"server healthy but its scheduler unreachable:\n{handle.log_tail()}")
    return handle


def shared_server(*args: str, api_key: str | None = None, admin_key: str | None = None) -> ServerHandle:
    key = (*args, f"api_key={api_key}", f"admin_key={admin_key}")
    server = _SHARED.get(key)
    if server is None or server.proc.poll() is not None or not _healthy(server):
        if server is not None:
            server.stop()
        server = _SHARED[key] = start_server(*args, api_key=api_key, admin_key=admin_key)
    return server


@atexit.register
def _stop_shared() -> None:
    for server in _SHARED.values():
        server.stop()


def small_completion_s(server: ServerHandle, key: str | None = None) -> float:
    """Seconds for a one-token completion of "Hello" (as `key`, or the server's own key): what another
    client feels while a test loads the server."""
    started = time.monotonic()
    headers = {"Authorization": f"Bearer {key}"} if key is not None else None
    r = server.post("/v1/completions", headers=headers, json={"prompt": "Hello", "max_tokens": 1})
    assert r.status_code == 200, r.text[:300]
    return time.monotonic() - started


def wait_idle(server: ServerHandle, timeout_s: float = 30.0) -> dict[str, Any]:
    """Waits until no request is in flight or holds KV; returns the scheduler state then."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = server.info()
        state = info["scheduler_state"]
        idle = (info["in_flight_requests"] == 0 and state["num_running_reqs"] == 0
                and state["num_waiting_reqs"] == 0 and state["kv_accounting"]["idle"])
        if idle:
            return state
        if time.monotonic() > deadline:
            raise AssertionError(f"server not idle after {timeout_s} s: {state}")
        time.sleep(0.05)


def assert_conservation(state: dict[str, Any]) -> None:
    """free + evictable + protected + request-private == pool size, and no request row in use."""
    acc = state["kv_accounting"]
    assert acc["holds"], acc["error"]
    terms = acc["available"] + acc["pending_free"] + acc["evictable"] + acc["protected"] + acc["request_private"]
    assert terms == acc["size"] == state["max_total_num_tokens"], acc
    assert acc["req_rows_in_use"] == 0, acc
    # NOTE: idle, the only tree locks are agent sessions' pins (kv_accounting checks each pinned node's lock refs;
    # sessions sharing a head count it once each in session_pinned_tokens, once in protected)
    pinned = state.get("session_pinned_tokens", 0)
    assert acc["active_requests"] == 0 and acc["protected"] <= pinned and (acc["protected"] == 0) == (pinned == 0), acc


def check_idle_conservation(server: ServerHandle) -> dict[str, Any]:
    state = wait_idle(server)
    assert_conservation(state)
    return state


# The server the API, error and hardening tests share: small pool (1024) under a 2048 context, so both
# the context check and the pool check can be hit, and the default 4 MiB body limit.
API_SERVER_ARGS = ("--dtype", "float32", "--max-total-tokens", "1024", "--context-length", "2048")


# The server the tenant, admission and fault tests share (test_server_admission.py runs first; the
# last test of test_server_faults.py spends its restart budget and ends it): two tenant keys and an
# admin key, a 32-row running batch, room for a 3,000-prompt request, one scheduler restart allowed.
TENANT_KEYS = ("key-one", "key-two")
ADMIN_KEY = "admin-key"
TENANT_SERVER_ARGS = ("--dtype", "float32", "--max-total-tokens", "2048", "--max-running-requests", "32",
                      "--health-timeout", "1.5", "--heartbeat-interval", "0.2", "--api-key", ",".join(TENANT_KEYS),
                      "--admin-api-key", ADMIN_KEY, "--max-request-fanout", "3000", "--max-queued-requests", "3000",
                      "--max-scheduler-restarts", "1")


def tenant_server() -> ServerHandle:
    return shared_server(*TENANT_SERVER_ARGS, api_key=TENANT_KEYS[0], admin_key=ADMIN_KEY)
