"""The radix prefix cache and the KV pools it frees into.

`RadixKey` and `convert_to_bigram_key` import without torch; `RadixCache` loads on first use.
"""

from __future__ import annotations

from typing import Any

from radixserve.mem_cache.radix_key import RadixKey, convert_to_bigram_key

__all__ = ["RadixCache", "RadixKey", "convert_to_bigram_key"]


def __getattr__(name: str) -> Any:
    if name == "RadixCache":
        from radixserve.mem_cache.radix_cache import RadixCache

        return RadixCache
    raise AttributeError(f"module 'radixserve.mem_cache' has no attribute {name!r}")
