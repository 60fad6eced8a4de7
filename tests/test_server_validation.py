"""The boundary's rules without a model: sampling parameters, token ids, body parsing, fair admission,
the control outbox and the restart budget (the reproducers of issue 11 that need no server)."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.entrypoints.http_errors import ApiError, decode_body
from radixserve.entrypoints.openai_protocol import CompletionRequest, GenerateRequest
from radixserve.entrypoints.serving_common import token_id_keys
from radixserve.frontend.fair_admission import FairAdmission
from radixserve.frontend.scheduler_link import SchedulerBusy, SchedulerLink, SchedulerUnavailable
from radixserve.frontend.scheduler_supervisor import RestartBudget
from radixserve.protocol.io_struct import AbortReq, FlushCacheReq
from radixserve.sampling_params import TEMPERATURE_FLOOR, SamplingParams, SamplingParamsError, check_input_ids

VOCAB = 49152


@pytest.mark.parametrize("values, param", [
    ({"stop_token_ids": [10**19]}, "stop_token_ids"),  # overflowed int64 in the sampler
    ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"top_k": 10**19}, "top_k"),  # "Overflow when unpacking long long"
    ({"top_k": 0}, "top_k"),
    ({"temperature": float("inf")}, "temperature"),
    ({"temperature": 10**400}, "temperature"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"stop": {"a": 1}}, "stop"),
    ({"stop": 5}, "stop"),
    ({"stop_token_ids": 5}, "stop_token_ids"),
    ({"stop": ["\ud800"]}, "stop"),
    ({"n": True}, "n"),
    ({"logit_bias": {3: float("nan")}}, "logit_bias"),
])
def test_sampling_params_refuse_what_used_to_reach_the_scheduler(values, param) -> None:
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(**values)
    assert e.value.param == param
    assert len(str(e.value)) < 200  # a huge value is shown cut short


@pytest.mark.parametrize("values, param", [
    ({"stop_token_ids": [60000]}, "stop_token_ids"),  # IndexError in penalties.py (vocabulary 49152)
    ({"stop_token_ids": [VOCAB]}, "stop_token_ids"),
    ({"logit_bias": {VOCAB: 1.0}}, "logit_bias"),
])
def test_token_ids_are_checked_against_the_vocabulary(values, param) -> None:
    params = SamplingParams(**values)  # well-formed without a model...
    with pytest.raises(SamplingParamsError) as e:
        params.verify_for_model(VOCAB)  # ...but not for this one
    assert e.value.param == param and f"[0, {VOCAB})" in str(e.value)
    SamplingParams(stop_token_ids=[VOCAB - 1], logit_bias={0: -100}).verify_for_model(VOCAB)


def test_temperature_below_the_floor_is_greedy() -> None:
    assert SamplingParams(temperature=1e-300).is_greedy  # 0.0 in float32: it used to give NaN logprobs
    assert SamplingParams(temperature=TEMPERATURE_FLOOR / 2).is_greedy
    assert not SamplingParams(temperature=TEMPERATURE_FLOOR).is_greedy


def test_token_id_prompts() -> None:
    check_input_ids([0, VOCAB - 1], VOCAB)
    for bad in ([], [VOCAB], [-1], [True], [1.0], "abc"):
        with pytest.raises(SamplingParamsError):
            check_input_ids(bad, VOCAB)


@pytest.mark.parametrize("key", ["\u00b2", "\u0663", "-1", "+5", " 5", "5.0", "", "1" * 40, str(VOCAB)])
def test_logit_bias_keys_are_ascii_token_ids(key: str) -> None:
    with pytest.raises(ApiError) as e:
        token_id_keys({key: 1.0}, VOCAB)
    assert e.value.status == 400 and e.value.param == "logit_bias"
    assert token_id_keys({"42": 1.5}, VOCAB) == {42: 1.5}


@pytest.mark.parametrize("raw, code, param", [
    (b"[" * 100_000 + b"]" * 100_000, "invalid_json", None),  # RecursionError before
    (b'{"prompt": "x", "model": "\\ud800"}', "invalid_utf8", "model"),  # echoed into a 500 before
    (b'{"prompt": "x", "extra_key": "\\udfff"}', "invalid_utf8", "extra_key"),
    (b'{"prompt": "x", "stop": ["ok", "\\ud800"]}', "invalid_utf8", "stop.1"),
    (b'{"prompt": "x", "logit_bias": {"\\ud800": 1}}', "invalid_utf8", "logit_bias"),
])
def test_bodies_bounded_in_nesting_and_valid_unicode(raw: bytes, code: str, param: str | None) -> None:
    with pytest.raises(ApiError) as e:
        decode_body(raw, CompletionRequest)
    assert (e.value.status, e.value.code, e.value.param) == (400, code, param)
    json.loads(e.value.response().body)  # the error itself always renders
    shallow = b'{"prompt": "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[ \\" {{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{"}'
    assert decode_body(shallow, CompletionRequest).prompt.startswith("[[[")


def test_native_sampling_params_are_typed_strictly() -> None:
    for bad, param in [({"ignore_eos": "yes"}, "sampling_params.ignore_eos"),
                       ({"stop_token_ids": [True]}, "sampling_params.stop_token_ids.0"),
                       ({"stop": 5}, "sampling_params.stop"), ({"beam": 3}, "sampling_params")]:
        with pytest.raises(ApiError) as e:
            decode_body(json.dumps({"text": "x", "sampling_params": bad}).encode(), GenerateRequest)
        assert e.value.status == 400 and e.value.param == param, e.value.message


# ---------------------------------------------------------------------------------- fair admission


def _cancel_all(admission: FairAdmission, waits: list[asyncio.Future]) -> None:
    for t in waits:
        t.cancel()


async def _withdraw(admission: FairAdmission, waits: list[asyncio.Future]) -> None:
    """Cancels what still waits and releases what was granted; nothing may be left behind."""
    _cancel_all(admission, waits)
    await asyncio.gather(*waits, return_exceptions=True)
    for t in waits:
        if not t.cancelled():
            admission.release(t.result())


def test_a_small_request_is_released_at_once_beside_a_large_one() -> None:
    async def run() -> None:
        admission = FairAdmission(max_running=8, slice_size=4)
        big = [asyncio.ensure_future(admission.acquire("a", "big")) for _ in range(100)]
        await asyncio.sleep(0)
        assert sum(t.done() for t in big) == 4  # one slice queued
        small = await asyncio.wait_for(admission.acquire("b", "small"), 0.1)  # never waits behind it
        assert admission.num_queued == 5
        for t in big[:4]:
            admission.started(t.result())
        await asyncio.sleep(0)
        # NOTE: share of the running batch: (8 - 1) // 2 keys = 3 outstanding for "big", which has 4.
        assert sum(t.done() for t in big) == 4
        admission.release(small)
        await asyncio.sleep(0)
        assert sum(t.done() for t in big) == 7  # alone again: 8 - 1, one row kept free
        await _withdraw(admission, big)
        assert (admission.num_waiting, admission.num_outstanding) == (0, 0) and not admission._groups

    asyncio.run(run())


def test_keys_share_the_batch_equally_then_their_requests_share_the_keys_part() -> None:
    async def run() -> None:
        admission = FairAdmission(max_running=13, slice_size=16)
        waits = {g: [asyncio.ensure_future(admission.acquire(k, g)) for _ in range(20)]
                 for k, g in [("a", "a1"), ("a", "a2"), ("b", "b1")]}
        await asyncio.sleep(0)
        granted = {g: sum(t.done() for t in ts) for g, ts in waits.items()}
        assert granted == {"a1": 12, "a2": 1, "b1": 1}  # a1 came first; the others' first tickets go at once
        for t in waits["a1"][:12]:  # as a1's sequences end, the rows go to the others, never back to a1
            admission.started(t.result())
            admission.release(t.result())
            await asyncio.sleep(0)
        granted = {g: sum(t.done() for t in ts) for g, ts in waits.items()}
        # (13 - 1) // 2 keys = 6 each; key a's 6 split over its two requests
        assert {g: n - (12 if g == "a1" else 0) for g, n in granted.items()} == {"a1": 3, "a2": 3, "b1": 6}
        for ts in waits.values():
            await _withdraw(admission, ts)
        assert not admission._groups and admission.num_outstanding == 0

    asyncio.run(run())


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.integers(0, 5), st.integers(1, 12)), min_size=1, max_size=8),
       st.integers(1, 9), st.integers(1, 5), st.randoms(use_true_random=False))
def test_admission_never_leaks_and_respects_the_slice(arrivals, max_running, slice_size, rnd) -> None:
    async def run() -> None:
        admission = FairAdmission(max_running, slice_size)
        live: list = []

        async def one(key: str, group: str, cancel: bool) -> None:
            task = asyncio.ensure_future(admission.acquire(key, group))
            if cancel:
                await asyncio.sleep(0)
                task.cancel()
            try:
                ticket = await task
            except asyncio.CancelledError:
                return
            queued = {g: v.queued for g, v in admission._groups.items()}
            assert all(q <= slice_size for q in queued.values())
            live.append(ticket)
            await asyncio.sleep(rnd.random() / 1000)
            admission.started(ticket)
            await asyncio.sleep(rnd.random() / 1000)
            admission.release(ticket)

        plan = [(k, f"{k}{g}", rnd.random() < 0.2) for k, g, n in arrivals for _ in range(n)]
        await asyncio.wait_for(asyncio.gather(*(one(*p) for p in plan)), 10)
        assert (admission.num_waiting, admission.num_queued, admission.num_outstanding) == (0, 0, 0)
        assert not admission._groups and not admission._keys

    asyncio.run(run())


# ---------------------------------------------------------------------------------- link and budget


def _stalled_scheduler(link: SchedulerLink, stop: threading.Event, received: list) -> threading.Thread:
    """Connects like the scheduler and reads nothing until `stop` is set, then drains into `received`."""

    def serve() -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.RCVHWM, 10)
        sock.connect(link.port_args.request_endpoint)
        stop.wait()
        while sock.poll(200):
            received.append(sock.recv_pyobj())
        sock.close(0)
        ctx.term()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def test_control_messages_wait_in_the_outbox_while_requests_meet_backpressure() -> None:
    link = SchedulerLink()
    link.requests.setsockopt(zmq.SNDHWM, 10)
    stop, received = threading.Event(), []
    thread = _stalled_scheduler(link, stop, received)
    try:
        asyncio.run(link.wait_connected(5))
        sent = 0
        with pytest.raises(SchedulerBusy):
            for sent in range(100_000):  # noqa: B007 - counts until the queue is full
                link.send_request(("req", sent, b"x" * 4096))
        assert 0 < sent < 100_000
        aborts = [AbortReq(f"r{i}") for i in range(50)]
        for msg in [*aborts, FlushCacheReq()]:
            link.send_control(msg)  # never refused, never dropped
        assert link.outbox_size > 0
        with pytest.raises(SchedulerBusy, match="control message"):
            link.send_request(("req", "late"))  # nothing overtakes a waiting abort
        stop.set()
        deadline = time.monotonic() + 10
        while link.flush_outbox() and time.monotonic() < deadline:
            time.sleep(0.01)
        thread.join(10)
        assert [m for m in received if not isinstance(m, tuple)] == [*aborts, FlushCacheReq()]
    finally:
        stop.set()
        link.close()
    with pytest.raises(SchedulerUnavailable):
        link.send_control(AbortReq("x"))


def test_restart_budget_counts_within_its_window() -> None:
    budget = RestartBudget(2, window_s=0.2)
    assert budget.take() and budget.take() and not budget.take()
    time.sleep(0.25)
    assert budget.take()
    assert RestartBudget(0, 10).take() is False
