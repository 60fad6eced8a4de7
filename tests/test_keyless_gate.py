"""The keyless routes' gate (entrypoints/keyless_gate.py) without a server: which raw requests the h11
protocol answers itself, the middleware's 429 (the same bytes as the app's error), and that a call is
counted once whichever of the two lets it through. The real server under a flood: test_server_keyless_flood.py."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import uvicorn
from uvicorn.server import ServerState

from radixserve.entrypoints.coalesce import TokenBucket
from radixserve.entrypoints.http_auth import Auth
from radixserve.entrypoints.http_errors import rate_limited
from radixserve.entrypoints.keyless_gate import (
    ADMITTED,
    KeylessGate,
    KeylessGateMiddleware,
    _plain_get,
    keyless_h11_protocol,
)

KEY = "the-key"
ROUTES = frozenset({b"/get_load", b"/health_generate"})
PLAIN = b"GET /get_load HTTP/1.1\r\nHost: x\r\nUser-Agent: probe\r\n\r\n"


def _gate(rate: float = 2.0) -> KeylessGate:
    return KeylessGate(Auth([KEY], None).valid_key, TokenBucket(rate))


@pytest.mark.parametrize("data, plain, authorization", [
    (PLAIN, True, None),
    (b"GET /health_generate?x=1 HTTP/1.1\r\nhost: x\r\nAuthorization:  Bearer k \r\n\r\n", True, b"Bearer k"),
    (b"GET /get_load HTTP/1.1\r\nHost: x\r\nConnection: keep-alive\r\n\r\n", True, None),
    (b"GET /get_load HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", False, None),  # must close after
    (b"GET /get_load HTTP/1.1\r\nUser-Agent: no host\r\n\r\n", False, None),  # h11's 400
    (b"GET /get_load HTTP/1.0\r\nHost: x\r\n\r\n", False, None),
    (b"GET /get_load/ HTTP/1.1\r\nHost: x\r\n\r\n", False, None),
    (b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", False, None),
    (b"GET /get_load HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}", False, None),
    (b"GET /get_load HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n", False, None),
    (b"GET /get_load HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n\r\n", False, None),
    (b"GET /get_load HTTP/1.1\r\nHost: x\r\nX-A: 1\r\n folded\r\n\r\n", False, None),
    (b"GET /get_load HTTP/1.1\r\nHost : x\r\n\r\n", False, None),
    (b"GET /get_load HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n", False, None),
    (b"GET /get_load HTTP/1.1\r\nHost: x\r\nAuthorization: a\r\nAuthorization: b\r\n\r\n", False, None),
    (b"GET /get_load HTTP/1.1\r\nHost: x\r\n", False, None),  # not complete yet
    (PLAIN + PLAIN, False, None),  # pipelined: h11's
])
def test_which_raw_requests_are_plain_keyless_probes(data: bytes, plain: bool, authorization: bytes | None) -> None:
    got_plain, got_authorization = _plain_get(data, ROUTES)
    assert got_plain == plain and (not plain or got_authorization == authorization)


def _run(app: Any, scope: dict[str, Any]) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    return sent


async def _ok(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def _scope(path: str = "/get_load", method: str = "GET", key: str | None = None) -> dict[str, Any]:
    headers = [(b"host", b"x")] + ([(b"authorization", f"Bearer {key}".encode())] if key else [])
    return {"type": "http", "method": method, "path": path, "headers": headers}


def test_the_middleware_refuses_past_the_rate_with_the_apps_error_and_spares_a_key() -> None:
    gate = _gate(rate=2.0)
    app = KeylessGateMiddleware(_ok, gate)
    assert [_run(app, _scope())[0]["status"] for _ in range(3)] == [200, 200, 429]
    start, body = _run(app, _scope("/health_generate"))
    expected = rate_limited("keyless calls to this route are limited to 2 per second (--keyless-rate-limit); "
                            "send a valid API key, or retry later")
    assert start["status"] == 429 and body["body"] == expected.content()
    assert dict(start["headers"]) == {b"retry-after": b"1", b"content-length": str(len(expected.content())).encode(),
                                      b"content-type": b"application/json"}
    refused = gate.bucket.refused
    assert _run(app, _scope(key=KEY))[0]["status"] == 200  # a valid key: never counted
    assert _run(app, _scope(key="wrong"))[0]["status"] == 429
    assert _run(app, _scope(method="POST"))[0]["status"] == 200  # the app's 405, as before
    assert _run(app, _scope("/health"))[0]["status"] == 200
    assert _run(app, {**_scope(), ADMITTED: True})[0]["status"] == 200  # the protocol took its token
    assert gate.bucket.refused == refused + 1


class _Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.out = bytearray()
        self.closed = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 5555), "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def write(self, data: bytes) -> None:  # type: ignore[override]
        self.out += data

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def test_the_protocol_refuses_from_raw_bytes_and_counts_each_call_once() -> None:
    gate = _gate(rate=2.0)
    seen: list[dict[str, Any]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            seen.append(scope)
        await _ok(scope, receive, send)

    async def main() -> None:
        protocol_class = keyless_h11_protocol(gate)
        config = uvicorn.Config(KeylessGateMiddleware(app, gate), http=protocol_class, lifespan="off",
                                proxy_headers=False)
        state = ServerState()
        state.default_headers = [(b"server", b"uvicorn")]
        protocol = protocol_class(config=config, server_state=state, app_state={})
        transport = _Transport()
        protocol.connection_made(transport)

        async def exchange(data: bytes) -> bytes:
            transport.out.clear()
            protocol.data_received(data)
            for _ in range(20):  # the app's task, when there is one
                await asyncio.sleep(0)
            return bytes(transport.out)

        for _ in range(2):  # the burst: through h11 and the app, each marked as having taken its token
            assert (await exchange(PLAIN)).startswith(b"HTTP/1.1 200 ")
        assert [s.get(ADMITTED) for s in seen] == [True, True] and gate.bucket.refused == 0
        refused = await exchange(PLAIN)
        assert len(seen) == 2 and gate.bucket.refused == 1 and state.total_requests == 3  # no task, no scope
        assert refused == (b"HTTP/1.1 429 Too Many Requests\r\nserver: uvicorn\r\nretry-after: 1\r\n"
                           b"content-length: %d\r\ncontent-type: application/json\r\n\r\n" % len(gate.body) + gate.body)
        assert (await exchange(PLAIN.replace(b"\r\n\r\n", f"\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode()))
                ).startswith(b"HTTP/1.1 200 ")
        assert len(seen) == 3 and ADMITTED not in seen[-1] and gate.bucket.refused == 1  # a key: h11 and the app
        both = await exchange(PLAIN + PLAIN)  # pipelined: h11 and the middleware refuse them
        assert both.count(b"HTTP/1.1 429 ") == 2 and len(seen) == 3 and gate.bucket.refused == 3
        assert not transport.closed
        protocol.connection_lost(None)

    asyncio.run(main())
