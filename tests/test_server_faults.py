"""API keys and their namespaces, client disconnects, a stuck scheduler and a dead one (the last test)."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid

import httpx
import pytest
from server_harness import ServerHandle, assert_conservation, check_idle_conservation, start_server, wait_idle

pytestmark = pytest.mark.slow

KEYS = ("key-one", "key-two")
LONG = {"prompt": "Count from one to one thousand:", "max_tokens": 400, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def server():
    handle = start_server("--dtype", "float32", "--max-total-tokens", "2048", "--health-timeout", "1.5",
                          "--heartbeat-interval", "0.2", "--api-key", ",".join(KEYS), api_key=KEYS[0])
    yield handle
    handle.stop()


def _as(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _cached(server: ServerHandle, prompt: str, key: str, **extra: str) -> int:
    r = server.post("/v1/completions", headers=_as(key), json={"prompt": prompt, "max_tokens": 1, **extra})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def _generated(server: ServerHandle) -> int:
    return server.info()["scheduler_state"]["generated_tokens"]


def test_api_keys_are_required_except_for_health_and_metrics(server: ServerHandle) -> None:
    plain = httpx.Client(base_url=server.base_url, timeout=30)
    for headers in ({}, _as("key-three"), {"Authorization": "key-one"}):
        r = plain.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert plain.get("/v1/models").status_code == 401
    assert plain.post("/flush_cache").status_code == 401
    assert plain.get("/health").status_code == 200 and plain.get("/metrics").status_code == 200
    info = server.info()
    assert info["server_args"]["api_key"] == "<redacted>" and "key-one" not in str(info)
    plain.close()


def test_namespace_comes_from_the_key_and_a_salt_only_narrows_it(server: ServerHandle) -> None:
    prompt = f"Ticket {uuid.uuid4().hex}: the printer on floor three jams every morning at nine."
    assert _cached(server, prompt, KEYS[0]) == 0
    assert _cached(server, prompt, KEYS[0]) > 0  # positive control
    assert _cached(server, prompt, KEYS[1]) == 0  # another key never sees key-one's KV
    salt = uuid.uuid4().hex
    assert _cached(server, prompt, KEYS[0], cache_salt=salt) == 0  # narrower than key-one alone
    assert _cached(server, prompt, KEYS[0], cache_salt=salt) > 0
    assert _cached(server, prompt, KEYS[1], cache_salt=salt) == 0  # the same salt under another key
    check_idle_conservation(server)


def _tokens(server: ServerHandle) -> tuple[int, float, float]:
    """(tokens the scheduler generated, tokens the HTTP process received, aborts counted)."""
    m = server.metrics()
    return _generated(server), m["radixserve:generation_tokens_total"], m["radixserve:num_aborted_requests_total"]


def _assert_aborted_within_a_step(server: ServerHandle, before: tuple[int, float, float], closed: float) -> None:
    state = wait_idle(server, timeout_s=10)
    assert time.monotonic() - closed < 3.0
    generated, received, aborts = _tokens(server)
    # NOTE: tokens made after the abort was sent = the step under way (and, with the overlap loop, the
    # one already launched), not the rest of the 400.
    after_abort = (generated - before[0]) - (received - before[1])
    assert 0 <= after_abort <= 3, after_abort
    assert generated - before[0] < 200
    assert aborts == before[2] + 1
    assert_conservation(state)


def test_streaming_disconnect_aborts_within_a_step_and_releases_kv(server: ServerHandle) -> None:
    before, seen = _tokens(server), 0
    with server.client() as c, c.stream("POST", "/v1/completions", json=LONG | {"stream": True}) as r:
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen == 5:
                break
    _assert_aborted_within_a_step(server, before, time.monotonic())


def test_non_streaming_disconnect_aborts_within_a_step_and_releases_kv(server: ServerHandle) -> None:
    before = _tokens(server)
    with pytest.raises(httpx.ReadTimeout):
        server.post("/v1/completions", json=LONG, timeout=httpx.Timeout(30, read=1.0))
    _assert_aborted_within_a_step(server, before, time.monotonic())


def test_abort_request_reaches_only_the_callers_own_requests(server: ServerHandle) -> None:
    body = {"text": "Count from one to one thousand:", "rid": "shared-name",
            "sampling_params": {"max_new_tokens": 400, "ignore_eos": True, "temperature": 0}}
    box: list = []
    thread = threading.Thread(target=lambda: box.append(server.post("/generate", headers=_as(KEYS[0]), json=body)))
    thread.start()
    deadline = time.monotonic() + 30
    while server.info()["in_flight_requests"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    other = server.post("/abort_request", headers=_as(KEYS[1]), json={"rid": "shared-name", "abort_all": True})
    assert other.json()["aborted"] == 0  # another key cannot reach it, even with abort_all
    assert server.post("/abort_request", headers=_as(KEYS[0]), json={"rid": "shared-name"}).json()["aborted"] == 1
    thread.join(60)
    assert box[0].json()["meta_info"]["finish_reason"]["type"] == "abort"
    assert_conservation(wait_idle(server))


def test_stuck_scheduler_fails_health_then_recovers(server: ServerHandle) -> None:
    pid = server.scheduler_pid()
    os.kill(pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 15
        while (r := server.get("/health")).status_code == 200:
            assert time.monotonic() < deadline, "health still 200 with the scheduler stopped"
            time.sleep(0.1)
        assert r.status_code == 503 and "not answered" in r.json()["error"]["message"]
        assert server.metrics()["radixserve:scheduler_up"] == 0.0
    finally:
        os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 15
    while server.get("/health").status_code != 200:
        assert time.monotonic() < deadline, "health did not recover after SIGCONT"
        time.sleep(0.1)
    assert server.get("/health_generate").status_code == 200
    check_idle_conservation(server)


def test_dead_scheduler_fails_requests_in_flight_with_503(server: ServerHandle) -> None:
    results: dict[str, object] = {}

    def non_streaming() -> None:
        results["plain"] = server.post("/v1/completions", json=LONG, timeout=60)

    def streaming() -> None:
        with server.client() as c, c.stream("POST", "/v1/completions", json=LONG | {"stream": True}) as r:
            results["stream_status"] = r.status_code
            results["stream"] = [line for line in r.iter_lines() if line.startswith("data: ")]

    threads = [threading.Thread(target=non_streaming), threading.Thread(target=streaming)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 20
    while server.info()["scheduler_state"]["num_running_reqs"] < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.kill(server.scheduler_pid(), signal.SIGKILL)
    killed = time.monotonic()
    for t in threads:
        t.join(30)
    assert time.monotonic() - killed < 5.0  # failed promptly, not after 400 tokens or a timeout
    plain = results["plain"]
    assert plain.status_code == 503 and plain.json()["error"]["code"] == "scheduler_unavailable"
    assert results["stream_status"] == 200  # already streaming: the error arrives as the last event
    assert '"scheduler_unavailable"' in results["stream"][-2] and results["stream"][-1] == "data: [DONE]"
    health = server.get("/health")
    assert health.status_code == 503 and "exited" in health.json()["error"]["message"]
    assert server.get("/health_generate").status_code == 503
    r = server.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable_error"
    assert server.post("/flush_cache").status_code == 503
    info = server.info()
    assert info["scheduler_alive"] is False and info["in_flight_requests"] == 0
    assert server.metrics()["radixserve:scheduler_up"] == 0.0

