"""Issue 30's table: requests that used to freeze every other client. While each hostile request below runs,
/health is polled every 20 ms and a small completion runs beside it. /health must answer within 0.5 s of
its time without the hostile request (measured in the same test): nothing holds the event loop. The small
completion must answer within 1 s of its time alone: it also needs the scheduler's forward, which shares
a 2-core host with the hostile request's parsing or tokenizing (slower, not stalled: the stalls were 4-24 s).
The hostile requests get their 400 or their answer, and KV is conserved after each.

Times measured on a 2-core AVX2 EPYC before the mends are in each row's comment ("health": worst /health)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable

import httpx
import pytest
from server_harness import (
    ServerHandle,
    small_completion_s,
)

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MARGIN_S = 0.5  # /health: the event loop
LOADED_MARGIN_S = 1.0  # the small completion: the event loop, a tokenizer turn and a forward on a shared CPU
BIG = 3_900_000  # characters: under the 4 MiB body limit with the JSON around them


def _health_latencies(api_server: ServerHandle, stop: threading.Event) -> list[float]:
    latencies: list[float] = []

    def poll() -> None:
        with httpx.Client(base_url=api_server.base_url, timeout=30) as c:
            while not stop.is_set():
                started = time.monotonic()
                assert c.get("/health").status_code == 200
                latencies.append(time.monotonic() - started)
                time.sleep(0.02)

    threading.Thread(target=poll, daemon=True).start()
    return latencies


def _health_s(api_server: ServerHandle) -> float:
    started = time.monotonic()
    assert api_server.get("/health").status_code == 200
    return time.monotonic() - started


def run_beside(api_server: ServerHandle, send: Callable[[], httpx.Response], copies: int = 1
               ) -> tuple[list[httpx.Response], float, float, list[float], float]:
    """Sends `copies` hostile requests at once; returns (their responses, the small completion's time beside
    them and alone, /health's latencies beside them and alone)."""
    alone = min(small_completion_s(api_server) for _ in range(3))
    health_alone = min(_health_s(api_server) for _ in range(3))
    stop = threading.Event()
    latencies = _health_latencies(api_server, stop)
    results: list[httpx.Response] = []
    try:
        threads = [threading.Thread(target=lambda: results.append(send())) for _ in range(copies)]
        for t in threads:
            t.start()
        time.sleep(0.05)
        beside = small_completion_s(api_server)
        for t in threads:
            t.join(120)
    finally:
        stop.set()
    assert len(results) == copies, "a hostile request got no answer in 120 s"
    return results, beside, alone, latencies, health_alone


def _report(name: str, beside: float, alone: float, latencies: list[float], health_alone: float) -> None:
    print(f"\n{name}: small completion {beside:.2f} s (alone {alone:.2f} s); worst /health {max(latencies):.3f} s "
          f"(alone {health_alone:.3f} s)")


def _assert_nobody_waited(beside: float, alone: float, latencies: list[float], health_alone: float) -> None:
    assert beside < alone + LOADED_MARGIN_S, (beside, alone)
    assert latencies and max(latencies) < health_alone + MARGIN_S, (sorted(latencies)[-5:], health_alone)


def _raw(api_server: ServerHandle, path: str, body: bytes) -> Callable[[], httpx.Response]:
    return lambda: api_server.post(path, content=body, headers={"content-type": "application/json"})


def _json(api_server: ServerHandle, path: str, body: dict) -> Callable[[], httpx.Response]:
    encoded = json.dumps(body, separators=(",", ":")).encode()
    assert len(encoded) < 4 * 1024 * 1024, len(encoded)
    return _raw(api_server, path, encoded)


def _sp(**fields: object) -> dict:
    return {"text": "hi", "sampling_params": {"max_new_tokens": 1, **fields}}


# (id, path, body, status, error code or None): the table's rows, then one per bound at its worst size
ROWS = [
    # 64 KB body of 32,000 escaped quotes, unterminated: 400 after 24.2 s, health 24.1 s
    ("quotes-64KB", COMPLETIONS, b'{"prompt": "' + b'\\"' * 32_000, 400, "invalid_json"),
    # the same with 8,000 (16 KB): 1.6 s, health 1.5 s
    ("quotes-16KB", COMPLETIONS, b'{"prompt": "' + b'\\"' * 8_000, 400, "invalid_json"),
    # 200,000 stop token ids, 16 prompts x n=16: 200 after 23.6 s, health 14.7 s
    ("stop-ids-200k-x256", "/generate", {"text": ["hi"] * 16, "sampling_params": {
        "max_new_tokens": 1, "n": 16, "stop_token_ids": [2] * 200_000}}, 400, "over_limit"),
    # 1,000,000 stop token ids, n=16: 200 after 7.0 s, health 4.3 s
    ("stop-ids-1M", "/generate", _sp(n=16, stop_token_ids=[2] * 1_000_000), 400, "over_limit"),
    # one chat message of 3.9 MB: 400 after 4.3 s, health 0.2 s (another request waited 4.2 s)
    ("chat-message-3.9MB", CHAT, {"messages": [{"role": "user", "content": "hello world " * (BIG // 12)}],
                                  "max_tokens": 1}, 400, "context_length_exceeded"),
    # one per bound, at the largest size a body can carry
    ("logit-bias-300k", COMPLETIONS, {"prompt": "hi", "max_tokens": 1, "logit_bias": {str(i): 1 for i in range(300_000)}},
     400, "over_limit"),
    ("stop-string-3.9MB", COMPLETIONS, {"prompt": "hi", "max_tokens": 1, "stop": ["x" * BIG]}, 400, "over_limit"),
    ("stop-strings-400k", "/generate", _sp(stop=["ab"] * 400_000), 400, "over_limit"),
    ("messages-120k", CHAT, {"messages": [{"role": "user", "content": "h"}] * 120_000, "max_tokens": 1}, 400,
     "over_limit"),
    ("rid-3.9MB", COMPLETIONS, {"prompt": "hi", "max_tokens": 1, "rid": "r" * BIG}, 400, "over_limit"),
    ("cache-salt-3.9MB", CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                "cache_salt": "s" * BIG}, 400, "over_limit"),
    ("extra-key-3.9MB", "/generate", {"text": "hi", "extra_key": "k" * BIG}, 400, "over_limit"),
    ("prompt-3.9MB", COMPLETIONS, {"prompt": "hello world " * (BIG // 12), "max_tokens": 1}, 400,
     "context_length_exceeded"),
    # 100,000 token ids: parsed and checked off the loop, then over this server's 2,048-token context
    ("input-ids-100k", "/generate", {"input_ids": [i % 49152 for i in range(100_000)],
                                     "sampling_params": {"max_new_tokens": 1}}, 400, "context_length_exceeded"),

    # NOTE: 500,000 ids held the GIL 0.35 s in the tokenizers backend's decode here (py-spy), though the same
    # call releases it in a plain thread; 100,000 (twelve contexts) stay well inside the bound
    # under the character bound, so really tokenized (36,000 tokens, 0.17 s), then over the context
    ("prompt-36k-tokens", COMPLETIONS, {"prompt": "the river flows past the old mill. " * 4500, "max_tokens": 1}, 400,
     "context_length_exceeded"),
    ("detokenize-100k", "/detokenize", {"tokens": [i % 49152 for i in range(100_000)]}, 200, None),
]


@pytest.mark.parametrize("name, path, body, status, code", ROWS, ids=[r[0] for r in ROWS])
def test_a_hostile_request_never_stalls_the_others(api_server: ServerHandle, name: str, path: str, body: bytes | dict,
                                                   status: int, code: str | None) -> None:
    send = _raw(api_server, path, body) if isinstance(body, bytes) else _json(api_server, path, body)
    results, beside, alone, latencies, health_alone = run_beside(api_server, send)
    for r in results:
        assert r.status_code == status, r.text[:300]
        if code is not None:
            assert r.json()["error"]["code"] == code, r.text[:300]
    _report(name, beside, alone, latencies, health_alone)
    _assert_nobody_waited(beside, alone, latencies, health_alone)


def test_a_big_answer_is_rendered_off_the_loop(api_server: ServerHandle) -> None:
    """echo + logprobs 20 on an 880-token prompt with n=8: 8 copies of 880 x 20 alternatives, built and
    encoded on a front-end thread while /health answers."""
    body = {"prompt": "the river flows past the old mill. " * 110, "max_tokens": 1, "n": 8, "echo": True,
            "logprobs": 20}
    results, beside, alone, latencies, health_alone = run_beside(api_server, _json(api_server, COMPLETIONS, body), copies=2)
    for r in results:
        assert r.status_code == 200, r.text[:300]
        choices = r.json()["choices"]
        assert len(choices) == 8 and all(len(c["logprobs"]["top_logprobs"]) > 800 for c in choices)
    # NOTE: the small completion beside waits for the scheduler's prompt scoring (seconds of model work), so
    # only the event loop's answer is bounded here
    assert latencies and max(latencies) < health_alone + MARGIN_S, (sorted(latencies)[-5:], health_alone)


def test_a_flood_of_keyless_probes_is_bounded_and_leaves_others_served(api_server: ServerHandle) -> None:
    """300 concurrent /health_generate and /get_load used to queue one generation (or scheduler round trip)
    each: another client's median latency went from 0.09 s to 6-7.6 s. Concurrent probes now share one, and
    past --keyless-rate-limit (20 per second by default) they get 429 with Retry-After."""
    alone = min(small_completion_s(api_server) for _ in range(3))

    async def flood() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=api_server.base_url, timeout=60,
                                     limits=httpx.Limits(max_connections=300)) as c:
            paths = ["/health_generate", "/get_load"] * 150
            return list(await asyncio.gather(*(c.get(p) for p in paths)))

    time.sleep(1.1)  # the bucket full again after the tests before
    box: list[list[httpx.Response]] = []
    thread = threading.Thread(target=lambda: box.append(asyncio.run(flood())))
    thread.start()
    time.sleep(0.2)
    beside = small_completion_s(api_server)
    thread.join(120)
    assert box, "the flood got no answers"
    statuses = [r.status_code for r in box[0]]
    assert set(statuses) <= {200, 429} and 20 <= statuses.count(200) < 150, sorted(set(statuses))
    refused = next(r for r in box[0] if r.status_code == 429)
    assert refused.headers["retry-after"] == "1" and refused.json()["error"]["code"] == "rate_limited"
    # NOTE: the flood's 300 connections share this process's GIL and the server's 2 cores with the probe,
    # which took 0.25-2.1 s across runs on a 2-core Xeon (at this commit and before); unbounded probes made it 6-7.6 s.
    assert beside < alone + 3.0, (beside, alone)
    time.sleep(1.1)
    assert api_server.get("/health_generate").status_code == 200
