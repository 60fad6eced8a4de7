"""Where a hierarchical-cache load spends its time, per tier: the file backend (OS page cache warm) vs a host-memory
copy in the pool's dtype vs a host copy in bfloat16 converted on load (docs/hicache.md, "The host tier").

SmolLM2-135M's KV shape (30 layers, 3 KV heads, head dim 64) in a float32 pool, 32-token storage pages. No model:
random KV is written into the pool, stored, and loaded back through the real `HiCacheController` (a tree, an
allocator and the pool) and, phase by phase, through the file backend's steps.

    python benchmarks/bench_hicache_tiers.py [--pages 98] [--repeats 5]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from radixserve.mem_cache.allocator import TokenToKVPoolAllocator  # noqa: E402
from radixserve.mem_cache.hicache import HiCacheController, storage_page_tokens  # noqa: E402
from radixserve.mem_cache.host_tier import HostKVTier  # noqa: E402
from radixserve.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402
from radixserve.mem_cache.radix_cache import RadixCache  # noqa: E402
from radixserve.mem_cache.radix_key import RadixKey  # noqa: E402
from radixserve.mem_cache.storage.file_backend import FileStorageBackend  # noqa: E402
from radixserve.mem_cache.storage.page_format import HEADER_BYTES, verify_parts  # noqa: E402

LAYERS, HEADS, DIM = 30, 3, 64  # SmolLM2-135M


def _stack(folder: Path, tokens: int, host: HostKVTier | None) -> tuple[HiCacheController, RadixCache, TokenToKVPoolAllocator, MHATokenToKVPool]:
    rows = ReqToTokenPool(2, tokens + 64)
    alloc = TokenToKVPoolAllocator(tokens + 64)
    pool = MHATokenToKVPool(tokens + 64, 1, torch.float32, HEADS, DIM, LAYERS)
    tree = RadixCache(rows, alloc, page_size=1)
    ctl = HiCacheController(FileStorageBackend(folder, 1 << 34), pool, alloc, tree, b"b" * 20,
                            storage_page_tokens(1), "write_through", host=host)
    return ctl, tree, alloc, pool


def _best(times: list[float]) -> str:
    return f"median {statistics.median(times) * 1e3:8.2f} ms (min {min(times) * 1e3:.2f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=98)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    t = storage_page_tokens(1)
    n = args.pages * t
    tokens = list(range(1000, 1000 + n + 1))  # one more: the last token is never matched
    page_bytes = 2 * LAYERS * t * HEADS * DIM * 4
    print(f"{args.pages} pages of {t} tokens, {page_bytes / 2**20:.2f} MiB each (float32), "
          f"{args.pages * page_bytes / 2**20:.0f} MiB in all; torch threads {torch.get_num_threads()}, "
          f"load average {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory() as folder:
        # write once: compute into the pool, insert, store (write_through)
        ctl, tree, alloc, pool = _stack(Path(folder), n, None)
        slots = alloc.alloc(n)
        gen = torch.Generator().manual_seed(0)
        for layer in range(LAYERS):
            pool.k_buffer[layer][slots.long()] = torch.randn(n, HEADS, DIM, generator=gen)
            pool.v_buffer[layer][slots.long()] = torch.randn(n, HEADS, DIM, generator=gen)
        expected = ctl._gather(slots)
        key = RadixKey(tokens[:n], None)
        tree.insert(key, slots)
        start = time.perf_counter()
        ctl.on_insert(key, slots)
        print(f"store {args.pages} pages to the file backend: {time.perf_counter() - start:.3f} s")
        keys = ctl._keys(tokens, None, args.pages)
        paths = [ctl.backend._path(k) for k in keys]

        # phases of the file path (page cache warm after the write and a first read)
        names = ("read", "crc32 (v2)", "blake2b (v1)", "decode", "v1 read + 2 copies", "copy into pool",
                 "v1 cat + copy")
        phases: dict[str, list[float]] = {k: [] for k in names}
        idx = torch.arange(1, n + 1, dtype=torch.int64)
        for _ in range(args.repeats):
            acc = dict.fromkeys(phases, 0.0)
            pages = []
            for path in paths:
                s0 = time.perf_counter()
                with open(path, "rb", buffering=0) as f:
                    header = f.read(HEADER_BYTES)
                    buf = bytearray(os.fstat(f.fileno()).st_size - HEADER_BYTES)
                    f.readinto(buf)
                s1 = time.perf_counter()
                assert verify_parts(header, buf)
                s2 = time.perf_counter()
                hashlib.blake2b(buf, digest_size=16).digest()
                s3 = time.perf_counter()
                pages.append(torch.frombuffer(buf, dtype=torch.float32).view(2, LAYERS, t, HEADS, DIM))
                s4 = time.perf_counter()
                with open(path, "rb") as f:  # what the v1 code did: read all, slice the payload, copy to decode
                    bytearray(bytes(f.read()[HEADER_BYTES:]))
                s4b = time.perf_counter()
                for name, dt in zip(names[:5], (s1 - s0, s2 - s1, s3 - s2, s4 - s3, s4b - s4), strict=True):
                    acc[name] += dt
            s5 = time.perf_counter()
            # as HiCacheController.extend_match does: a layer at a time through a reused buffer
            scratch = torch.empty((n, HEADS, DIM))
            for layer in range(LAYERS):
                for side, buffer in ((0, pool.k_buffer[layer]), (1, pool.v_buffer[layer])):
                    torch.cat([page[side, layer] for page in pages], out=scratch)
                    buffer[idx] = scratch
            s6 = time.perf_counter()
            kv = torch.cat(pages, dim=2)  # what the controller did before: one cat of every page, then each layer
            for layer in range(LAYERS):
                pool.k_buffer[layer][idx] = kv[0, layer]
                pool.v_buffer[layer][idx] = kv[1, layer]
            del kv
            acc[names[5]], acc[names[6]] = s6 - s5, time.perf_counter() - s6
            for name in phases:
                phases[name].append(acc[name])
        print("file backend, by phase, for all pages (blake2b is what format v1 paid instead of crc32):")
        for name, times in phases.items():
            print(f"  {name:20s} {_best(times)}")

        # end to end through the controller: a fresh tree each time, so the whole prefix is loaded
        def load(host: HostKVTier | None, warm_host: bool) -> tuple[list[float], torch.Tensor, dict]:
            times, got = [], None
            for _ in range(args.repeats):
                ctl2, tree2, alloc2, pool2 = _stack(Path(folder), n, host)
                if warm_host:
                    ctl2.extend_match(tokens[:n], None, tree2.match_prefix(RadixKey(tokens[:n], None)))
                    ctl2, tree2, alloc2, pool2 = _stack(Path(folder), n, host)
                match = tree2.match_prefix(RadixKey(tokens[:n], None))
                start = time.perf_counter()
                new = ctl2.extend_match(tokens[:n], None, match)
                times.append(time.perf_counter() - start)
                assert len(new.device_indices) == n, len(new.device_indices)
                got = ctl2._gather(new.device_indices)
            return times, got, ctl2.stats

        rows = [("file backend (page cache warm)", None, False),
                ("host tier, float32 (pool dtype)", HostKVTier(1 << 34, torch.float32), True),
                ("host tier, bfloat16 -> float32", HostKVTier(1 << 34, torch.float32, torch.bfloat16), True)]
        print(f"load {args.pages} pages ({n} tokens) into the pool through HiCacheController.extend_match:")
        for label, host, warm in rows:
            times, got, stats = load(host, warm)
            med = statistics.median(times)
            err = (got - expected).abs().max().item()
            print(f"  {label:34s} {_best(times)}; {med / args.pages * 1e3:.3f} ms/page, "
                  f"{med / n * 1e6:.2f} us/token; max |error| {err:.2e}; host tokens {stats['host_loaded_tokens']}, "
                  f"storage tokens {stats['storage_loaded_tokens']}")


if __name__ == "__main__":
    main()
