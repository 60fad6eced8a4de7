"""Bounded load: 64 concurrent streaming clients, a quarter leaving mid-stream, on a pool that must evict and retract.

Every surviving request must produce exactly its greedy reference text (computed first, all 16
prompts in one batch), and afterwards the KV conservation identity holds and the /metrics counters add up.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from server_harness import ServerHandle, check_idle_conservation, start_server

pytestmark = pytest.mark.slow

NUM_CLIENTS = 64
NUM_PROMPTS = 16
SURVIVOR_TOKENS = 12
LEAVER_TOKENS = 40  # never reached: they leave after LEAVE_AFTER events
LEAVE_AFTER = 3
DEADLINE_S = 150.0
TOPICS = ["rivers", "mountains", "deserts", "forests"]


def _prompts() -> list[str]:
    """16 prompts in 4 groups: a group shares a prefix, and each prompt has its own long tail."""
    subjects = ["a lighthouse keeper", "a retired pilot", "a young baker", "a museum guard"]
    places = ["on a windy island", "in a busy harbour", "at the edge of a forest", "in a quiet village"]
    out = []
    for g, topic in enumerate(TOPICS):
        shared = f"Group {g}. Write a short story about {topic}."
        out += [f"{shared} The hero is {subjects[i]} who lives {places[(i + g) % 4]} and keeps a diary about "
                f"the weather, the tides and the visitors, number {g * 4 + i}." for i in range(4)]
    return out


@pytest.fixture(scope="module")
def server():
    # NOTE: 400 KV tokens hold about eight of these requests, so the 64 queue and evict, and a low
    # conservativeness lets admission overcommit. The scheduler's admission is careful enough that the
    # pool alone retracts only now and then, so its test hook (SGLang's SGLANG_TEST_RETRACT) also
    # retracts a request every 8 decode steps: every load run exercises retract-and-resume.
    handle = start_server("--dtype", "float32", "--max-total-tokens", "400", "--max-running-requests", "64",
                          "--chunked-prefill-size", "512", "--schedule-conservativeness", "0.05",
                          "--schedule-policy", "fcfs", env={"RADIXSERVE_TEST_RETRACT_INTERVAL": "8"})
    yield handle
    handle.stop()


def _body(prompt: str | list[str], max_tokens: int) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}


async def _client(http: httpx.AsyncClient, prompt: str, leave: bool) -> dict:
    text, usage, events = "", None, 0
    max_tokens = LEAVER_TOKENS if leave else SURVIVOR_TOKENS
    async with http.stream("POST", "/v1/completions", json=_body(prompt, max_tokens)) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            events += 1
            for choice in chunk["choices"]:
                text += choice["text"]
            usage = chunk.get("usage") or usage
            if leave and events == LEAVE_AFTER:
                break  # NOTE: leaving the block closes the connection mid-stream
    return {"text": text, "usage": usage, "events": events, "leave": leave, "prompt": prompt}


async def _run_load(base_url: str, prompts: list[str]) -> list[dict]:
    limits = httpx.Limits(max_connections=NUM_CLIENTS + 8, max_keepalive_connections=NUM_CLIENTS + 8)
    async with httpx.AsyncClient(base_url=base_url, timeout=DEADLINE_S, limits=limits) as http:
        jobs = [_client(http, prompts[i % NUM_PROMPTS], leave=i % 4 == 3) for i in range(NUM_CLIENTS)]
        return await asyncio.wait_for(asyncio.gather(*jobs), DEADLINE_S)


@pytest.mark.long
def test_64_streaming_clients_with_disconnects_eviction_and_retraction(server: ServerHandle) -> None:
    prompts = _prompts()
    # Greedy references, one batch of 16 (each prompt once), before the load.
    r = server.post("/v1/completions", json={**_body(prompts, SURVIVOR_TOKENS), "stream": False}, timeout=120)
    assert r.status_code == 200, r.text
    reference = {p: choice["text"] for p, choice in zip(prompts, r.json()["choices"], strict=True)}
    lengths = {p: len(server.post("/tokenize", json={"prompt": p}).json()["tokens"]) for p in prompts}
    state0, metrics0 = check_idle_conservation(server), server.metrics()

    started = time.monotonic()
    results = asyncio.run(_run_load(server.base_url, prompts))
    elapsed = time.monotonic() - started

    survivors = [r for r in results if not r["leave"]]
    leavers = [r for r in results if r["leave"]]
    assert len(survivors) == 48 and len(leavers) == 16
    for r in survivors:
        assert r["text"] == reference[r["prompt"]], (r["prompt"], r["text"], reference[r["prompt"]])
        assert r["usage"]["completion_tokens"] == SURVIVOR_TOKENS
        assert r["usage"]["prompt_tokens"] == lengths[r["prompt"]]
    assert all(r["events"] == LEAVE_AFTER for r in leavers)

    state1 = check_idle_conservation(server)
    metrics1 = server.metrics()

    def delta(name: str) -> float:
        return metrics1[name] - metrics0.get(name, 0.0)

    prompt_tokens = sum(lengths[r["prompt"]] for r in results)
    survivor_tokens = sum(r["usage"]["completion_tokens"] for r in survivors)
    assert delta("radixserve:num_requests_total") == NUM_CLIENTS
    assert delta("radixserve:num_aborted_requests_total") == len(leavers)
    assert delta("radixserve:prompt_tokens_total") == prompt_tokens
    assert 0 < delta("radixserve:cached_tokens_total") <= prompt_tokens
    generated = delta("radixserve:generation_tokens_total")
    assert survivor_tokens + len(leavers) * LEAVE_AFTER <= generated <= survivor_tokens + len(leavers) * LEAVER_TOKENS
    assert delta("radixserve:e2e_request_latency_seconds_count") == NUM_CLIENTS
    assert delta("radixserve:time_to_first_token_seconds_count") == NUM_CLIENTS
    # The pool really was too small: the scheduler evicted and retracted, and its counters agree.
    assert state1["num_retractions"] > state0["num_retractions"]
    assert state1["evicted_tokens"] > state0["evicted_tokens"]
    assert metrics1["radixserve:num_retractions_total"] == state1["num_retractions"]
    assert metrics1["radixserve:evicted_tokens_total"] == state1["evicted_tokens"]
    assert state1["num_aborts"] - state0["num_aborts"] == len(leavers)
    assert state1["generated_tokens"] - state0["generated_tokens"] >= generated
    print(f"load: {NUM_CLIENTS} clients in {elapsed:.1f} s, {generated:.0f} tokens delivered, "
          f"retractions {state1['num_retractions'] - state0['num_retractions']}, "
          f"evicted {state1['evicted_tokens'] - state0['evicted_tokens']}")


MIXED = 24


async def _mixed_request(http: httpx.AsyncClient, k: int, prompt: str, prompt_ids: list[int]) -> dict:
    """One request of kind k % 6: every feature that touches the scheduler, at once, under pressure."""
    kind = k % 6
    if kind == 0:
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 6, "temperature": 0,
                "logprobs": True, "top_logprobs": 2}
        r = await http.post("/v1/chat/completions", json=body)
        out = r.json()
        assert len(out["choices"][0]["logprobs"]["content"]) == out["usage"]["completion_tokens"]
    elif kind == 1:
        body = {"prompt": [prompt_ids], "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0}
        r = await http.post("/v1/completions", json=body)
        out = r.json()
        scores = out["choices"][0]["logprobs"]["token_logprobs"]
        assert len(scores) == len(prompt_ids) and scores[0] is None and all(s <= 0 for s in scores[1:])
    elif kind in (2, 4):
        extra = ({"frequency_penalty": 1.5, "presence_penalty": 0.5} if kind == 2
                 else {"logit_bias": {"1234": 5.0}, "min_tokens": 6})
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, **extra}
        r = await http.post("/v1/completions", json=body)
        out = {"text": r.json()["choices"][0]["text"], "body": body}
    elif kind == 3:
        body = {"text": prompt, "return_logprob": True, "logprob_start_len": 0,
                "sampling_params": {"max_new_tokens": 6, "temperature": 0, "repetition_penalty": 1.3}}
        r = await http.post("/generate", json=body)
        meta = r.json()["meta_info"]
        assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"]
        out = r.json()
    else:
        body = {"text": prompt, "rid": f"mixed-{k}", "stream": True,
                "sampling_params": {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}}
        async with http.stream("POST", "/generate", json=body) as r:
            last = None
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    if last is None:
                        aborted = await http.post("/abort_request", json={"rid": f"mixed-{k}"})
                        assert aborted.json()["aborted"] == 1
                    last = json.loads(line[6:])
        assert last["meta_info"]["finish_reason"]["type"] == "abort"
        out = last
    assert r.status_code == 200, (kind, out)
    return {"kind": kind, **out}


async def _run_mixed(base_url: str, prompts: list[str], ids: list[list[int]]) -> list[dict]:
    async with httpx.AsyncClient(base_url=base_url, timeout=DEADLINE_S) as http:
        jobs = [_mixed_request(http, k, prompts[k % NUM_PROMPTS], ids[k % NUM_PROMPTS]) for k in range(MIXED)]
        return await asyncio.wait_for(asyncio.gather(*jobs), DEADLINE_S)


def test_every_feature_at_once_under_pressure_keeps_outputs_and_kv(server: ServerHandle) -> None:
    prompts = _prompts()
    ids = [server.post("/tokenize", json={"prompt": p}).json()["tokens"] for p in prompts]
    state0 = check_idle_conservation(server)
    results = asyncio.run(_run_mixed(server.base_url, prompts, ids))
    assert sorted(r["kind"] for r in results) == sorted(k % 6 for k in range(MIXED))
    state1 = check_idle_conservation(server)
    assert state1["num_retractions"] > state0["num_retractions"]
    # Penalized and biased greedy requests give what they give alone, on an idle server.
    for r in results:
        if r["kind"] in (2, 4):
            alone = server.post("/v1/completions", json=r["body"], timeout=120)
            assert alone.json()["choices"][0]["text"] == r["text"], r["body"]
    check_idle_conservation(server)
