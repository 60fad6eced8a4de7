"""Page keys of the disk tier: a hash chain over a request's pages, seeded with its namespace and a KV fingerprint.

The key of page i is blake2b(key of page i-1 || the page's token ids); page 0 chains from a seed that hashes the
fingerprint (everything that makes KV valid: the weights' identity, dtypes, page sizes, the model's shape and
rotary configuration) and the namespace (`RadixKey.extra_key`: tenant, API key, LoRA adapter). So a key names a
whole prefix, and no page is reused across models, settings or tenants.
"""

from __future__ import annotations

import hashlib
import os
import struct
import sys
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import Any

KEY_VERSION = b"radixserve-hicache-v1"
_DIGEST = 20  # bytes; keys are 40 hex characters
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")


def weights_identity(source: str | os.PathLike | None) -> str:
    """Path, size and mtime of the weight file (or of each weight file of a model folder).

    NOTE: no content hash: the loaders compute none, and hashing GiBs at every start would cost more than it
    saves; a weight file replaced in place changes its mtime (and usually its size)."""
    if source is None:
        return "none"
    path = Path(source).expanduser().resolve()
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.suffix in _WEIGHT_SUFFIXES) \
        if path.is_dir() else []
    parts = [str(path)]
    for file in files:
        stat = file.stat()
        parts.append(f"{file.name}|{stat.st_size}|{stat.st_mtime_ns}")
    return "\n".join(parts)


def kv_fingerprint(**parts: Any) -> bytes:
    """A digest of every named part (their repr, sorted by name): two runs share pages only if all are equal.

    The tier passes the weights' identity, quantization, the model config's repr (layers, heads, head dim,
    rotary, windows), the compute and KV dtypes, the pool page size and the storage page size."""
    text = "\n".join(f"{name}={parts[name]!r}" for name in sorted(parts))
    return hashlib.blake2b(KEY_VERSION + b"\0" + text.encode(), digest_size=_DIGEST).digest()


def namespace_bytes(extra_key: Any) -> bytes:
    """An injective, process-independent encoding of a namespace (None, str, bytes, int or nested tuples)."""
    if extra_key is None:
        return b"N"
    if isinstance(extra_key, bool):
        raise TypeError("a namespace may not be a bool")
    if isinstance(extra_key, str):
        raw = extra_key.encode("utf-8", "surrogatepass")
        return b"s" + struct.pack("<Q", len(raw)) + raw
    if isinstance(extra_key, bytes):
        return b"b" + struct.pack("<Q", len(extra_key)) + extra_key
    if isinstance(extra_key, int):
        raw = str(extra_key).encode()
        return b"i" + struct.pack("<Q", len(raw)) + raw
    if isinstance(extra_key, tuple):
        return b"t" + struct.pack("<Q", len(extra_key)) + b"".join(namespace_bytes(p) for p in extra_key)
    raise TypeError(f"cannot key a namespace of type {type(extra_key).__name__}")


def chain_seed(fingerprint: bytes, extra_key: Any) -> bytes:
    return hashlib.blake2b(fingerprint + namespace_bytes(extra_key), digest_size=_DIGEST).digest()


def page_keys(fingerprint: bytes, extra_key: Any, tokens: Sequence[int], page_tokens: int,
              num_pages: int | None = None) -> list[str]:
    """Keys of the first `num_pages` full pages of `tokens` (default: all full pages), as hex strings."""
    full = len(tokens) // page_tokens
    count = full if num_pages is None else min(num_pages, full)
    prev = chain_seed(fingerprint, extra_key)
    keys = []
    ids = array("q", tokens[: count * page_tokens])
    if sys.byteorder == "big":
        ids.byteswap()  # NOTE: little-endian int64 token ids on every machine
    packed, step = ids.tobytes(), page_tokens * 8
    for i in range(count):
        prev = hashlib.blake2b(prev + packed[i * step:(i + 1) * step], digest_size=_DIGEST).digest()
        keys.append(prev.hex())
    return keys
