"""`RadixKey`: a token sequence plus a structured namespace (`extra_key`), the radix tree's edge label."""

from __future__ import annotations

import struct
from array import array
from collections.abc import Iterable, Iterator
from typing import Any

# A namespace is None, or built from these atoms and tuples of them. bool and float are refused:
# Python treats True == 1 == 1.0 as the same dict key, which would let two namespaces collide.
_NAMESPACE_ATOMS = (str, bytes, int)


def check_namespace(extra_key: Any) -> None:
    """Raise TypeError unless `extra_key` is None or a str/bytes/int or a (nested) tuple of them."""
    if extra_key is None:
        return
    if isinstance(extra_key, bool) or not isinstance(extra_key, (*_NAMESPACE_ATOMS, tuple)):
        raise TypeError(
            f"extra_key must be None, str, bytes, int or a tuple of those, got {type(extra_key).__name__}"
        )
    if isinstance(extra_key, tuple):
        for part in extra_key:
            if part is None:
                raise TypeError("extra_key tuples may not contain None")
            check_namespace(part)


_TOKEN_BYTES = 8  # NOTE: tokens are packed as native int64; positions below are in tokens
_ONE_TOKEN = struct.Struct("q")


def pack_tokens(token_ids: Any) -> bytes:
    """Token ids as packed native int64 bytes: array('q') and bytes-like views are copied as is."""
    if isinstance(token_ids, array) and token_ids.typecode == "q":
        return token_ids.tobytes()
    if isinstance(token_ids, (bytes, bytearray, memoryview, str)):
        raise TypeError("token ids must be a sequence of ints (pass array('q') for packed tokens)")
    if hasattr(token_ids, "tolist"):  # torch tensor or numpy array
        token_ids = token_ids.tolist()
    elif not isinstance(token_ids, (list, tuple)):
        token_ids = list(token_ids)
    try:
        return struct.pack(f"{len(token_ids)}q", *token_ids)
    except struct.error as exc:
        raise ValueError(f"token ids must be int64 integers: {exc}") from None


def unpack_tokens(packed: bytes) -> tuple[int, ...]:
    return tuple(memoryview(packed).cast("q"))


def common_prefix_len(edge: bytes, tokens: bytes, start: int) -> int:
    """Tokens in common between packed `edge` and packed `tokens` from token `start`, by memcmp.

    One C-level comparison when the whole edge matches (the usual case); otherwise a bisection
    over slice comparisons: O(len) bytes touched in total and O(log len) Python steps.
    """
    offset = start * _TOKEN_BYTES
    n = min(len(edge), len(tokens) - offset)
    if n <= 0:
        return 0
    if tokens.startswith(edge if n == len(edge) else edge[:n], offset):
        return n // _TOKEN_BYTES
    lo, hi = 0, n // _TOKEN_BYTES  # NOTE: tokens [0, lo) match; the first difference is in [lo, hi)
    while hi - lo > 1:
        mid = (lo + hi) >> 1
        if tokens.startswith(edge[lo * _TOKEN_BYTES:mid * _TOKEN_BYTES], offset + lo * _TOKEN_BYTES):
            lo = mid
        else:
            hi = mid
    return lo


class RadixKey:
    """An immutable token sequence with an optional namespace.

    Tokens are kept packed as native int64 bytes, so comparing two keys is a memcmp (pass
    `array('q')` to skip the packing copy; lists, tuples and tensors are packed once).
    `token_ids` unpacks them as a tuple. `extra_key` partitions the tree: keys with different
    namespaces never share a node. It is compared as a structured value, never concatenated
    into a string, so ("a", "b"), "a:b" and "a" + "b" stay distinct.
    """

    __slots__ = ("packed", "extra_key")

    def __init__(self, token_ids: Iterable[int], extra_key: Any = None) -> None:
        check_namespace(extra_key)
        self.packed: bytes = pack_tokens(token_ids)
        self.extra_key = extra_key

    @classmethod
    def _trusted(cls, packed: bytes, extra_key: Any) -> RadixKey:
        key = object.__new__(cls)
        key.packed = packed
        key.extra_key = extra_key
        return key

    @property
    def token_ids(self) -> tuple[int, ...]:
        return unpack_tokens(self.packed)

    def __len__(self) -> int:
        return len(self.packed) // _TOKEN_BYTES

    def __iter__(self) -> Iterator[int]:
        return iter(memoryview(self.packed).cast("q"))

    def __getitem__(self, index: int | slice) -> RadixKey:
        n = len(self)
        if isinstance(index, slice):
            start, stop, step = index.indices(n)
            if step != 1:
                raise ValueError("RadixKey slices must have step 1")
            stop = max(start, stop)
        else:
            if not -n <= index < n:
                raise IndexError(f"RadixKey index {index} out of range for length {n}")
            start = index % n
            stop = start + 1
        return RadixKey._trusted(self.packed[start * _TOKEN_BYTES:stop * _TOKEN_BYTES], self.extra_key)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RadixKey):
            return NotImplemented
        return self.packed == other.packed and self.extra_key == other.extra_key

    def __hash__(self) -> int:
        return hash((self.packed, self.extra_key))

    def __repr__(self) -> str:
        shown = ", ".join(map(str, self.token_ids[:10]))
        more = ", ..." if len(self) > 10 else ""
        return f"RadixKey(token_ids=[{shown}{more}], extra_key={self.extra_key!r})"

    def page_aligned(self, page_size: int) -> RadixKey:
        """The longest prefix whose length is a multiple of `page_size`."""
        aligned = len(self) // page_size * page_size * _TOKEN_BYTES
        if aligned == len(self.packed):
            return self
        return RadixKey._trusted(self.packed[:aligned], self.extra_key)

    def child_key(self, page_size: int) -> Any:
        """The dict key a parent files this edge under: first token or first page, in its namespace."""
        return child_key_at(self.packed, 0, page_size, self.extra_key)

    def match(self, other: RadixKey, page_size: int = 1) -> int:
        """Longest common prefix with `other`, rounded down to a multiple of `page_size`."""
        if self.extra_key != other.extra_key:
            raise ValueError(
                f"cannot match keys of different namespaces: {self.extra_key!r} vs {other.extra_key!r}"
            )
        lcp = common_prefix_len(self.packed, other.packed, 0)
        return lcp // page_size * page_size


def child_key_at(packed: bytes, start: int, page_size: int, extra_key: Any) -> Any:
    """Child key of the packed tokens from token `start`: an int (page 1) or a tuple of one page."""
    offset = start * _TOKEN_BYTES
    if page_size == 1:
        plain = _ONE_TOKEN.unpack_from(packed, offset)[0]
    else:
        plain = tuple(memoryview(packed)[offset:offset + page_size * _TOKEN_BYTES].cast("q"))
    return plain if extra_key is None else (extra_key, plain)
