"""A request's cache namespace: the structured `extra_key` of its radix keys, derived on the server side."""

from __future__ import annotations

import hashlib


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


def namespace_owner(extra_key: tuple | None) -> str | None:
    """The API key id a request's namespace starts with (see cache_namespace), or None."""
    if extra_key and extra_key[0][0] == "api":
        return extra_key[0][1]
    return None


def api_key_id(key: str) -> str:
    return hashlib.sha256(b"radixserve-namespace\0" + key.encode()).hexdigest()[:32]
