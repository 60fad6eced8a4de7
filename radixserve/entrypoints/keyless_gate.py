"""The keyless routes' rate limit (--keyless-rate-limit), answered as cheaply as the server can.

`/health_generate` and `/get_load` answer without an API key, so anyone who can reach the port can flood
them. Past the rate, a call without a valid key gets a 429 (`rate_limited`, with Retry-After) from one of
two places, neither of which reaches FastAPI's routing, dependency solving or exception handlers:

* `KeylessH11Protocol` (uvicorn's h11 protocol, which `launch_server` serves with): a keep-alive
  connection's next request, when it is one complete, plain `GET` of a limited route (no body, no upgrade,
  HTTP/1.1) without a valid key and the rate is spent, is answered from the raw bytes of `data_received`,
  without h11 parsing it, an ASGI scope or a task. Anything else (another route, a valid key, a partial,
  pipelined or unusual request) goes on to uvicorn as it came, untouched.
* `KeylessGateMiddleware` (pure ASGI, outermost of the app's own middleware): every other keyless call to
  a limited route, such as what the protocol passed on or an app served by another server.

A call the protocol lets through has taken its token already; it marks the call's scope so the middleware
does not take a second. A call with a valid key is never counted. Measured in docs/server.md ("Keyless
floods"): the server's CPU per refused call and another tenant's latency under a flood.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

from starlette.types import ASGIApp, Receive, Scope, Send

from radixserve.entrypoints.coalesce import TokenBucket
from radixserve.entrypoints.http_errors import rate_limited

LIMITED_ROUTES = ("/health_generate", "/get_load")
ADMITTED = "radixserve.keyless_admitted"  # scope key: the protocol took this call's token already
_STATUS_LINE = b"HTTP/1.1 429 Too Many Requests\r\n"
# NOTE: headers that give a GET a body, change the protocol or ask for an interim answer: such a request is
# h11's to parse and judge, never answered from its raw bytes.
_NOT_PLAIN = frozenset({b"content-length", b"transfer-encoding", b"upgrade", b"expect", b"http2-settings"})


class KeylessGate:
    """Which calls are limited (GET of `routes`), who is exempt (a valid key of `is_valid_key`), the rate
    (`bucket`), and the 429 a refused call gets: the server's error shape, body built once."""

    def __init__(self, is_valid_key: Callable[[str], bool], bucket: TokenBucket,
                 routes: Iterable[str] = LIMITED_ROUTES) -> None:
        self.is_valid_key = is_valid_key  # (Authorization header value: str) -> bool
        self.bucket = bucket
        self.routes = frozenset(routes)
        self.raw_routes = frozenset(r.encode() for r in self.routes)
        error = rate_limited(f"keyless calls to this route are limited to {bucket.rate:g} per second "
                             "(--keyless-rate-limit); send a valid API key, or retry later")
        self.body = error.content()
        self._length = str(len(self.body)).encode()

    @property
    def active(self) -> bool:
        """False when the rate is unlimited (--keyless-rate-limit 0): nothing is ever refused."""
        return self.bucket.rate > 0

    def exempt(self, authorization: bytes | None) -> bool:
        """Whether the call sent a valid key (the raw header value, decoded as HTTP headers are: latin-1)."""
        return authorization is not None and self.is_valid_key(authorization.decode("latin-1"))

    def headers(self) -> list[tuple[bytes, bytes]]:
        """The 429's own headers, in the order the app's error response had them."""
        return [(b"retry-after", str(self.bucket.retry_after_s()).encode()), (b"content-length", self._length),
                (b"content-type", b"application/json")]


class KeylessGateMiddleware:
    """Refuses a keyless GET of a limited route past the rate with the 429 itself; passes everything else on."""

    def __init__(self, app: ASGIApp, gate: KeylessGate) -> None:
        self.app = app
        self.gate = gate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gate = self.gate
        if (scope["type"] == "http" and scope["path"] in gate.routes and scope["method"] == "GET"
                and not scope.get(ADMITTED) and not gate.exempt(_header(scope["headers"], b"authorization"))
                and not gate.bucket.take()):
            await send({"type": "http.response.start", "status": 429, "headers": gate.headers()})
            await send({"type": "http.response.body", "body": gate.body})
            return
        await self.app(scope, receive, send)


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    for key, value in headers:
        if key == name:
            return value
    return None


def _plain_get(data: bytes, routes: frozenset[bytes]) -> tuple[bool, bytes | None]:
    """(whether `data` is exactly one plain HTTP/1.1 GET of one of `routes`, its Authorization value)."""
    end = data.find(b"\r\n\r\n")
    if end != len(data) - 4:  # a partial request, a body, or pipelined requests
        return False, None
    lines = data[:end].split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or parts[2] != b"HTTP/1.1" or parts[1].partition(b"?")[0] not in routes:
        return False, None
    authorization = None
    host = False
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        name = name.lower()
        if not sep or not name or name in _NOT_PLAIN or name != name.strip():  # also a folded line
            return False, None
        value = value.strip(b" \t")
        if name == b"host":
            if host:
                return False, None
            host = True
        elif name == b"authorization":
            if authorization is not None:
                return False, None
            authorization = value
        elif name == b"connection" and value.lower() != b"keep-alive":
            return False, None
    return host, authorization


def keyless_h11_protocol(gate: KeylessGate) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol with `gate`'s refusals answered from the raw bytes (module docstring)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class KeylessH11Protocol(H11Protocol):
        def data_received(self, data: bytes) -> None:
            if not data.startswith(b"GET /") or not gate.active:
                super().data_received(data)
                return
            plain, authorization = _plain_get(data, gate.raw_routes)
            conn = self.conn
            if (not plain or conn.our_state is not h11.IDLE or conn.their_state is not h11.IDLE
                    or self.flow.write_paused or conn.trailing_data[0] or gate.exempt(authorization)):
                super().data_received(data)
                return
            if gate.bucket.take():
                before = self.scope
                super().data_received(data)
                if self.scope is not before and self.scope is not None:
                    self.scope[ADMITTED] = True  # type: ignore[literal-required]  # read before its task runs
                return
            self._unset_keepalive_if_required()
            headers = self.server_state.default_headers + gate.headers()
            self.transport.write(b"".join((_STATUS_LINE, *(b"%s: %s\r\n" % kv for kv in headers), b"\r\n",
                                           gate.body)))
            self.on_response_complete()  # counts the request, re-arms the keep-alive timer

    return KeylessH11Protocol

