"""One `SchedulerClient` (client/scheduler_client.py) that both front ends drive, each over its transport, with one
request-state type that both extend (client/request_state.py)."""

from __future__ import annotations

import ast
import asyncio
import pathlib
from concurrent.futures import Future

import pytest

from radixserve.client.request_state import RequestState
from radixserve.client.scheduler_client import InProcessTransport, SchedulerClient
from radixserve.protocol.io_struct import (
    AbortReq,
    BatchTokenIDOut,
    FlushCacheOut,
    FlushCacheReq,
    TokenIDOut,
)

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "radixserve"


class Recording:
    """A transport that keeps what it is given; `refuse` makes the next send raise."""

    def __init__(self, inner=None) -> None:
        self.sent: list = []
        self.inner = inner
        self.refuse = False

    def send_request(self, msg) -> None:
        self._send(msg, "request")

    def send_control(self, msg) -> None:
        self._send(msg, "control")

    def _send(self, msg, kind: str) -> None:
        if self.refuse:
            raise ConnectionError("refused")
        self.sent.append((kind, type(msg).__name__))
        if self.inner is not None:
            getattr(self.inner, f"send_{kind}")(msg)


def _record(rid: str, ids: list[int], finished: dict | None = None, cached: int = 0) -> TokenIDOut:
    return TokenIDOut(rid, ids, finished, 5, len(ids), cached)


def test_the_client_routes_records_and_answers_control_in_order():
    transport = Recording()
    client: SchedulerClient[RequestState] = SchedulerClient(transport)
    a, b = RequestState("a", 5), RequestState("b", 5)
    client.track("a", a)
    client.track("b", b)
    with pytest.raises(ValueError, match="already in use"):
        client.track("a", RequestState("a", 1))
    client.abort("b")
    assert transport.sent == [("control", "AbortReq")]
    routed = list(client.route(BatchTokenIDOut([_record("a", [7], cached=3), _record("b", [], {"type": "abort"})])))
    assert [(s.rid, r.new_token_ids) for s, r in routed] == [("a", [7]), ("b", [])]
    for state, record in routed:
        state.observe(record, 1.0)
    assert a.cached_tokens == 3 and a.first_token_at == 1.0 and not a.finished
    assert b.finished and b.first_token_at is None
    assert len(client.requests) == 1  # NOTE: b left with its final record
    first, second = Future(), Future()
    client.ask(FlushCacheReq(), FlushCacheOut, first)
    client.ask(FlushCacheReq(), FlushCacheOut, second)
    reply = FlushCacheOut(True, 0, "")
    assert client.receive(reply) is None and first.result(0) is reply and not second.done()
    transport.refuse = True
    third = Future()
    with pytest.raises(ConnectionError):
        client.ask(FlushCacheReq(), FlushCacheOut, third)  # NOTE: never sent: it must not take second's answer
    later = FlushCacheOut(True, 1, "")
    client.receive(later)
    assert second.result(0) is later and not third.done()
    batch = BatchTokenIDOut([])
    assert client.receive(batch) is batch
    assert client.fail_all(RuntimeError("gone")) == [a] and len(client.requests) == 0


def test_the_engine_drives_the_scheduler_through_its_client(engines):
    engine = engines[0]
    assert isinstance(engine.client, SchedulerClient)
    inner = engine.client.transport
    assert isinstance(inner, InProcessTransport)
    engine.client.transport = recording = Recording(inner)
    try:
        handle = engine.submit([1, 2, 3, 4], {"max_new_tokens": 3, "temperature": 0})
        assert isinstance(handle._state, RequestState)
        handle.result(timeout=120)
        engine.flush_cache()
        engine.get_internal_state()
    finally:
        engine.client.transport = inner
    assert recording.sent == [("request", "TokenizedGenerateReqInput"), ("control", "FlushCacheReq"),
                              ("control", "GetInternalStateReq")]


def test_the_http_side_drives_the_same_client():
    from radixserve.frontend import tokenizer_manager as tm_module
    from radixserve.frontend.scheduler_link import SchedulerLink
    from radixserve.frontend.tokenizer_manager import TokenizerManager
    from radixserve.protocol.scheduler_info import SchedulerInfo

    assert issubclass(tm_module._ReqState, RequestState)

    async def run() -> None:
        link = SchedulerLink()
        try:
            info = SchedulerInfo("m", None, 512, 100, (0,), 512, 1, 8, "float32", "cpu", 1)
            tm = TokenizerManager(info, link)
            assert isinstance(tm.client, SchedulerClient) and tm.client.transport is link
            other = SchedulerLink()
            tm.attach(other, None, info)  # NOTE: a restarted scheduler: the client's transport is the new link
            assert tm.client.transport is other
            await tm.detach()
            other.close()
        finally:
            link.close()

    asyncio.run(run())


def test_the_front_ends_send_only_through_the_client():
    """Neither front end touches a transport itself: every send is the client's."""
    sends = {"send_request", "send_control", "send_pyobj", "put"}
    for path in (PACKAGE / "entrypoints" / "engine.py", PACKAGE / "frontend" / "tokenizer_manager.py"):
        calls = [ast.unparse(n.func) for n in ast.walk(ast.parse(path.read_text()))
                 if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in sends]
        calls = [c for c in calls if not c.startswith(("state.queue", "state.increments"))]
        assert not calls, (path.name, calls)
    assert AbortReq.__name__ not in (PACKAGE / "entrypoints" / "engine.py").read_text()
