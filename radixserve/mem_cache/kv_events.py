"""KV events for cache-aware routing: what the radix tree stored and removed, published as SGLang and vLLM do.

`--kv-events-config '{"publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv"}'` (SGLang's flag and JSON
fields) turns it on. The tree calls a `KVEventSink` at three points (radix_cache.py: after an insert added tokens,
for each node an eviction or a namespace drop removes, at reset); the sink only queues references, and a daemon
thread hashes, encodes and sends, so the scheduler thread pays a queue put per operation.

Wire format (SGLang's / vLLM's `KVEventBatch`): a ZMQ PUB multipart message `[topic, seq, payload]`, `seq` an
8-byte big-endian counter from 0, `payload` msgpack of the array `[ts, [event, ...]]` where an event is a tagged
array (msgspec's `array_like=True, tag=True` layout):

    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]
    ["BlockRemoved", block_hashes, medium]
    ["AllBlocksCleared"]

A block is `block_size` (= the pool's page size) consecutive tokens of a path of the tree, aligned from the
root. Block i's hash chains: `h_i = blake2b-64(h_{i-1} (8 bytes, big-endian) + tokens (int64 little-endian))`
masked to 63 bits, with h_{-1} = blake2b-64 of the namespace's encoding (storage/keys.namespace_bytes: None ->
b"N"), so equal tokens in different namespaces (tenants, LoRA adapters) never share a hash. `parent_block_hash`
is h_{i-1} of the first block (None for block 0), `lora_id` is None (the namespace is in the hash), `medium`
is "GPU" for the device pool (the name routers expect for the pool attention reads). A block is stored when
the tree first holds all its tokens and removed when it stops holding them; a split moves no block.

With `--enable-hierarchical-cache` the controller (hicache.py) also announces the pages it copies into its tiers:
the same blocks (same hashes) with medium "CPU" (the host tier) or "STORAGE" (the backend), and their removal when
the host bound or the file store's size cap drops a page (a page this process did not announce, such as one written
before a restart or evicted by Redis itself, is not reported).
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import queue
import threading
import time
from array import array
from collections import deque
from dataclasses import dataclass, fields
from typing import Any

from radixserve.mem_cache.radix_key import common_prefix_len

logger = logging.getLogger(__name__)

DEVICE_MEDIUM = "GPU"  # NOTE: vLLM's and SGLang's name for the pool attention reads (here: the device KV pool)
HOST_MEDIUM = "CPU"  # the hierarchical cache's host tier (vLLM's name for CPU offload)
STORAGE_MEDIUM = "STORAGE"  # its storage backend (file or redis)
PUBLISHERS = ("null", "zmq")
_MASK = (1 << 63) - 1  # NOTE: hashes fit both int64 and uint64 consumers


@dataclass(frozen=True)
class KVEventsConfig:
    """`--kv-events-config` (SGLang's JSON fields): `publisher` "null" (off) or "zmq"; `endpoint` the PUB address
    (bound when it has `*`, `::`, or is ipc:// or inproc://, else connected, as SGLang does); `replay_endpoint`
    a ROUTER address serving past batches from `buffer_steps` kept; `hwm` the PUB high-water mark;
    `max_queue_size` operations queued before new ones are dropped (counted); `topic` the first frame."""

    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @classmethod
    def from_json(cls, text: str | None) -> KVEventsConfig | None:
        """The config in `text`, None for none; ValueError naming `kv_events_config` (and the field) otherwise."""
        if not text:
            return None
        try:
            raw = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"kv_events_config is not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError("kv_events_config must be a JSON object such as {\"publisher\": \"zmq\"}")
        known = {f.name: f for f in fields(cls)}
        for name, value in raw.items():
            if name not in known:
                raise ValueError(f"kv_events_config.{name} is not a field (fields: {', '.join(known)})")
            want = int if name in ("buffer_steps", "hwm", "max_queue_size") else str
            if not (value is None and name == "replay_endpoint") and (
                    not isinstance(value, want) or isinstance(value, bool)):
                kind = "an integer" if want is int else "a string"
                raise ValueError(f"kv_events_config.{name} must be {kind}, got {value!r}")
            if want is int and value <= 0:
                raise ValueError(f"kv_events_config.{name} must be positive, got {value}")
        config = cls(**raw)
        if config.publisher not in PUBLISHERS:
            raise ValueError(f"kv_events_config.publisher={config.publisher!r} is not one of {', '.join(PUBLISHERS)}")
        if config.publisher == "zmq" and "://" not in config.endpoint:
            raise ValueError(f"kv_events_config.endpoint={config.endpoint!r} is not a ZMQ address (tcp://host:port)")
        return config

    def for_rank(self, rank: int) -> KVEventsConfig:
        """Worker `rank`'s config under `serve --dp`: tcp ports offset by the rank (SGLang's rule)."""
        if rank == 0:
            return self
        from dataclasses import replace

        return replace(self, endpoint=_offset(self.endpoint, rank), replay_endpoint=_offset(self.replay_endpoint, rank))


def rank_config_json(text: str | None, rank: int) -> str | None:
    """`--kv-events-config` for worker `rank` of `serve --dp` (ports offset by the rank), as JSON; None stays."""
    config = KVEventsConfig.from_json(text)
    if config is None:
        return text
    from dataclasses import asdict

    return json.dumps(asdict(config.for_rank(rank)))


def _offset(endpoint: str | None, rank: int) -> str | None:
    if not endpoint or not endpoint.startswith("tcp://"):
        return endpoint if not endpoint or "inproc" not in endpoint else f"{endpoint}_dp{rank}"
    base, _, port = endpoint.rpartition(":")
    return f"{base}:{int(port) + rank}"


# ---- block hashes ---------------------------------------------------------------------------------------------
def block_hashes(packed: bytes, extra_key: Any, block_size: int, stop: int, known: list[int] = ()) -> list[int]:
    """h_0 .. h_{stop-1} of the path whose tokens are `packed` (int64 little-endian, RadixKey.packed); `known`: the
    first hashes, already computed (the chain continues from them)."""
    from radixserve.mem_cache.storage.keys import namespace_bytes

    out, width = list(known[:stop]), block_size * 8
    h = out[-1] if out else int.from_bytes(hashlib.blake2b(namespace_bytes(extra_key), digest_size=8).digest(),
                                           "big") & _MASK
    for i in range(len(out), stop):
        digest = hashlib.blake2b(h.to_bytes(8, "big") + packed[i * width:(i + 1) * width], digest_size=8).digest()
        h = int.from_bytes(digest, "big") & _MASK
        out.append(h)
    return out


def _tokens(packed: bytes) -> list[int]:
    values = array("q")
    values.frombytes(packed)
    return values.tolist()


class BlockEncoder:
    """Turns queued operations into events, on the publisher thread. Keeps, per (medium, page key) of the host and
    storage tiers, the hashes of the blocks a stored page announced, so its removal can name them.

    Operations: ("stored", packed, extra_key, pos, end) and ("removed", packed, extra_key, start, end) of the device
    tree (tokens [pos, end) of a path were added / left); ("tier_stored", medium, keys, packed, extra_key, pages,
    page_tokens) (pages `pages` of the path, under `keys`, were copied to a tier); ("tier_removed", medium, key);
    ("cleared",)."""

    def __init__(self, block_size: int, max_pages: int = 1 << 20) -> None:
        self.block_size, self.max_pages = block_size, max_pages
        self._pages: dict[tuple[str, str], list[int]] = {}
        self._memo: tuple[bytes, Any, list[int]] = (b"", None, [])  # the last path's chain (pages come in runs)

    def _hashes(self, packed: bytes, extra_key: Any, stop: int) -> list[int]:
        """block_hashes of the path, continuing the last path's chain over the blocks the two share (a long prompt's
        pages each ask for it; prompts that share a system prompt share its blocks)."""
        last, key, chain = self._memo
        shared = common_prefix_len(last, packed, 0) // self.block_size if key == extra_key else 0
        chain = block_hashes(packed, extra_key, self.block_size, len(packed) // (8 * self.block_size),
                             chain[:shared])
        self._memo = (packed, extra_key, chain)
        return chain[:stop]

    def encode(self, ops: list[tuple]) -> list[list[Any]]:
        events: list[list[Any]] = []
        for op in ops:
            kind = op[0]
            if kind == "cleared":
                events.append(["AllBlocksCleared"])
            elif kind == "tier_stored":
                events += self._tier_stored(*op[1:])
            elif kind == "tier_removed":
                hashes = self._pages.pop((op[1], op[2]), None)
                if hashes:
                    events.append(["BlockRemoved", hashes, op[1]])
            else:
                events += self._device(*op)
        return events

    def _device(self, kind: str, packed: bytes, extra_key: Any, start: int, end: int) -> list[list[Any]]:
        size = self.block_size
        first, stop = start // size, end // size
        if first >= stop:
            return []
        hashes = self._hashes(packed, extra_key, stop)
        if kind == "removed":
            return [["BlockRemoved", hashes[first:], DEVICE_MEDIUM]]
        return [["BlockStored", hashes[first:], hashes[first - 1] if first else None,
                 _tokens(packed[first * size * 8:stop * size * 8]), size, None, DEVICE_MEDIUM]]

    def _tier_stored(self, medium: str, keys: list[str], packed: bytes, extra_key: Any, pages: list[int],
                     page_tokens: int) -> list[list[Any]]:
        """One BlockStored per run of consecutive pages (a page is page_tokens // block_size blocks)."""
        size, per = self.block_size, page_tokens // self.block_size
        hashes = self._hashes(packed, extra_key, (max(pages) + 1) * per)
        events, run = [], []
        for n, (key, page) in enumerate(zip(keys, pages, strict=True)):
            if len(self._pages) < self.max_pages:
                self._pages[(medium, key)] = hashes[page * per:(page + 1) * per]
            run.append(page)
            if n + 1 < len(pages) and pages[n + 1] == page + 1:
                continue
            first, stop = run[0] * per, (run[-1] + 1) * per
            events.append(["BlockStored", hashes[first:stop], hashes[first - 1] if first else None,
                           _tokens(packed[first * size * 8:stop * size * 8]), size, None, medium])
            run = []
        return events


def encode_ops(ops: list[tuple], block_size: int) -> list[list[Any]]:
    """The events of `ops` with no remembered tier pages (BlockEncoder, stateless use)."""
    return BlockEncoder(block_size).encode(ops)


# ---- the tree's sink --------------------------------------------------------------------------------------------
class KVEventSink:
    """What the tree calls (radix_cache.py). Queues references to immutable keys; never blocks, never raises."""

    def __init__(self, publisher: ZmqEventPublisher | None, max_queue_size: int = 100_000) -> None:
        self.publisher = publisher
        self._ops: queue.Queue = queue.Queue(maxsize=max_queue_size)
        self.dropped = 0  # operations not queued: the publisher fell behind by max_queue_size

    def _put(self, op: tuple) -> None:
        try:
            self._ops.put_nowait(op)
        except queue.Full:
            if not self.dropped:
                logger.warning("kv events: the publisher is %d operations behind; dropping events (a router's view "
                               "of this server's cache is now stale until the next AllBlocksCleared)",
                               self._ops.maxsize)
            self.dropped += 1

    def stored(self, packed: bytes, extra_key: Any, pos: int, end: int) -> None:
        """An insert of the path `packed` added tokens [pos, end) (the tree already held [0, pos))."""
        self._put(("stored", packed, extra_key, pos, end))

    def removed(self, node: Any) -> None:
        """`node` (still linked to its parents) is leaving the tree with every node below it: the blocks that end
        inside its tokens are removed (the ones below it are reported by their own nodes)."""
        extra_key, own, path = node.key.extra_key, len(node.key.packed) // 8, []
        while node is not None and node.parent is not None:
            path.append(node.key.packed)
            node = node.parent
        path.reverse()
        packed = b"".join(path)
        end = len(packed) // 8
        self._put(("removed", packed, extra_key, end - own, end))

    def cleared(self) -> None:
        self._put(("cleared",))

    def tier_stored(self, medium: str, keys: list[str], packed: bytes, extra_key: Any, pages: list[int],
                    page_tokens: int) -> None:
        """Pages `pages` (ascending) of the path `packed`, under page keys `keys`, were copied into tier `medium`."""
        self._put(("tier_stored", medium, list(keys), packed, extra_key, list(pages), page_tokens))

    def tier_removed(self, medium: str, key: str) -> None:
        """Tier `medium` dropped the page under `key` (its blocks are removed if this process announced them)."""
        self._put(("tier_removed", medium, key))

    def take(self, timeout: float) -> list[tuple]:
        """Queued operations: waits up to `timeout` for the first, then takes what is there."""
        try:
            ops = [self._ops.get(timeout=timeout)]
        except queue.Empty:
            return []
        while True:
            try:
                ops.append(self._ops.get_nowait())
            except queue.Empty:
                return ops


class ZmqEventPublisher:
    """A daemon thread that turns queued operations into `KVEventBatch`es on a ZMQ PUB socket (and answers replay
    requests on a ROUTER socket when configured). NOTE: the sockets are used by this thread only."""

    END_SEQ = (-1).to_bytes(8, "big", signed=True)

    def __init__(self, config: KVEventsConfig, block_size: int) -> None:
        import msgpack
        import zmq

        self.config, self.block_size, self._pack = config, block_size, msgpack.packb
        self.sink = KVEventSink(self, config.max_queue_size)
        self._ctx = zmq.Context()  # NOTE: its own: a context made before a fork (the parent's instance) is unusable
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        endpoint, self._replay = config.endpoint, None
        try:
            if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
                self._pub.bind(endpoint)
            else:
                self._pub.connect(endpoint)
        except zmq.ZMQError as exc:  # NOTE: a start-up error naming the field, not a traceback
            self._pub.close(linger=0)
            raise ValueError(f"kv_events_config.endpoint={endpoint!r}: {exc}") from None
        if config.replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            try:
                self._replay.bind(config.replay_endpoint)
            except zmq.ZMQError as exc:
                self._pub.close(linger=0)
                self._replay.close(linger=0)
                raise ValueError(f"kv_events_config.replay_endpoint={config.replay_endpoint!r}: {exc}") from None
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._encoder = BlockEncoder(block_size)  # NOTE: used by the publisher thread only
        self.seq = 0  # batches sent
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        atexit.register(self.shutdown)

    def _run(self) -> None:
        topic = self.config.topic.encode()
        while self._running or not self.sink._ops.empty():
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            ops = self.sink.take(0.05)
            if not ops:
                continue
            try:
                events = self._encoder.encode(ops)
                if not events:
                    continue
                payload = self._pack([time.time(), events])
                self._pub.send_multipart((topic, self.seq.to_bytes(8, "big"), payload))
                self._buffer.append((self.seq, payload))
                self.seq += 1
            except Exception:  # NOTE: events are best effort: a failure is logged, the server goes on
                logger.exception("kv events: a batch could not be published")
                time.sleep(0.1)

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", self.END_SEQ, b""))

    def shutdown(self, timeout: float = 1.0) -> None:
        """Send what is queued (up to `timeout`), then close the sockets."""
        if not self._running:
            return
        self._running = False
        self._thread.join(timeout)
        self._pub.close(linger=int(timeout * 1000))
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()  # NOTE: ours alone (every socket of it is closed): returns once the linger is spent


def make_kv_events(server_args: Any, tree: Any) -> KVEventSink | None:
    """The tree's sink for `--kv-events-config`, or None (no flag, or publisher "null"). Raises ValueError for a
    tree whose blocks it cannot describe (a hybrid sliding-window pool, EAGLE's bigram keys, no radix cache)."""
    config = KVEventsConfig.from_json(getattr(server_args, "kv_events_config", None))
    if config is None or config.publisher == "null":
        return None
    if tree.disable or tree.is_eagle or tree.sliding_window is not None:
        raise ValueError("--kv-events-config needs the radix cache of a model without sliding-window layers on the "
                         "hybrid pool and without EAGLE's bigram keys")
    publisher = ZmqEventPublisher(config, tree.page_size)
    logger.info("kv events: publishing to %s (topic %r, %d-token blocks)", config.endpoint, config.topic,
                tree.page_size)
    return publisher.sink
