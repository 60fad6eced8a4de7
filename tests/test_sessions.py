"""Agent sessions (managers/session_cache.py): a session's latest context stays pinned in the radix tree.

Scheduler tests on the fake model of test_scheduler_fake.py, with a tiny pool, and conservation after every step;
the endpoints on the real server (the shared tenant server of server_harness.py) at the end of this file.
"""

from __future__ import annotations

import random

import pytest
from server_harness import TENANT_KEYS, check_idle_conservation, tenant_server, wait_idle

from radixserve.mem_cache.conservation import check_conservation
from radixserve.mem_cache.radix_key import RadixKey
from radixserve.protocol.io_struct import (
    CloseSessionReq,
    FlushCacheReq,
    OpenSessionReq,
    SessionOut,
    TokenizedGenerateReqInput,
)
from radixserve.sampling_params import SamplingParams
from tests.test_scheduler_fake import make_scheduler, reference

OWNER_A = ("api", "tenant-a")
OWNER_B = ("api", "tenant-b")


def setup(pool=160, **extra):
    sched, outputs = make_scheduler(pool_tokens=pool, **extra)
    replies: list[SessionOut] = []
    inner = sched.output_sink

    def sink(out):
        if isinstance(out, SessionOut):
            replies.append(out)
        else:
            inner(out)

    sched.output_sink = sink
    return sched, outputs, replies


def control(sched, replies, msg) -> SessionOut:
    sched.process_input_requests([msg])
    return replies.pop()


def turn(sched, rid, prompt, session=None, owner=OWNER_A, new=4):
    sp = SamplingParams(max_new_tokens=new, ignore_eos=True)
    msg = TokenizedGenerateReqInput(rid, list(prompt), sp, extra_key=(owner,), session_id=session,
                                    session_field="session_params.id")
    sched.input_queue.put(msg)
    run(sched)
    return list(prompt) + reference(list(prompt), sp)


def run(sched):
    sched.run_until_idle(on_step=lambda: conserve(sched))
    conserve(sched)
    assert sched.req_to_token_pool.available_size() == sched.req_to_token_pool.size
    # NOTE: at idle every protected token is a session's pin (a head two sessions share counts once here)
    assert sched.tree_cache.protected_size() <= sched.sessions.pinned_tokens


def conserve(sched) -> None:
    """The identity, with the sessions' pins as the only locks allowed at idle."""
    check_conservation(sched.token_to_kv_pool_allocator, sched.tree_cache, sched.req_to_token_pool,
                       [r.kv for r in sched.active_requests()], sched.sessions.pinned_nodes())


def cached_len(sched, tokens, owner=OWNER_A) -> int:
    return len(sched.tree_cache.match_prefix(RadixKey(list(tokens), (owner,))).device_indices)


def prompt_of(seed, n=40):
    rng = random.Random(seed)
    return [rng.randrange(1, 100) for _ in range(n)]


def test_session_context_survives_pressure_that_evicts_an_anonymous_prefix():
    sched, outputs, replies = setup()
    assert control(sched, replies, OpenSessionReq("tenant-a", "s1")).session_id == "s1"
    ctx = turn(sched, "a", prompt_of(1), session="s1")
    anon = turn(sched, "b", prompt_of(2))
    # NOTE: a context's last token was sampled, never fed back: 40 + 4 tokens, 43 of them with KV
    assert len(ctx) == len(anon) == 44
    assert sched.sessions.pinned_tokens == 43 and cached_len(sched, anon) == 43
    turn(sched, "c", prompt_of(3, 100))  # needs 104 of the 74 free: eviction
    assert cached_len(sched, ctx) == 43, "the session's context was evicted"
    assert cached_len(sched, anon) < 43, "the anonymous prefix of the same size was not evicted"
    # the next turn of the session reuses its whole context
    turn(sched, "d", ctx + prompt_of(4, 8), session="s1")
    assert outputs["d"]["cached"] >= 43
    assert control(sched, replies, CloseSessionReq("tenant-a", "s1")).success
    assert sched.tree_cache.protected_size() == 0
    conserve(sched)


def test_pin_moves_to_the_latest_turn():
    sched, _, replies = setup(pool=400)
    control(sched, replies, OpenSessionReq("tenant-a", "s"))
    ctx1 = turn(sched, "t1", prompt_of(1), session="s")
    ctx2 = turn(sched, "t2", ctx1 + prompt_of(5, 6), session="s")
    pin = sched.sessions.sessions[("tenant-a", "s")].pin
    assert pin.tokens == len(ctx2) - 1 == 53
    assert sched.tree_cache.protected_size() == 53  # one path: the first turn's context is its head
    ctx3 = turn(sched, "t3", prompt_of(9, 20), session="s")  # a turn that shares nothing: the old path unlocks
    assert sched.sessions.sessions[("tenant-a", "s")].pin.tokens == len(ctx3) - 1
    assert sched.tree_cache.protected_size() == len(ctx3) - 1
    assert sched.tree_cache.evictable_size() >= len(ctx2) - 1


def test_bounds_per_session_in_total_and_count():
    sched, _, replies = setup(pool=400, session_max_tokens=30, session_max_pinned_tokens=50, max_sessions=2)
    control(sched, replies, OpenSessionReq("tenant-a", "s1"))
    control(sched, replies, OpenSessionReq("tenant-a", "s2"))
    third = control(sched, replies, OpenSessionReq("tenant-a", "s3"))
    assert (third.success, third.status_code) == (False, 429)
    taken = control(sched, replies, OpenSessionReq("tenant-a", "s2"))
    assert taken.status_code == 409
    ctx1 = turn(sched, "a", prompt_of(1), session="s1")
    assert sched.sessions.pinned_tokens == 30  # the head of a 44-token context
    assert cached_len(sched, ctx1[:30]) == 30
    turn(sched, "b", prompt_of(2), session="s2")
    # 30 + 30 > 50: the least recently used session (s1) lost its pin but stays open
    assert sched.sessions.sessions[("tenant-a", "s1")].pin is None
    assert sched.sessions.sessions[("tenant-a", "s2")].pin.tokens == 30
    assert sched.sessions.pinned_tokens == sched.tree_cache.protected_size() == 30
    assert sched.get_internal_state()["session_pins_dropped_over_bound"] == 1
    turn(sched, "c", ctx1 + [7], session="s1")  # still open: its next turn pins again, s2 is dropped
    assert sched.sessions.sessions[("tenant-a", "s2")].pin is None
    assert sched.sessions.pinned_tokens == 30


def test_idle_timeout_releases_and_closes():
    sched, outputs, replies = setup(session_idle_timeout_s=5.0)
    now = [1000.0]
    sched.sessions.clock = lambda: now[0]
    control(sched, replies, OpenSessionReq("tenant-a", "s"))
    control(sched, replies, OpenSessionReq("tenant-a", "short", ttl_s=1.0))
    turn(sched, "a", prompt_of(1), session="s")
    assert sched.sessions.pinned_tokens == 43
    now[0] += 3.0
    sched.process_input_requests([])
    assert ("tenant-a", "short") not in sched.sessions.sessions and ("tenant-a", "s") in sched.sessions.sessions
    now[0] += 6.0
    sched.process_input_requests([])
    assert sched.sessions.sessions == {} and sched.tree_cache.protected_size() == 0
    assert sched.get_internal_state()["sessions_expired"] == 2
    turn(sched, "late", prompt_of(2), session="s")
    assert outputs["late"]["finish"]["status_code"] == 404
    assert "session_params.id" in outputs["late"]["finish"]["message"]
    conserve(sched)


def test_close_releases_at_once_and_sessions_are_per_owner():
    sched, outputs, replies = setup()
    sid = control(sched, replies, OpenSessionReq("tenant-a")).session_id
    assert sid
    turn(sched, "a", prompt_of(1), session=sid)
    assert sched.tree_cache.protected_size() == 43
    other = control(sched, replies, CloseSessionReq("tenant-b", sid))
    assert (other.success, other.status_code) == (False, 404)
    turn(sched, "b", prompt_of(2), session=sid, owner=OWNER_B)  # another tenant cannot use it
    assert outputs["b"]["finish"]["status_code"] == 404 and sid in outputs["b"]["finish"]["message"]
    assert sched.tree_cache.protected_size() == 43
    assert control(sched, replies, CloseSessionReq("tenant-a", sid)).success
    assert sched.tree_cache.protected_size() == 0 and sched.sessions.pinned_tokens == 0
    again = control(sched, replies, CloseSessionReq("tenant-a", sid))
    assert again.status_code == 404
    turn(sched, "c", prompt_of(3), session="never-opened")
    assert outputs["c"]["finish"]["status_code"] == 404
    conserve(sched)


def test_flush_cache_unpins_every_session_and_keeps_it_open():
    sched, outputs, replies = setup()
    control(sched, replies, OpenSessionReq("tenant-a", "s"))
    turn(sched, "a", prompt_of(1), session="s")
    sched.process_input_requests([FlushCacheReq()])
    assert outputs["__flush__"].success and outputs["__flush__"].tokens_freed >= 43
    assert sched.tree_cache.protected_size() == 0 and sched.tree_cache.evictable_size() == 0
    assert sched.sessions.pinned_tokens == 0 and ("tenant-a", "s") in sched.sessions.sessions
    conserve(sched)
    turn(sched, "b", prompt_of(1), session="s")
    assert sched.sessions.pinned_tokens == 43


def test_sessions_sharing_a_head_lock_it_twice_and_count_it_once_each():
    sched, _, replies = setup(pool=400)
    control(sched, replies, OpenSessionReq("tenant-a", "x"))
    control(sched, replies, OpenSessionReq("tenant-a", "y"))
    head = prompt_of(1, 30)
    turn(sched, "x1", head + prompt_of(2, 10), session="x")
    turn(sched, "y1", head + prompt_of(3, 10), session="y")
    assert sched.sessions.pinned_tokens == 86  # 43 each
    assert sched.tree_cache.protected_size() == 30 + 13 + 13  # the head once, then each branch
    control(sched, replies, CloseSessionReq("tenant-a", "x"))
    assert sched.tree_cache.protected_size() == 43  # the head stays locked by y
    conserve(sched)


def test_dropping_a_namespace_releases_the_pins_in_it():
    sched, _, replies = setup(pool=400)
    control(sched, replies, OpenSessionReq("tenant-a", "a"))
    control(sched, replies, OpenSessionReq("tenant-b", "b"))
    turn(sched, "a1", prompt_of(1), session="a")
    turn(sched, "b1", prompt_of(2), session="b", owner=OWNER_B)
    assert sched.sessions.pinned_tokens == 86
    freed = sched.kv_manager.drop_namespaces(lambda key: key == (OWNER_A,))  # as an adapter unload does
    assert freed == 43 and sched.sessions.pinned_tokens == 43 == sched.tree_cache.protected_size()
    assert ("tenant-a", "a") in sched.sessions.sessions
    conserve(sched)


@pytest.mark.parametrize("page_size", [4])
def test_paged_pool_pins_whole_pages(page_size):
    sched, _, replies = setup(pool=160, page_size=page_size)
    control(sched, replies, OpenSessionReq("tenant-a", "s"))
    turn(sched, "a", prompt_of(1, 42), session="s")  # 45 tokens with KV: 44 in whole pages
    assert sched.sessions.pinned_tokens == 44 == sched.tree_cache.protected_size()


# ---------------------------------------------------------------------------------- the endpoints, real server

def _as(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.slow
def test_session_endpoints_per_key_pin_and_release():
    server = tenant_server()
    one, two = _as(TENANT_KEYS[0]), _as(TENANT_KEYS[1])
    r = server.post("/open_session", headers=one, json={"session_id": "agent-1", "capacity_of_str_len": 1000})
    assert r.status_code == 200 and r.json() == "agent-1", r.text
    assert server.post("/open_session", headers=one, json={"session_id": "agent-1"}).status_code == 409
    made = server.post("/open_session", headers=one, json={"ttl_s": 30})
    assert made.status_code == 200 and made.json(), made.text
    bad = server.post("/open_session", headers=one, json={"ttl_s": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "ttl_s", bad.text
    missing = server.post("/close_session", headers=one, json={})
    assert missing.status_code == 400 and "session_id" in missing.text, missing.text
    # another key can neither close nor use it
    r = server.post("/close_session", headers=two, json={"session_id": "agent-1"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "session_id", r.text
    body = {"text": "You are a tool-using agent. Tools: search, read.", "session_params": {"id": "agent-1"},
            "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
    r = server.post("/generate", headers=two, json=body)
    assert r.status_code == 404 and r.json()["error"]["param"] == "session_params.id", r.text
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "session_id": "no-such-session"}
    r = server.post("/v1/chat/completions", headers=one, json=chat)
    assert r.status_code == 404 and r.json()["error"]["param"] == "session_id", r.text
    # its own key's request pins its context
    r = server.post("/generate", headers=one, json=body)
    assert r.status_code == 200, r.text
    state = wait_idle(server)
    assert state["open_sessions"] >= 2 and state["session_pinned_tokens"] > 0, state
    assert state["protected_tokens"] == state["session_pinned_tokens"]
    check_idle_conservation(server)
    r = server.post("/v1/chat/completions", headers=one, json={**chat, "session_id": "agent-1"})
    assert r.status_code == 200, r.text
    # close releases the pin at once; a second close is a 404
    assert server.post("/close_session", headers=one, json={"session_id": "agent-1"}).status_code == 200
    assert server.post("/close_session", headers=one, json={"session_id": "agent-1"}).status_code == 404
    assert server.post("/close_session", headers=one, json={"session_id": made.json()}).status_code == 200
    state = check_idle_conservation(server)
    assert state["session_pinned_tokens"] == 0 and state["protected_tokens"] == 0, state
    r = server.post("/generate", headers=one, json=body)
    assert r.status_code == 404 and r.json()["error"]["param"] == "session_params.id", r.text


def test_a_pin_on_a_hybrid_tree_holds_its_window_and_gives_it_back():
    from tests.test_hybrid_kv import HybridWorld, request, seq

    world = HybridWorld(window=8)
    a = request(list(range(100, 130)))
    world.admit([a])
    world.prefill_done(a, 1)
    world.finish(a)
    context = seq(a)[:30]
    pin = world.kv.pin_prefix(context, a.extra_key, 1000)
    assert pin is not None and pin.tokens == 30 == world.cache.protected_size()
    report = check_conservation(world.alloc, world.cache, world.pool, [], [pin.node])
    assert report["window_protected"] > 0
    world.kv.unpin(pin)
    report = check_conservation(world.alloc, world.cache, world.pool, [], [])
    assert report["protected"] == report["window_protected"] == 0
