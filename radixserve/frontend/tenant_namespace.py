"""A request's cache namespace: the structured `extra_key` of its radix keys, derived on the server side."""

from __future__ import annotations

import hashlib

from radixserve.mem_cache.radix_key import namespace_owner

__all__ = ["api_key_id", "cache_namespace", "namespace_owner"]


def cache_namespace(api_key_id: str | None, cache_salt: str | None, extra_key: str | None) -> tuple | None:
    """The structured `extra_key` of the radix key: a tuple of (kind, value) pairs, or None (shared).

    NOTE: never concatenate strings here; ("salt", "a") and ("key", "a") differ, and no chosen string
    can reach another tenant's ("api", id) component, which the server derives from the API key and
    always puts first, so a client salt can only narrow its own namespace.
    """
    parts = []
    if api_key_id is not None:
        parts.append(("api", api_key_id))
    if cache_salt is not None:
        parts.append(("salt", cache_salt))
    if extra_key is not None:
        parts.append(("key", extra_key))
    return tuple(parts) or None


def api_key_id(key: str) -> str:
    return hashlib.sha256(b"radixserve-namespace\0" + key.encode()).hexdigest()[:32]
