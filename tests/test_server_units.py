"""Server pieces that need no model: namespaces, body parsing, usage aggregation, max_tokens resolution,
logprob formatting, and the ZMQ link to the scheduler (with a fake scheduler thread)."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from types import SimpleNamespace

import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.entrypoints.http_errors import ApiError, parse_json
from radixserve.entrypoints.logprobs import (
    LOGPROB_FLOOR,
    TokenTexts,
    byte_level_alphabet,
    chat_logprobs,
    completion_logprobs,
    native_logprobs,
)
from radixserve.entrypoints.serving_common import resolve_max_tokens
from radixserve.entrypoints.serving_openai import _Usage
from radixserve.frontend.scheduler_link import SchedulerLink
from radixserve.frontend.tokenizer_manager import (
    GenerateOutput,
    SchedulerUnavailable,
    TokenizerManager,
    api_key_id,
    cache_namespace,
)
from radixserve.mem_cache.radix_key import check_namespace
from radixserve.protocol.io_struct import NO_LOGPROBS, GetInternalStateOut, GetInternalStateReq
from radixserve.protocol.requests import check_request, per_choice_params
from radixserve.protocol.scheduler_info import PortArgs, SchedulerInfo
from radixserve.sampling_params import SamplingParams


def test_namespaces_are_structured_and_never_alias() -> None:
    keys = [
        cache_namespace(None, None, None),
        cache_namespace(None, "a", None),
        cache_namespace(None, None, "a"),
        cache_namespace(None, "a", "b"),
        cache_namespace(None, "a|b", None),
        cache_namespace(None, "ab", None),
        cache_namespace(api_key_id("k1"), None, None),
        cache_namespace(api_key_id("k1"), "a", None),
        cache_namespace(api_key_id("k2"), "a", None),
    ]
    assert keys[0] is None
    assert len(set(keys)) == len(keys)
    for key in keys:
        check_namespace(key)  # the radix tree accepts every one of them
    # The key-derived part always comes first, so a client salt can only add to it.
    assert keys[7][0] == ("api", api_key_id("k1")) and keys[7][1] == ("salt", "a")
    assert api_key_id("k1") != api_key_id("k2") and "k1" not in api_key_id("k1")


@pytest.mark.parametrize("raw, code", [(b"{", "invalid_json"), (b"\xff{}", "invalid_utf8"), (b"", "invalid_json"),
                                       (b'{"t": NaN}', "invalid_json")])
def test_parse_json_rejects_bad_bodies(raw: bytes, code: str) -> None:
    with pytest.raises(ApiError) as e:
        parse_json(raw)
    assert e.value.status == 400 and e.value.code == code


# The body parser's time grows linearly in the body: every shape of body, repeated from 16 KB to 256 KB, takes
# at most ~16x (plus a floor for timer noise) and well under a second. The old string scan took 1.9 s at 16 KB
# and 28 s at 64 KB for an unterminated string of escaped quotes (quadratic).
_UNITS = st.lists(st.sampled_from([b'"', b"\\", b"[", b"]", b"{", b"}", b"a", b",", b":", b"1", b"\n", b"\xc3\xa9"]),
                  min_size=1, max_size=8).map(b"".join)


def _parse_seconds(raw: bytes) -> float:
    start = time.perf_counter()
    try:
        parse_json(raw)
    except ApiError:
        pass
    return time.perf_counter() - start


@settings(max_examples=40, deadline=None)
@given(prefix=st.sampled_from([b"", b'{"a": "', b'{"a": [', b'{"messages": [{"content": "']), unit=_UNITS)
def test_body_parsing_time_is_linear_in_the_body(prefix: bytes, unit: bytes) -> None:
    small, large = (prefix + unit * (size // len(unit)) for size in (16 << 10, 256 << 10))
    small_s = min(_parse_seconds(small) for _ in range(3))
    large_s = min(_parse_seconds(large) for _ in range(3))
    assert large_s < 1.0 and large_s < 16 * max(small_s, 2e-3) * 2, (unit, small_s, large_s)


def _tm(context: int, pool: int, page: int = 1) -> SimpleNamespace:
    info = SchedulerInfo("m", None, context, 100, (0,), pool, page, 8, "float32", "cpu", 1)
    return SimpleNamespace(info=info)


def test_max_tokens_unset_is_the_rest_of_the_effective_context() -> None:
    assert resolve_max_tokens(_tm(2048, 1024), 24, None, "prompt") == 1000  # bounded by the pool
    assert resolve_max_tokens(_tm(512, 4096), 12, None, "prompt") == 500  # bounded by the context
    assert resolve_max_tokens(_tm(512, 4096), 12, 7, "prompt") == 7
    with pytest.raises(ApiError) as e:
        resolve_max_tokens(_tm(512, 4096), 12, 501, "prompt")
    assert e.value.code == "context_length_exceeded" and e.value.param == "max_tokens"
    assert "513 tokens (12 in the prompt, 501 in the completion)" in e.value.message
    with pytest.raises(ApiError) as e:
        resolve_max_tokens(_tm(2048, 1000, page=16), 992, None, "messages")  # pool rounds down to 992
    assert e.value.code == "kv_pool_exceeded" and e.value.param == "messages"


@settings(max_examples=300, deadline=None)
@given(context=st.integers(2, 80), pool=st.integers(1, 80), page=st.sampled_from([1, 4, 16]),
       prompt=st.integers(1, 90), new=st.integers(1, 90))
def test_the_front_end_and_the_scheduler_check_one_length_rule(context, pool, page, prompt, new) -> None:
    """A prompt the HTTP side sends (with one new token) is one the scheduler takes, and the reverse; and a
    completion the HTTP side accepts fits the pool in whole pages, as the scheduler cuts it on admission."""
    tm = _tm(context, pool, page)
    scheduler_refuses = check_request([1] * prompt, NO_LOGPROBS, None, tm.info.limits) is not None
    try:
        resolve_max_tokens(tm, prompt, 1, "prompt")
        http_refuses = False
    except ApiError as e:
        http_refuses = True
        assert e.code in ("context_length_exceeded", "kv_pool_exceeded") and e.param in ("prompt", "max_tokens")
    assert http_refuses == scheduler_refuses
    try:
        asked = resolve_max_tokens(tm, prompt, new, "prompt")
    except ApiError:
        return
    assert asked == new and -(-(prompt + new) // page) * page <= pool and prompt + new <= context


def _out(completion: int, cached: int) -> GenerateOutput:
    return GenerateOutput("r", "", [], {"type": "length"}, 10, completion, cached)


def test_usage_counts_each_prompt_once_and_the_smallest_hit_among_its_choices() -> None:
    usage = _Usage([10, 20], n=2)
    for index, (completion, cached) in enumerate([(3, 0), (3, 9), (4, 19), (4, 19)]):
        usage.add(index, _out(completion, cached))
    info = usage.info()
    assert (info.prompt_tokens, info.completion_tokens, info.total_tokens) == (30, 14, 44)
    assert info.prompt_tokens_details.cached_tokens == 0 + 19


def test_logprob_shapes_offsets_duplicates_and_the_floor() -> None:
    tokenizer = SimpleNamespace(decode=lambda ids: {1: "ab", 2: "c", 3: "\ufffd", 4: "\ufffd"}[ids[0]])
    texts = TokenTexts(tokenizer)  # not byte-level: bytes are the UTF-8 of the text
    out = GenerateOutput("r", "", [1, 2], None, 3, 2, 0, logprobs=[-0.5, float("-inf")],
                         top_logprobs=[[(1, -0.5), (2, -1.0)], [(3, -0.1), (4, -0.2)]])
    lp = completion_logprobs(texts, out, offset=7)
    assert lp.tokens == ["ab", "c"] and lp.text_offset == [7, 9]
    assert lp.token_logprobs == [-0.5, LOGPROB_FLOOR]  # JSON has no -inf
    assert lp.top_logprobs == [{"ab": -0.5, "c": -1.0}, {"\ufffd": -0.1}]  # same text: the likelier
    chat = chat_logprobs(texts, out).content
    assert [(e.token, e.bytes, len(e.top_logprobs)) for e in chat] == [("ab", [97, 98], 2), ("c", [99], 2)]
    assert native_logprobs(texts, out)["output_token_logprobs"] == [[-0.5, 1, "ab"], [LOGPROB_FLOOR, 2, "c"]]
    empty = GenerateOutput("r", "", [], {"type": "stop"}, 3, 2, 0, logprobs=[], top_logprobs=[])
    assert completion_logprobs(texts, empty, offset=3).text_offset == [] and chat_logprobs(texts, empty).content == []
    alphabet = byte_level_alphabet()
    assert sorted(alphabet.values()) == list(range(256)) and alphabet["\u0120"] == 0x20 and alphabet["A"] == 65


def test_echoed_prompt_logprobs_come_first_with_null_at_position_zero() -> None:
    texts = TokenTexts(SimpleNamespace(decode=lambda ids: {5: "Hi", 6: " there", 1: "ab", 2: "c"}[ids[0]]))
    out = GenerateOutput("r", "", [1], None, 2, 1, 0, logprobs=[-0.5], top_logprobs=[[(1, -0.5)]],
                         input_logprobs=[None, -2.0], input_top_logprobs=[[], [(2, -1.0), (6, -2.0)]])
    lp = completion_logprobs(texts, out, echo=[5, 6])
    assert lp.tokens == ["Hi", " there", "ab"] and lp.text_offset == [0, 2, 8]
    assert lp.token_logprobs == [None, -2.0, -0.5]
    assert lp.top_logprobs == [None, {"c": -1.0, " there": -2.0}, {"ab": -0.5}]
    native = native_logprobs(texts, out, [5, 6])
    assert native["input_token_logprobs"] == [[None, 5, "Hi"], [-2.0, 6, " there"]]
    assert native["input_top_logprobs"] == [[], [[-1.0, 2, "c"], [-2.0, 6, " there"]]]
    # Never sent (a request aborted before its prompt was computed): the prompt's tokens without values.
    aborted = GenerateOutput("r", "", [], {"type": "abort", "status_code": 499}, 2, 0, 0, logprobs=[], top_logprobs=[])
    assert completion_logprobs(texts, aborted, echo=[5, 6]).token_logprobs == [None, None]
    assert native_logprobs(texts, aborted, [5, 6])["input_token_logprobs"] == []
    assert "input_token_logprobs" not in native_logprobs(texts, out)


def test_n_choices_get_distinct_seeds_only_when_seeded() -> None:
    seeded = per_choice_params(SamplingParams(seed=5, n=3), 3)
    assert [p.seed for p in seeded] == [5, 6, 7] and all(p.n == 1 for p in seeded)
    assert [p.seed for p in per_choice_params(SamplingParams(n=2), 2)] == [None, None]


class _FakeScheduler:
    """Connects like the scheduler child (PULL requests, PUSH outputs) and answers GetInternalStateReq."""

    def __init__(self, port_args: PortArgs) -> None:
        self._ctx = zmq.Context()
        self._port_args = port_args
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        # NOTE: the sockets live on this thread only; close() terms the context, which ends recv here.
        requests, outputs = self._ctx.socket(zmq.PULL), self._ctx.socket(zmq.PUSH)
        requests.connect(self._port_args.request_endpoint)
        outputs.connect(self._port_args.output_endpoint)
        try:
            while True:
                if isinstance(requests.recv_pyobj(), GetInternalStateReq):
                    outputs.send_pyobj(GetInternalStateOut({"fake": True}))
        except zmq.ContextTerminated:
            pass
        finally:
            requests.close(linger=0)
            outputs.close(linger=0)

    def close(self) -> None:
        self._ctx.term()
        self._thread.join(5)


def _info() -> SchedulerInfo:
    return SchedulerInfo("m", None, 512, 100, (0,), 512, 1, 8, "float32", "cpu", 1)


async def _first_request_right_after_start(link: SchedulerLink) -> dict:
    tm = TokenizerManager(_info(), link)
    await tm.start()
    try:
        return await tm.get_internal_state(timeout_s=5.0)
    finally:
        await tm.shutdown()


def test_a_scheduler_that_connected_before_the_bind_is_reachable_once_start_returns() -> None:
    # The child connects before its model loads; if that was before the bind, ZMQ retries the connect
    # only on its reconnect timer (100-200 ms). Requests sent in that gap used to fail with 503.
    port_args = PortArgs.new()
    fake = _FakeScheduler(port_args)
    time.sleep(0.3)
    try:
        assert asyncio.run(_first_request_right_after_start(SchedulerLink(port_args))) == {"fake": True}
    finally:
        fake.close()


def test_a_scheduler_connecting_after_the_bind_is_connected_without_a_retry() -> None:
    link = SchedulerLink()
    fake = _FakeScheduler(link.port_args)
    try:
        deadline = time.monotonic() + 0.05  # far below ZMQ's 100 ms reconnect interval
        while not link.connected():
            assert time.monotonic() < deadline, "no peer yet: the connect was not accepted at once"
            time.sleep(0.001)
        assert asyncio.run(_first_request_right_after_start(link)) == {"fake": True}
    finally:
        fake.close()


def test_start_fails_when_the_scheduler_never_connects_and_a_drop_is_counted() -> None:
    link = SchedulerLink()
    with pytest.raises(SchedulerUnavailable, match="did not connect"):
        asyncio.run(link.wait_connected(timeout_s=0.2))
    fake = _FakeScheduler(link.port_args)
    try:
        asyncio.run(link.wait_connected(timeout_s=5.0))
        assert link.disconnects() == 0
    finally:
        fake.close()
    deadline = time.monotonic() + 5
    while (drops := link.disconnects()) == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert drops == 1
    link.close()
    assert not os.path.exists(link.port_args.folder)


def test_coalesced_jobs_run_once_for_concurrent_callers_and_never_cache_a_failure() -> None:
    from radixserve.entrypoints.coalesce import Coalesced

    async def scenario() -> None:
        gate = asyncio.Event()
        outcomes = iter(["first", RuntimeError("scheduler gone"), "third"])

        async def job() -> str:
            await gate.wait()
            outcome = next(outcomes)
            if isinstance(outcome, Exception):
                raise outcome
            return outcome

        probe = Coalesced(job)
        callers = [asyncio.ensure_future(probe.get()) for _ in range(50)]
        await asyncio.sleep(0)
        callers[0].cancel()  # one caller gives up: the others still get the answer
        gate.set()
        results = await asyncio.gather(*callers, return_exceptions=True)
        assert probe.runs == 1 and results[1:] == ["first"] * 49 and isinstance(results[0], asyncio.CancelledError)
        with pytest.raises(RuntimeError, match="scheduler gone"):
            await probe.get()  # finished: ttl 0 means the next caller runs it again
        assert await probe.get() == "third" and probe.runs == 3  # the failure was not kept

        cached = Coalesced(lambda: asyncio.sleep(0, result=time.monotonic()), ttl_s=60.0)
        assert await cached.get() == await cached.get() and cached.runs == 1  # reused within its ttl

    asyncio.run(scenario())
