"""The stored form of one page, shared by every backend: a 40-byte header, then the payload.

The header is the magic `RSKVPG01`, the payload length (little-endian uint64) and the blake2b-128 digest of the
payload. A backend stores `encode_page(payload)` and returns `verify_page(stored)`: a value that was truncated,
padded, overwritten by another program or flipped by one bit verifies as None (a miss), never as KV.
"""

from __future__ import annotations

import hashlib
import struct

MAGIC = b"RSKVPG01"
HEADER = struct.Struct("<8sQ16s")  # magic, payload length, blake2b-128 digest of the payload
HEADER_BYTES = HEADER.size


def checksum(payload: bytes) -> bytes:
    """The 16-byte blake2b digest the header carries."""
    return hashlib.blake2b(payload, digest_size=16).digest()


def encode_header(payload: bytes) -> bytes:
    """The header of `payload` (for a writer that streams the payload after it)."""
    return HEADER.pack(MAGIC, len(payload), checksum(payload))


def encode_page(payload: bytes) -> bytes:
    """Header and payload in one value."""
    return encode_header(payload) + payload


def verify_page(data: bytes) -> bytes | None:
    """The payload of a stored value, or None if its magic, length or checksum does not match."""
    if len(data) < HEADER_BYTES:
        return None
    magic, length, digest = HEADER.unpack_from(data)
    payload = bytes(data[HEADER_BYTES:])
    # NOTE: the only gate between a stored value and the KV pool: every backend's get() goes through it
    if magic != MAGIC or length != len(payload) or checksum(payload) != digest:
        return None
    return payload
