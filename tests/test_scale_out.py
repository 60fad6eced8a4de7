"""Scale-out: two radixserve workers behind SGLang's real model gateway (PyPI `sglang-router`).

One cluster for the module, started the way a user does: `radixserve serve --dp 2 --api-key A,B`
(two `launch_server` workers on loopback ports, one CPU each, and the gateway with `--policy
cache_aware` in front, passing each client's key through). Requests go through the gateway; every
worker's KV accounting is checked after each test. The fault test kills a worker, and the last test
stops the whole cluster with SIGTERM. What needs no gateway is in test_dp_launcher.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from server_harness import REPO, START_TIMEOUT_S, ServerHandle, assert_conservation, free_port, wait_idle

pytestmark = [pytest.mark.slow, pytest.mark.long]

MODEL = "SmolLM2-135M-Instruct"
KEY_A, KEY_B = "tenant-a-secret", "tenant-b-secret"
ADMIN = "operator-secret"  # the workers' --admin-api-key: their internals (/get_server_info) need it
WORKER_ARGS = ("--dtype", "float32", "--max-total-tokens", "2048", "--log-level", "warning")
SHARED_HEAD = 10  # what a new prompt may share with a tenant's earlier ones: the chat template's head, "Briefing"
LONG = {"max_tokens": 400, "ignore_eos": True, "temperature": 0}


@dataclass
class Cluster:
    proc: subprocess.Popen
    url: str
    workers: list[ServerHandle]
    log_path: str
    dead: set[str] = field(default_factory=set)

    def client(self, key: str | None = KEY_A, timeout: float = 120.0) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def live_workers(self) -> list[ServerHandle]:
        return [w for w in self.workers if w.base_url not in self.dead]

    def states(self) -> list[dict]:
        return [w.info()["scheduler_state"] for w in self.live_workers()]

    def log_tail(self) -> str:
        return Path(self.log_path).read_text(errors="replace")[-6000:]


@pytest.fixture(scope="module")
def cluster():
    pytest.importorskip("sglang_router", reason="SGLang's model gateway is not installed here "
                                                "(pip install 'radixserve[router]', i.e. sglang-router==0.3.2)")
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="radixserve-dp-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "radixserve.cli", "serve", "--dp", "2", "--host", "127.0.0.1",
           "--port", str(port), "--api-key", f"{KEY_A},{KEY_B}", "--admin-api-key", ADMIN, *WORKER_ARGS]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               RADIXSERVE_DEBUG_ALLOC="1", RADIXSERVE_STRICT_CHECKS="1")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    cluster = Cluster(proc, f"http://127.0.0.1:{port}", [], log.name)
    try:
        cluster.workers = _wait_ready(cluster)
        yield cluster
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(40)
            except subprocess.TimeoutExpired:
                proc.kill()


def _wait_ready(cluster: Cluster) -> list[ServerHandle]:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if cluster.proc.poll() is not None:
            raise RuntimeError(f"radixserve serve --dp 2 exited with {cluster.proc.returncode}:\n{cluster.log_tail()}")
        try:
            ready = httpx.get(cluster.url + "/readiness", timeout=2).json().get("healthy_workers") == 2
        except (httpx.HTTPError, ValueError):
            ready = False
        if ready:
            urls = sorted(w["url"] for w in httpx.get(cluster.url + "/workers", timeout=5).json()["workers"])
            return [ServerHandle(cluster.proc, url, cluster.log_path, KEY_A, ADMIN) for url in urls]
        time.sleep(0.2)
    raise TimeoutError(f"the cluster was not ready after {START_TIMEOUT_S} s:\n{cluster.log_tail()}")


@pytest.fixture(autouse=True)
def _conservation_on_every_worker(request):
    yield
    if "cluster" in request.fixturenames:
        for worker in request.getfixturevalue("cluster").live_workers():
            assert_conservation(wait_idle(worker))


def _unique_prompt(words: int = 60) -> str:
    tag = uuid.uuid4().hex
    return f"Briefing {tag}. " + " ".join(f"Clause {tag[i % 32]}{i}: keep the ledger balanced." for i in range(words // 6))


def _chat(client: httpx.Client, system: str, user: str = "Summarize the briefing.", **body) -> dict:
    r = client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": 8, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _cached(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def _served_by(cluster: Cluster, send) -> tuple[object, int]:
    """Runs `send()` and returns its result with the index of the one worker whose request count grew."""
    before = [s["num_requests"] for s in cluster.states()]
    out = send()
    grew = [i for i, (b, s) in enumerate(zip(before, cluster.states(), strict=True)) if s["num_requests"] > b]
    assert len(grew) == 1, grew
    return out, grew[0]


# ------------------------------------------------------------------------------ worker compatibility


def test_gateway_registers_both_workers_from_their_server_info_and_reads_their_load(cluster: Cluster) -> None:
    workers = httpx.get(cluster.url + "/workers").json()["workers"]
    # NOTE: passing clients' keys through, the gateway has no key of its own for /server_info, so the
    # workers' model is "unknown" to it (a gateway holding the key learns it: the keyed-gateway test).
    assert len(workers) == 2 and all(w["is_healthy"] and w["model_id"] == "unknown" for w in workers), workers
    loads = httpx.get(cluster.url + "/get_loads").json()["workers"]
    assert sorted(entry["worker"] for entry in loads) == [w.base_url for w in cluster.workers]
    assert all(entry["load"] >= 0 for entry in loads), loads  # -1 would mean /get_load failed
    worker = cluster.workers[0]
    info = worker.get("/server_info", headers=worker.admin_headers).json()
    assert info["served_model_name"] == MODEL and info["dp_size"] == 1 and info["api_key"] == "<redacted>"
    assert info["admin_api_key"] == "<redacted>" and ADMIN not in str(info)
    assert "model" not in info and info["internal_states"][0]["max_total_num_tokens"] == 2048
    # A tenant key learns what the model is, not the scheduler's internals or the server's flags.
    tenant = worker.get("/server_info").json()
    assert tenant["served_model_name"] == MODEL and tenant["dp_size"] == 1 and tenant["scheduler_alive"]
    assert not {"internal_states", "api_key", "max_queued_requests", "in_flight_requests"} & set(tenant), tenant
    assert httpx.get(worker.base_url + "/server_info").status_code == 401
    [load] = httpx.get(worker.base_url + "/get_load").json()
    assert load == {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}
    with cluster.client() as c:
        model_info = c.get("/get_model_info").json()  # the gateway forwards it to a worker, with the client's key
    assert model_info["served_model_name"] == MODEL and model_info["is_generation"] is True


def test_outputs_through_the_gateway_equal_a_workers_own(cluster: Cluster) -> None:
    system = _unique_prompt()
    worker = cluster.workers[0]
    with cluster.client() as gw, worker.client() as direct:
        for path, body in (("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": system}]}),
                           ("/v1/completions", {"model": MODEL, "prompt": system}),
                           ("/generate", {"text": system, "sampling_params": {"max_new_tokens": 12, "temperature": 0}})):
            body = body | ({} if path == "/generate" else {"max_tokens": 12, "temperature": 0})
            via, own = gw.post(path, json=body), direct.post(path, json=body)
            assert via.status_code == own.status_code == 200, (via.text, own.text)
            assert _text(via.json()) == _text(own.json()) and _text(own.json())
        # NOTE: the gateway fills a missing "model" with "unknown"; the worker must take that as unset.
        r = gw.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
        assert r.status_code == 200, r.text


def _text(body: dict) -> str:
    if "choices" not in body:
        return body["text"]
    choice = body["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def test_streaming_through_the_gateway_matches_and_reports_cached_tokens(cluster: Cluster) -> None:
    system = _unique_prompt()
    with cluster.client() as gw:
        full = _chat(gw, system, max_tokens=12)
        body = {"model": MODEL, "messages": [{"role": "system", "content": system},
                                             {"role": "user", "content": "Summarize the briefing."}],
                "max_tokens": 12, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        with gw.stream("POST", "/v1/chat/completions", json=body) as r:
            lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert r.status_code == 200 and lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == full["choices"][0]["message"]["content"]
    usage = chunks[-1]["usage"]
    # NOTE: same text, so cache_aware sends it to the worker that holds its prefix
    assert usage["prompt_tokens"] == full["usage"]["prompt_tokens"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 1


def test_cache_aware_routing_keeps_each_prefix_on_one_worker(cluster: Cluster) -> None:
    prompts = [_unique_prompt(), _unique_prompt()]
    before = cluster.states()

    async def first_of_each() -> list[dict]:
        # NOTE: the second arrives while the first still runs, so the gateway sends it to the idle worker.
        async with httpx.AsyncClient(base_url=cluster.url, headers={"Authorization": f"Bearer {KEY_A}"},
                                     timeout=120) as c:
            async def send(i: int) -> dict:
                await asyncio.sleep(0.3 * i)
                r = await c.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 24, "ignore_eos": True,
                                                               "messages": [{"role": "system", "content": prompts[i]},
                                                                            {"role": "user", "content": "Go."}]})
                return r.json()
            return list(await asyncio.gather(send(0), send(1)))

    firsts = asyncio.run(first_of_each())
    with cluster.client() as gw:
        follow_ups = [_chat(gw, prompts[i % 2], user=f"Question {i}?") for i in range(4)]
    after = cluster.states()
    assert all(s["num_requests"] > b["num_requests"] for s, b in zip(after, before, strict=True)), "one worker got everything"
    for body in follow_ups:
        assert _cached(body) >= body["usage"]["prompt_tokens"] - 12, body["usage"]  # all but the question
    computed = sum(s["prefill_tokens_computed"] - b["prefill_tokens_computed"] for s, b in zip(after, before, strict=True))
    first_prompts = sum(b["usage"]["prompt_tokens"] for b in firsts)
    assert computed <= first_prompts + sum(b["usage"]["prompt_tokens"] - _cached(b) for b in follow_ups)
    assert computed < first_prompts + 4 * 12, "a prefix was computed on both workers"


# ------------------------------------------------------------------------------ isolation


def test_tenants_never_share_kv_on_a_worker_through_the_gateway(cluster: Cluster) -> None:
    system = _unique_prompt()
    with cluster.client(KEY_A) as a, cluster.client(KEY_B) as b:
        first, worker_a = _served_by(cluster, lambda: _chat(a, system))
        other, worker_b = _served_by(cluster, lambda: _chat(b, system))
        again = _chat(a, system)
        salted = [_served_by(cluster, lambda s=salt: a.post("/v1/completions", json={
            "model": MODEL, "prompt": system, "max_tokens": 2, "cache_salt": s}).json()) for salt in ("s1", "s2", "s1")]
        keyed = [a.post("/generate", json={"text": system + " (native)", "extra_key": k,
                                           "sampling_params": {"max_new_tokens": 2}}).json()["meta_info"]
                 for k in ("x1", "x2", "x1")]
    assert worker_a == worker_b, "same text: cache_aware sends both tenants to the same worker"
    # NOTE: at most the first tokens, which the same tenant's earlier requests cached
    assert _cached(first) < SHARED_HEAD and _cached(other) < SHARED_HEAD, "tenant B was served tenant A's KV"
    assert _cached(again) >= again["usage"]["prompt_tokens"] - 1
    assert len({w for _, w in salted}) == 1
    assert [_cached(body) >= SHARED_HEAD for body, _ in salted] == [False, False, True]
    assert [m["cached_tokens"] >= SHARED_HEAD for m in keyed] == [False, False, True]


def test_gateway_0_3_2_drops_chat_cache_salt_so_chat_tenants_need_their_own_keys(cluster: Cluster) -> None:
    """A known limit of sglang-router 0.3.2 (docs/scale_out.md): it re-serializes chat and /generate bodies
    through its own types, which have no `cache_salt`; /v1/completions keeps it. Per-tenant API keys
    (passed through) isolate every API."""
    system = _unique_prompt()
    with cluster.client(KEY_A) as a:
        _chat(a, system, cache_salt="salt-1")
        second = _chat(a, system, cache_salt="salt-2")
    assert _cached(second) > 0, "the gateway now forwards cache_salt: update docs/scale_out.md and this test"


def test_a_gateway_holding_the_worker_key_authenticates_clients_and_sends_its_key(cluster: Cluster) -> None:
    """The several-machines form: a gateway started by hand with --worker-urls, configured with one
    workers' key (--api-key); it requires that key from clients and sends it to the workers."""
    port = free_port()
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
           "--worker-urls", *[w.base_url for w in cluster.workers], "--policy", "round_robin", "--api-key", KEY_A,
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), "--log-level", "warn"]
    gateway = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_for(lambda: httpx.get(url + "/readiness", timeout=2).json().get("healthy_workers") == 2, 60)
        registered = httpx.get(url + "/workers", headers=_bearer(KEY_A)).json()["workers"]
        assert [w["model_id"] for w in registered] == [MODEL, MODEL]  # read from /server_info with the key
        system = _unique_prompt()
        body = {"model": MODEL, "prompt": system, "max_tokens": 2}
        assert httpx.post(url + "/v1/completions", json=body).status_code == 401
        assert httpx.post(url + "/v1/completions", json=body, headers=_bearer(KEY_B)).status_code == 401
        for _ in range(2):  # round robin: once on each worker, in KEY_A's namespace
            r = httpx.post(url + "/v1/completions", json=body, headers=_bearer(KEY_A), timeout=120)
            assert r.status_code == 200 and _cached(r.json()) < SHARED_HEAD, r.text
    finally:
        gateway.terminate()
        gateway.wait(30)
    with cluster.client(KEY_A) as a, cluster.client(KEY_B) as b:
        via_a, via_b = (c.post("/v1/completions", json=body).json() for c in (a, b))
    assert _cached(via_a) >= via_a["usage"]["prompt_tokens"] - 1 and _cached(via_b) < SHARED_HEAD


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _wait_for(condition, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if condition():
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.2)
    raise TimeoutError(f"condition not met within {timeout_s} s")


# ------------------------------------------------------------------------------ disconnects and faults


def test_a_client_that_disconnects_from_the_gateway_is_aborted_on_the_worker(cluster: Cluster) -> None:
    before = cluster.states()
    body = {"model": MODEL, "prompt": _unique_prompt(), **LONG}
    with cluster.client() as gw:
        with gw.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))
        with pytest.raises(httpx.ReadTimeout):
            gw.post("/v1/completions", json=body | {"prompt": _unique_prompt()}, timeout=httpx.Timeout(120, read=2.0))
    for worker in cluster.live_workers():
        wait_idle(worker, timeout_s=20)
    after = cluster.states()
    assert sum(s["num_aborts"] - b["num_aborts"] for s, b in zip(after, before, strict=True)) == 2
    assert sum(s["generated_tokens"] - b["generated_tokens"] for s, b in zip(after, before, strict=True)) < 2 * LONG["max_tokens"]


def test_a_dead_worker_leaves_rotation_and_requests_after_it_succeed(cluster: Cluster) -> None:
    victim = cluster.workers[1]
    http_pid = _parent_pid(int(victim.info()["model"]["pid"]))
    kill_at = 1.5
    results = asyncio.run(_load_with_a_kill(cluster.url, http_pid, kill_at, n=14, gap_s=0.25))
    cluster.dead.add(victim.base_url)
    print("fault run (i, sent at s, outcome):", [(r["i"], r["sent"], r["outcome"]) for r in results])
    assert all(r["outcome"] != "timeout" for r in results), results  # nothing hangs
    for r in results:
        if r["sent"] > kill_at + 0.5:
            assert r["outcome"] == "ok", r  # new requests go to the survivor
        else:
            assert r["outcome"] in ("ok", "cut", "error"), r  # in flight on the victim: fail cleanly or retried
    _wait_for(lambda: [w["url"] for w in httpx.get(cluster.url + "/workers").json()["workers"]]
              == [cluster.workers[0].base_url], 20)
    assert cluster.proc.poll() is None, "the launcher must keep serving with one worker left"
    assert "taking it out of the gateway's rotation" in cluster.log_tail()


async def _load_with_a_kill(url: str, pid: int, kill_at: float, n: int, gap_s: float) -> list[dict]:
    started = time.monotonic()
    prompts = [_unique_prompt() for _ in range(4)]

    async def one(c: httpx.AsyncClient, i: int) -> dict:
        await asyncio.sleep(i * gap_s)
        sent = time.monotonic() - started
        body = {"model": MODEL, "prompt": prompts[i % 4], "max_tokens": 24, "ignore_eos": True, "temperature": 0}
        try:
            if i % 2:
                async with c.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
                    lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
                done = r.status_code == 200 and lines and lines[-1] == "data: [DONE]"
                outcome = "ok" if done else "error"
            else:
                r = await c.post("/v1/completions", json=body)
                ok = r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 24
                outcome = "ok" if ok else "error"
        except httpx.TimeoutException:
            outcome = "timeout"
        except (httpx.RemoteProtocolError, httpx.ReadError):
            outcome = "cut"  # a stream from the killed worker, closed mid-way
        return {"i": i, "sent": round(sent, 2), "outcome": outcome}

    async def kill() -> None:
        await asyncio.sleep(kill_at)
        os.kill(pid, signal.SIGKILL)

    async with httpx.AsyncClient(base_url=url, headers=_bearer(KEY_A), timeout=180) as c:
        *results, _ = await asyncio.gather(*[one(c, i) for i in range(n)], kill())
    return results


def _parent_pid(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("PPid:"):
            return int(line.split()[1])
    raise AssertionError(f"no parent of {pid}")


def _descendants(pid: int) -> set[int]:
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def test_sigterm_stops_the_gateway_and_every_worker_together(cluster: Cluster) -> None:
    children = _descendants(cluster.proc.pid)
    assert len(children) >= 3, children  # the gateway, the surviving worker and its scheduler process
    cluster.proc.send_signal(signal.SIGTERM)
    assert cluster.proc.wait(60) == 0
    _wait_for(lambda: not any(Path(f"/proc/{pid}").exists() for pid in children), 20)
    with pytest.raises(httpx.ConnectError):
        httpx.get(cluster.url + "/health", timeout=2)
    cluster.dead.update(w.base_url for w in cluster.workers)
