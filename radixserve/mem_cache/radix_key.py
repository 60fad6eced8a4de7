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
_LOW32 = 0xFFFFFFFF
_INT32_RANGE = (-(1 << 31), (1 << 31) - 1)


def namespace_owner(extra_key: Any) -> str | None:
    """The API key id a request's namespace starts with (the server puts ("api", id) first), or None."""
    if extra_key and extra_key[0][0] == "api":
        return extra_key[0][1]
    return None


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


def pack_bigrams(packed: bytes) -> bytes:
    """The EAGLE bigram view of packed tokens: one int64 unit per pair (t[i], t[i+1]), n-1 units.

    NOTE: a pair is stored as one int64 (t[i] in the high 32 bits, t[i+1] in the low 32), so two
    units are equal exactly when both tokens are; this needs token ids in the int32 range (every
    vocabulary is) and lets the tree compare, split and file bigram edges like token edges.
    """
    raw = memoryview(packed).cast("q")
    if len(raw) and (min(raw) < _INT32_RANGE[0] or max(raw) > _INT32_RANGE[1]):
        raise ValueError("bigram keys need token ids in the int32 range")
    low = [t & _LOW32 for t in raw]
    units = array("q", ((a << 32 | b) - ((a >> 31) << 64) for a, b in zip(low, low[1:], strict=False)))
    return units.tobytes()


def convert_to_bigram_key(tokens: Iterable[int]) -> list[tuple[int, int]]:
    """SGLang's helper: the pairs (t[i], t[i+1]) of a token sequence, one fewer than the tokens."""
    tokens = list(tokens)
    return list(zip(tokens, tokens[1:], strict=False))


def unpack_bigram(unit: int) -> tuple[int, int]:
    """The token pair one bigram unit stands for."""
    second = unit & _LOW32
    return unit >> 32, second - ((second >> 31) << 32)


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

    `is_bigram=True` is the EAGLE view: the key's units are the pairs (t[i], t[i+1]), so its length
    is one less than the raw tokens given; slicing, matching, page alignment and child keys work on
    pairs (`pack_bigrams`). `token_ids` and iteration then give pairs, `raw_token_ids` the tokens.
    """

    __slots__ = ("packed", "extra_key", "is_bigram")

    def __init__(self, token_ids: Iterable[int], extra_key: Any = None, is_bigram: bool = False) -> None:
        check_namespace(extra_key)
        packed = pack_tokens(token_ids)
        self.packed: bytes = pack_bigrams(packed) if is_bigram else packed
        self.extra_key = extra_key
        self.is_bigram = is_bigram

    @classmethod
    def _trusted(cls, packed: bytes, extra_key: Any, is_bigram: bool = False) -> RadixKey:
        key = object.__new__(cls)
        key.packed = packed
        key.extra_key = extra_key
        key.is_bigram = is_bigram
        return key

    @property
    def token_ids(self) -> tuple:
        """The key's units: token ids, or (t[i], t[i+1]) pairs in the bigram view."""
        units = unpack_tokens(self.packed)
        return tuple(map(unpack_bigram, units)) if self.is_bigram else units

    @property
    def raw_token_ids(self) -> tuple[int, ...]:
        """The tokens the key spans: its token ids, or every pair's first token plus the last pair's second."""
        if not self.is_bigram:
            return unpack_tokens(self.packed)
        pairs = self.token_ids
        return tuple(a for a, _ in pairs) + pairs[-1][1:] if pairs else ()

    def to_bigram(self) -> RadixKey:
        """This key's EAGLE bigram view (a new key; the key itself is unchanged)."""
        return self if self.is_bigram else RadixKey._trusted(pack_bigrams(self.packed), self.extra_key, True)

    def __len__(self) -> int:
        return len(self.packed) // _TOKEN_BYTES

    def __iter__(self) -> Iterator:
        return iter(self.token_ids) if self.is_bigram else iter(memoryview(self.packed).cast("q"))

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
        return RadixKey._trusted(self.packed[start * _TOKEN_BYTES:stop * _TOKEN_BYTES], self.extra_key,
                                 self.is_bigram)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RadixKey):
            return NotImplemented
        return (self.packed == other.packed and self.extra_key == other.extra_key
                and self.is_bigram == other.is_bigram)

    def __hash__(self) -> int:
        return hash((self.packed, self.extra_key, self.is_bigram))

    def __repr__(self) -> str:
        shown = ", ".join(map(str, self.token_ids[:10]))
        more = ", ..." if len(self) > 10 else ""
        bigram = ", is_bigram=True" if self.is_bigram else ""
        return f"RadixKey(token_ids=[{shown}{more}], extra_key={self.extra_key!r}{bigram})"

    def page_aligned(self, page_size: int) -> RadixKey:
        """The longest prefix whose length is a multiple of `page_size`."""
        aligned = len(self) // page_size * page_size * _TOKEN_BYTES
        if aligned == len(self.packed):
            return self
        return RadixKey._trusted(self.packed[:aligned], self.extra_key, self.is_bigram)

    def child_key(self, page_size: int) -> Any:
        """The dict key a parent files this edge under: first token or first page, in its namespace."""
        return child_key_at(self.packed, 0, page_size, self.extra_key)

    def match(self, other: RadixKey, page_size: int = 1) -> int:
        """Longest common prefix with `other`, rounded down to a multiple of `page_size`."""
        if self.extra_key != other.extra_key:
            raise ValueError(
                f"cannot match keys of different namespaces: {self.extra_key!r} vs {other.extra_key!r}"
            )
        if self.is_bigram != other.is_bigram:
            raise ValueError("cannot match a bigram key with a token key")
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
