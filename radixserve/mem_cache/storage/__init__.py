"""The disk tier of the radix cache (SGLang's HiCache L3): a page store that outlives the KV pool and the process.

`base.StorageBackend` is what the tier needs of a store; `file_backend.FileStorageBackend` keeps one file per page
in a directory, `redis_backend.RedisStorageBackend` one value per page in a Redis / Valkey server (the `redis`
client is imported only when one is opened), both in `page_format`'s checksummed form; `keys` turns a request's
tokens into chained page keys seeded with its namespace and a fingerprint of everything that makes KV valid.
`radixserve.mem_cache.hicache` wires it to the tree (docs/hicache.md).
"""

from radixserve.mem_cache.storage.base import StorageBackend, StorageStats
from radixserve.mem_cache.storage.file_backend import FileStorageBackend
from radixserve.mem_cache.storage.keys import kv_fingerprint, page_keys, weights_identity
from radixserve.mem_cache.storage.redis_backend import RedisStorageBackend

__all__ = ["FileStorageBackend", "RedisStorageBackend", "StorageBackend", "StorageStats", "kv_fingerprint",
           "page_keys", "weights_identity"]
