"""What KV events (--kv-events-config) cost: on the scheduler thread (the tree's inserts and evictions with the
sink attached vs without) and on the publisher thread (hashing and encoding blocks, then publishing over ZMQ to a
subscriber on loopback). No model: a `RadixCache` over a real allocator, agent-like prompts that share a system
prompt and differ after it, inserted, matched and evicted as the scheduler would.

    python benchmarks/bench_kv_events.py [--prompts 64] [--prompt-tokens 2048] [--shared 1024] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from radixserve.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator  # noqa: E402
from radixserve.mem_cache.kv_events import BlockEncoder, KVEventsConfig, KVEventSink, ZmqEventPublisher  # noqa: E402
from radixserve.mem_cache.radix_cache import RadixCache  # noqa: E402
from radixserve.mem_cache.radix_key import RadixKey  # noqa: E402


def prompts(n: int, length: int, shared: int) -> list[list[int]]:
    head = [(i * 7919) % 40000 + 100 for i in range(shared)]
    return [head + [(p * 104729 + i * 31) % 40000 + 100 for i in range(length - shared)] for p in range(n)]


def tree_pass(page_size: int, work: list[list[int]], sink: KVEventSink | None) -> float:
    """Insert every prompt (with slots), match it, then evict the whole tree: the seconds the tree ops took."""
    size = sum(len(p) for p in work) + 2 * page_size
    alloc = (TokenToKVPoolAllocator(size, "cpu") if page_size == 1 else
             PagedTokenToKVPoolAllocator(size, page_size, "cpu"))
    tree = RadixCache(None, alloc, page_size)
    tree.kv_events = sink
    slots = [alloc.alloc(len(p) // page_size * page_size) for p in work]
    start = time.perf_counter()
    for p, s in zip(work, slots, strict=True):
        prefix = tree.insert(RadixKey(p), s)
        alloc.free(s[:prefix])  # NOTE: the duplicates of what the tree held, as the KV manager frees them
        tree.match_prefix(RadixKey(p))
    tree.evict(tree.evictable_size())
    return time.perf_counter() - start


def publish_pass(page_size: int, ops: list[tuple], port: int) -> tuple[float, int]:
    """Queue `ops` on a real publisher and wait until a loopback subscriber has every batch: (seconds, events)."""
    import msgpack
    import zmq

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind(f"tcp://127.0.0.1:{port}")
    publisher = ZmqEventPublisher(KVEventsConfig(publisher="zmq", endpoint=f"tcp://127.0.0.1:{port}"), page_size)
    for _ in range(20):  # NOTE: a bound SUB attaches the publisher's connection only when used
        sub.poll(25)
    got = [0]

    def receive() -> None:
        while sub.poll(1000):
            got[0] += len(msgpack.unpackb(sub.recv_multipart()[2])[1])

    start = time.perf_counter()
    reader = threading.Thread(target=receive)
    reader.start()
    for op in ops:
        publisher.sink._put(op)
    while publisher.sink._ops.qsize():
        time.sleep(0.001)
    reader.join()
    elapsed = time.perf_counter() - start - 1.0  # NOTE: the reader's last poll waits 1 s for nothing
    publisher.shutdown()
    sub.close(linger=0)
    ctx.term()
    return elapsed, got[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--shared", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--page-sizes", default="1,16")
    args = ap.parse_args()
    work = prompts(args.prompts, args.prompt_tokens, args.shared)
    tokens = sum(len(p) for p in work)
    print(f"{args.prompts} prompts of {args.prompt_tokens} tokens ({args.shared} shared), {tokens} tokens in all")
    from radixserve.entrypoints.dp_processes import free_port

    for page_size in (int(p) for p in args.page_sizes.split(",")):
        off, on = [], []
        for _ in range(args.repeats):  # NOTE: interleaved, so the machine's noise hits both alike
            off.append(tree_pass(page_size, work, None))
            sink = KVEventSink(None, max_queue_size=1 << 30)
            on.append(tree_pass(page_size, work, sink))
        ops = sink.take(0.01)
        encode = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            events = BlockEncoder(page_size).encode(ops)
            encode.append(time.perf_counter() - start)
        blocks = sum(len(e[1]) for e in events if e[0] != "AllBlocksCleared")
        published, received = publish_pass(page_size, ops, free_port())
        m_off, m_on, m_enc = (statistics.median(x) for x in (off, on, encode))
        print(f"page size {page_size:>3}: tree ops without events {m_off * 1e3:8.2f} ms, with the sink "
              f"{m_on * 1e3:8.2f} ms ({m_on / m_off:.2f}x; {len(ops)} operations queued)")
        print(f"               publisher thread: encode {len(events)} events / {blocks} blocks in "
              f"{m_enc * 1e3:8.2f} ms ({m_enc / blocks * 1e6:.2f} us/block); queue -> ZMQ -> subscriber "
              f"{published * 1e3:8.2f} ms, {received} events received")


if __name__ == "__main__":
    main()
