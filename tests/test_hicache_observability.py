"""What the hierarchical cache shows from outside, on one real server with the file storage tier and KV events on:
the per-tier split of cached tokens in every API's usage (a prefix computed, the device tree flushed, asked again:
storage hits that sum to cached_tokens), the tiers in /cache/tree, and the ZMQ KV events a cache-aware router
would subscribe to (stored for a request's pages, removed on eviction, cleared on /flush_cache)."""

from __future__ import annotations

import hashlib
import json
import time
from array import array

import httpx
import msgpack
import pytest
import zmq
from server_harness import check_idle_conservation, free_port, start_server

from radixserve.mem_cache.kv_events import KVEventsConfig
from radixserve.server_args import ServerArgs

MODEL = "SmolLM2-135M-Instruct"
TOPIC = b"kv-test"
BLOCK = 16  # --page-size: one event block per page
STORAGE_PAGE = 32  # the storage page at page size 16
QUESTION = "Tell me about " + " ".join(f"item{i}" for i in range(30)) + "."  # ~100 tokens: 3 storage pages
PROMPT_IDS = 100  # tokens of each /generate input_ids prompt of the KV events test (6 whole blocks)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    port = free_port()
    sub.bind(f"tcp://127.0.0.1:{port}")  # NOTE: a tcp://host:port endpoint is connected to, as in SGLang
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
    config = json.dumps({"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{port}", "topic": TOPIC.decode()})
    server = start_server("--dtype", "float32", "--max-total-tokens", "256", "--page-size", str(BLOCK),
                          "--enable-hierarchical-cache", "--hicache-storage-dir",
                          str(tmp_path_factory.mktemp("hicache")), "--hicache-storage-size", "1GiB",
                          "--kv-events-config", config)
    for _ in range(20):  # NOTE: a bound SUB takes in the server's connection (and subscribes it) only when used
        sub.poll(50)
    try:
        yield server, sub
    finally:
        server.stop()
        sub.close(linger=0)


def _post(server, path: str, body: dict) -> httpx.Response:
    r = httpx.post(server.base_url + path, json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r


def _flush(server) -> None:
    check_idle_conservation(server)
    assert httpx.post(server.base_url + "/flush_cache", timeout=60).status_code == 200


def _stream_json(r: httpx.Response) -> list[dict]:
    return [json.loads(line[5:]) for line in r.text.splitlines() if line.startswith("data:") and line[5:].strip()
            not in ("[DONE]",)]


def _usage_of(kind: str, server, stream: bool) -> tuple[int, dict | None]:
    """One request of API `kind` with QUESTION; its cached tokens and their split by tier."""
    chat = [{"role": "user", "content": QUESTION}]
    if kind == "generate":
        r = _post(server, "/generate", {"text": QUESTION, "sampling_params": {"max_new_tokens": 2,
                                                                                "temperature": 0}, "stream": stream})
        meta = (_stream_json(r)[-1] if stream else r.json())["meta_info"]
        return meta["cached_tokens"], meta.get("cached_tokens_details")
    if kind in ("chat", "completions"):
        body = {"model": MODEL, "max_tokens": 2, "temperature": 0, "stream": stream,
                **({"messages": chat} if kind == "chat" else {"prompt": QUESTION})}
        if stream:
            body["stream_options"] = {"include_usage": True}
        r = _post(server, "/v1/chat/completions" if kind == "chat" else "/v1/completions", body)
        usage = (_stream_json(r)[-1] if stream else r.json())["usage"]["prompt_tokens_details"]
        return usage["cached_tokens"], usage.get("cached_tokens_details")
    if kind == "responses":
        r = _post(server, "/v1/responses", {"model": MODEL, "input": QUESTION, "max_output_tokens": 2,
                                            "temperature": 0, "stream": stream})
        body = [e for e in _stream_json(r) if e.get("type") in ("response.completed", "response.incomplete")][0]["response"] if stream \
            else r.json()
        details = body["usage"]["input_tokens_details"]
        return details["cached_tokens"], details.get("cached_tokens_details")
    r = _post(server, "/v1/messages", {"model": MODEL, "max_tokens": 2, "messages": chat, "stream": stream})
    usage = [e for e in _stream_json(r) if e.get("type") == "message_delta"][0]["usage"] if stream \
        else r.json()["usage"]
    return usage["cache_read_input_tokens"], usage.get("cached_tokens_details")


@pytest.mark.parametrize("kind", ["generate", *(pytest.param(k, marks=pytest.mark.long)
                                             for k in ("chat", "completions", "responses", "messages"))])
def test_usage_splits_cached_tokens_by_tier(served, kind):
    server, _ = served
    cached, details = _usage_of(kind, server, stream=False)  # computed (or already on disk from another API)
    assert details is not None and sum(details.values()) == cached
    _flush(server)  # NOTE: the device tree is empty now; the pages are still on disk
    cached, details = _usage_of(kind, server, stream=True)
    assert cached > 0 and cached % STORAGE_PAGE == 0, (kind, cached)
    assert details == {"device": 0, "host": 0, "storage": cached}, (kind, details)
    cached, details = _usage_of(kind, server, stream=False)  # the same again: the tree has it now
    assert cached > 0 and details == {"device": cached, "host": 0, "storage": 0}, (kind, details)
    check_idle_conservation(server)


def test_cache_tree_shows_the_tiers(served, capsys):
    from radixserve.cli import main as cli_main

    server, _ = served
    _usage_of("generate", server, stream=False)
    _flush(server)
    _usage_of("generate", server, stream=False)  # NOTE: loaded from disk: storage hits
    check_idle_conservation(server)
    snapshot = httpx.get(server.base_url + "/cache/tree", timeout=60).json()
    tiers, pool = snapshot["tiers"], snapshot["pool"]
    assert tiers["hierarchical"] and tiers["host"] is None
    assert tiers["device"] == {"tokens": pool["size"], "cached": pool["evictable"] + pool["protected"],
                               "free": pool["available"]}
    assert tiers["device"]["cached"] > 0
    storage = tiers["storage"]
    assert storage["backend"] == "file" and storage["enabled"] and storage["capacity_bytes"] == 1 << 30
    assert storage["pages"] > 0 and storage["bytes"] >= storage["pages"] * tiers["page_bytes"]
    assert storage["hits"] > 0 and storage["loaded_tokens"] > 0 and storage["pages_written"] >= storage["pages"]
    assert tiers["page_tokens"] == STORAGE_PAGE and tiers["loaded_tokens"] == storage["loaded_tokens"]
    metrics = server.metrics()
    assert metrics["radixserve:hicache_storage_loaded_tokens_total"] == storage["loaded_tokens"]
    cli_main(["cache", "--base-url", server.base_url, "--events", "0"])  # `radixserve cache` prints the tiers
    out = capsys.readouterr().out
    assert "host tier: none" in out and f"storage tier (file): {storage['pages']} pages" in out


# ---------------------------------------------------------------------------------------------- KV events
def _drain(sub, quiet_s: float = 0.8) -> list[list]:
    """Every event received until none came for `quiet_s` (checks the frames and the sequence numbers)."""
    events, deadline = [], time.monotonic() + quiet_s
    while time.monotonic() < deadline:
        if sub.poll(50):
            topic, seq, payload = sub.recv_multipart()
            assert topic == TOPIC and len(seq) == 8
            ts, batch = msgpack.unpackb(payload)
            assert isinstance(ts, float) and batch
            events += batch
            deadline = time.monotonic() + quiet_s
    return events


def _generate_ids(server, ids: list[int]) -> None:
    _post(server, "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}})


def _chained(events: list[list], prompt: list[int], medium: str = "GPU") -> list[int]:
    """The hashes of `prompt`'s whole blocks, followed through the BlockStored events of `medium` from a root block
    (parent None); checks each hash is blake2b-64 of its parent and its tokens."""
    by_parent = {}
    for _, hashes, parent, tokens, size, lora, where in (e for e in events if e[0] == "BlockStored"):
        if where != medium:
            continue
        assert size == BLOCK and lora is None and len(tokens) == size * len(hashes)
        for i, h in enumerate(hashes):
            by_parent.setdefault(parent, []).append((h, tokens[i * size:(i + 1) * size]))
            parent = h
    chain, parent = [], None
    for start in range(0, len(prompt) // BLOCK * BLOCK, BLOCK):
        block = prompt[start:start + BLOCK]
        found = [h for h, tokens in by_parent.get(parent, []) if tokens == block]
        if not found:
            break
        h = found[0]
        if parent is not None:
            digest = hashlib.blake2b(parent.to_bytes(8, "big") + array("q", block).tobytes(), digest_size=8)
            assert h == int.from_bytes(digest.digest(), "big") & ((1 << 63) - 1)
        chain.append(h)
        parent = h
    return chain


def test_kv_events_stored_removed_cleared(served):
    server, sub = served
    _flush(server)
    assert ["AllBlocksCleared"] in _drain(sub)
    prompts = [[1000 + 7 * p + i for i in range(PROMPT_IDS)] for p in range(3)]  # distinct from the first token
    _generate_ids(server, prompts[0])
    stored = _drain(sub)
    first = _chained(stored, prompts[0])
    assert len(first) == PROMPT_IDS // BLOCK, stored  # every whole block of the prompt
    # NOTE: write_through copied its whole 32-token storage pages to disk: the same blocks, medium STORAGE
    assert _chained(stored, prompts[0], "STORAGE") == first[:PROMPT_IDS // STORAGE_PAGE * STORAGE_PAGE // BLOCK]
    _generate_ids(server, prompts[1])
    _generate_ids(server, prompts[2])  # NOTE: 3 x 96 cached tokens in a 256-token pool: the oldest is evicted
    events = _drain(sub)
    removed = {h for e in events if e[0] == "BlockRemoved" for h in e[1]}
    assert all(e[-1] == "GPU" for e in events if e[0] == "BlockRemoved")  # NOTE: the disk keeps them (1 GiB)
    assert set(first) <= removed, (first, removed)
    later = [_chained(events, p) for p in prompts[1:]]
    assert all(len(chain) == PROMPT_IDS // BLOCK for chain in later)
    check_idle_conservation(server)
    _flush(server)
    events = _drain(sub)
    assert events[-1] == ["AllBlocksCleared"]
    assert set(later[1]) <= {h for e in events if e[0] == "BlockRemoved" for h in e[1]}


def test_kv_events_config_is_checked_naming_the_field():
    assert KVEventsConfig.from_json(None) is None
    for bad, field in (('{"publisher": "kafka"}', "kv_events_config.publisher"), ("{", "kv_events_config"),
                       ('{"topic": 5}', "kv_events_config.topic"), ('{"hwm": 0}', "kv_events_config.hwm"),
                       ('{"port": 1}', "kv_events_config.port"), ('{"publisher": "zmq", "endpoint": "x"}',
                                                                  "kv_events_config.endpoint")):
        with pytest.raises(ValueError, match=field.replace(".", r"\.")):
            ServerArgs(kv_events_config=bad)
    ranked = json.loads(__import__("radixserve.mem_cache.kv_events", fromlist=["x"]).rank_config_json(
        '{"publisher": "zmq", "endpoint": "tcp://*:5557"}', 2))
    assert ranked["endpoint"] == "tcp://*:5559"


def test_kv_event_blocks_follow_the_tree_without_a_server():
    """Blocks are page-aligned from the root: a split moves none, an eviction removes the leaf's, a namespace is
    in every hash, a dropped namespace removes its blocks, a reset clears (no model, no sockets)."""
    from radixserve.mem_cache.kv_events import KVEventSink, block_hashes, encode_ops
    from radixserve.mem_cache.radix_cache import RadixCache
    from radixserve.mem_cache.radix_key import RadixKey

    tree, sink = RadixCache(page_size=4), KVEventSink(None)
    tree.kv_events = sink

    def events() -> list[list]:
        return encode_ops(sink.take(0.01), 4)

    a, b = list(range(12)), list(range(8)) + [90, 91, 92, 93]
    tree.insert(RadixKey(a))
    (stored,) = events()
    hashes = block_hashes(array("q", a).tobytes(), None, 4, 3)
    assert stored == ["BlockStored", hashes, None, a, 4, None, "GPU"]
    tree.insert(RadixKey(b))  # NOTE: splits a's node after 8 tokens; only b's last block is new
    (stored,) = events()
    assert stored[1] == block_hashes(array("q", b).tobytes(), None, 4, 3)[2:] and stored[2] == hashes[1]
    assert stored[3] == [90, 91, 92, 93]
    tree.insert(RadixKey(a, extra_key="tenant"))
    (other,) = events()
    assert other[2] is None and not set(other[1]) & set(hashes)  # same tokens, another namespace
    tree.evict(4)  # the least recently used leaf: a's last block
    assert events() == [["BlockRemoved", hashes[2:], "GPU"]]
    tree.drop_namespaces(lambda key: key == "tenant")
    assert events() == [["BlockRemoved", other[1], "GPU"]]
    tree.reset()
    assert events() == [["AllBlocksCleared"]]


@pytest.mark.long
def test_the_page_shows_the_tiers(served):
    """/cache/view in a real headless Chromium draws the storage tier's pages and counters (no console errors)."""
    import shutil

    pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
    executable = shutil.which("chromium") or shutil.which("chromium-browser")
    if executable is None:
        pytest.skip("no Chromium on this machine (apt-get install -y chromium; .ci/run installs it)")
    from playwright.sync_api import sync_playwright

    server, _ = served
    _usage_of("generate", server, stream=False)
    errors: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=executable, args=["--headless", "--no-sandbox", "--disable-gpu"])
        page = browser.new_page()
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(server.base_url + "/cache/view?interval=200")
        storage = page.wait_for_selector("#tiers tr[data-tier=storage]").inner_text()
        assert "storage (file)" in storage and " pages, " in storage and "of 1.0 GiB" in storage, storage
        assert "hits " in storage and "loaded " in storage
        assert "none" in page.inner_text("#tiers tr[data-tier=host]")
        browser.close()
    assert not errors, errors
    check_idle_conservation(server)


def test_a_replay_request_gets_the_kept_batches():
    """replay_endpoint: a DEALER client sending a batch number gets every kept batch from it on, then seq -1."""
    from radixserve.mem_cache.kv_events import ZmqEventPublisher
    from radixserve.mem_cache.radix_cache import RadixCache
    from radixserve.mem_cache.radix_key import RadixKey

    pub_port, replay_port = free_port(), free_port()
    publisher = ZmqEventPublisher(KVEventsConfig(publisher="zmq", endpoint=f"tcp://127.0.0.1:{pub_port}",
                                                 replay_endpoint=f"tcp://127.0.0.1:{replay_port}", buffer_steps=2), 4)
    tree = RadixCache(page_size=4)
    tree.kv_events = publisher.sink
    try:
        for first in (10, 20, 30):  # NOTE: one batch each (waited for), of which the last 2 are kept
            tree.insert(RadixKey(list(range(first, first + 8))))
            deadline = time.monotonic() + 5
            while publisher.seq < (first - 10) // 10 + 1 and time.monotonic() < deadline:
                time.sleep(0.01)
        assert publisher.seq == 3
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])  # NOTE: the empty frame a REQ socket would add
        replies = []
        while True:
            assert dealer.poll(5000)
            empty, seq, payload = dealer.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                assert empty == payload == b""
                break
            replies.append((int.from_bytes(seq, "big"), msgpack.unpackb(payload)[1][0][3]))
        assert replies == [(1, list(range(20, 28))), (2, list(range(30, 38)))]
        dealer.close(linger=0)
    finally:
        publisher.shutdown()


def test_tier_pages_are_announced_and_their_removal_names_their_blocks():
    """Host and storage pages: BlockStored per run of consecutive pages (medium CPU / STORAGE), and a dropped page's
    BlockRemoved names the blocks its BlockStored announced; the host tier tells which page its bound drops."""
    import torch

    from radixserve.mem_cache.host_tier import HostKVTier
    from radixserve.mem_cache.kv_events import BlockEncoder, KVEventSink, block_hashes

    sink, encoder = KVEventSink(None), BlockEncoder(4)
    tokens = list(range(100, 124))  # 3 pages of 8 tokens, 2 blocks of 4 each
    packed = array("q", tokens).tobytes()
    hashes = block_hashes(packed, "ns", 4, 6)
    sink.tier_stored("CPU", ["k0", "k2"], packed, "ns", [0, 2], 8)  # NOTE: two runs: page 0, page 2
    sink.tier_removed("CPU", "k2")
    sink.tier_removed("CPU", "k1")  # never announced: no event
    sink.tier_removed("STORAGE", "k0")  # announced in another medium only: no event
    assert encoder.encode(sink.take(0.01)) == [
        ["BlockStored", hashes[0:2], None, tokens[0:8], 4, None, "CPU"],
        ["BlockStored", hashes[4:6], hashes[3], tokens[16:24], 4, None, "CPU"],
        ["BlockRemoved", hashes[4:6], "CPU"]]
    host, dropped = HostKVTier(2 * 64 * 4, torch.float32), []
    host.on_evict = dropped.append
    for key in ("a", "b", "c"):
        host.put(key, torch.zeros(64))
    assert dropped == ["a"] and len(host) == 2


def test_an_endpoint_in_use_is_an_error_naming_the_field():
    from radixserve.mem_cache.kv_events import ZmqEventPublisher

    busy = zmq.Context.instance().socket(zmq.PUB)
    port = busy.bind_to_random_port("tcp://127.0.0.1")
    try:
        with pytest.raises(ValueError, match=rf"kv_events_config\.endpoint='tcp://\*:{port}'"):
            ZmqEventPublisher(KVEventsConfig(publisher="zmq", endpoint=f"tcp://*:{port}"), 16)
        with pytest.raises(ValueError, match=r"kv_events_config\.replay_endpoint"):
            ZmqEventPublisher(KVEventsConfig(publisher="zmq", endpoint=f"tcp://127.0.0.1:{free_port()}",
                                             replay_endpoint=f"tcp://127.0.0.1:{port}"), 16)
    finally:
        busy.close(linger=0)
