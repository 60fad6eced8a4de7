"""`RedisStorageBackend`: the disk tier's pages in a Redis (or Valkey) server, so several machines share them.

A page is one string value under `<prefix><key>` (default prefix `radixserve:hicache:`), stored in the same form as
the file backend's files (`page_format`: a 40-byte header with the payload's length and blake2b-128 digest, then
the payload). Redis writes a value whole, so a reader sees a whole page or none; a value that does not verify is
counted, deleted and a miss.

The byte cap is the server's: the operator sets `maxmemory` and `maxmemory-policy allkeys-lru` (a read refreshes a
key's recency), and Redis evicts the least recently used pages itself. At open the backend reads both and warns
once if no cap is set; the client never scans or deletes to stay under a cap.

Failures never reach the request: the client uses short socket timeouts and no retries, and the first connection
error or timeout (at open or on any call) turns the store off with one warning; while it is off every lookup is a
miss, and at most every `reconnect_s` seconds (RECONNECT_S, 30) the next use of the store tries it again (one ping,
at most the connect timeout on the scheduler thread): a server that came back (restarted, failed over) is used again,
with one warning that says so. A command the server refuses (out of memory under `noeviction`, a read-only replica,
an ACL) skips that one page, with a warning the first time.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from radixserve.mem_cache.storage.base import StorageStats
from radixserve.mem_cache.storage.page_format import HEADER_BYTES, encode_page, verify_page

logger = logging.getLogger(__name__)

URL_SCHEMES = ("redis", "rediss", "unix")
RECONNECT_S = 30.0  # a store that went away is tried again at most this often
DEFAULT_PREFIX = "radixserve:hicache:"
# NOTE: every call runs on the scheduler thread: a hung server costs one step at most this long, then the store
# is off. A page is 1.4 MiB for SmolLM2 in float32: 0.5 s is ~20 ms of it on a 1 Gbit/s link, many times over.
SOCKET_TIMEOUT_S = 0.5
CONNECT_TIMEOUT_S = 0.5
_KEY_RE = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


def check_redis_url(url: str | None) -> None:
    """A ValueError naming `hicache_storage_url` unless `url` is a redis://, rediss:// or unix:// URL with a host
    (or a socket path) and, if given, a numeric port and database. The message never repeats the URL (it may
    carry a password)."""
    if not url:
        raise ValueError("hicache_storage_backend='redis' needs hicache_storage_url, e.g. redis://127.0.0.1:6379/0")
    if not isinstance(url, str):
        raise ValueError(f"hicache_storage_url must be a string, got {type(url).__name__}")
    parts = urlsplit(url)
    if parts.scheme not in URL_SCHEMES:
        raise ValueError(f"hicache_storage_url must start with redis://, rediss:// or unix:// "
                         f"(got scheme {parts.scheme!r})")
    if parts.scheme == "unix":
        if not parts.path:
            raise ValueError("hicache_storage_url unix:// needs a socket path, e.g. unix:///run/redis.sock")
        return
    if not parts.hostname:
        raise ValueError("hicache_storage_url has no host, e.g. redis://127.0.0.1:6379/0")
    try:
        parts.port  # noqa: B018  (urlsplit checks the port only when it is read)
    except ValueError as exc:
        raise ValueError(f"hicache_storage_url has a bad port: {exc}") from None
    db = parts.path.strip("/")
    if db and not db.isdigit():
        raise ValueError(f"hicache_storage_url's database must be a number (redis://host:6379/0), got {db!r}")


def redacted(url: str) -> str:
    """`url` without its user name and password, for logs."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return f"unix://{parts.path}"
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{parts.hostname}{port}{parts.path or ''}"


class RedisStorageBackend:
    """Pages as values in the Redis server at `url`, under `prefix`. `client` (tests): a ready redis client."""

    kind = "redis"

    def __init__(self, url: str, prefix: str = DEFAULT_PREFIX, socket_timeout: float = SOCKET_TIMEOUT_S,
                 connect_timeout: float = CONNECT_TIMEOUT_S, client: Any = None, reconnect_s: float = RECONNECT_S) -> None:
        check_redis_url(url)
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as exc:
            raise RuntimeError("--hicache-storage-backend redis needs the redis package: "
                               "pip install 'radixserve[hicache]'") from exc
        self.location, self.prefix = redacted(url), prefix
        self.stats = StorageStats()
        self.on_evict: Callable[[str], None] | None = None  # NOTE: never called: the server evicts by itself
        self.capacity_bytes = 0  # the server's maxmemory, read at open (0: none set, or not readable)
        self.eviction_policy = ""  # the server's maxmemory-policy, read at open
        self.refused = 0  # commands the server refused (each skipped one page)
        self.reconnect_s = reconnect_s  # 0: a store that went away stays off
        self.reconnects = 0  # times the store came back after it went away
        self._retry_at = 0.0  # monotonic time of the next reconnection try, while off
        # NOTE: a connection error or timeout means the store is unusable: off. Any other RedisError is a refused
        # command (a ResponseError: OOM, READONLY, NOPERM): that page only.
        self._fatal: tuple[type[BaseException], ...] = (redis.ConnectionError, redis.TimeoutError, OSError)
        self._refusal: type[BaseException] = redis.RedisError
        # NOTE: no retries (redis-py's default retries with backoff would hold the scheduler for seconds); URL
        # options (?socket_timeout=2) override these keywords.
        self._client = client if client is not None else redis.Redis.from_url(
            url, socket_timeout=socket_timeout, socket_connect_timeout=connect_timeout,
            retry=Retry(NoBackoff(), 0), retry_on_error=[], health_check_interval=0)
        self._call("connecting", self._open)

    # ---- state ----------------------------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        """Whether the store is usable; asking, while it is off, tries it again when a retry is due."""
        return not self.stats.disabled or self._reconnect()

    def _reconnect(self) -> bool:
        """One try (ping, config) of a store that went away, at most every `reconnect_s`; True if it is back."""
        now = time.monotonic()
        if self.reconnect_s <= 0 or now < self._retry_at:
            return False
        self._retry_at = now + self.reconnect_s
        try:
            self._open()
        except (*self._fatal, self._refusal) as exc:
            logger.debug("hierarchical cache storage at %s still unreachable: %s", self.location, exc)
            return False
        self.stats.disabled = False
        self.reconnects += 1
        logger.warning("hierarchical cache storage at %s is back; serving with it again", self.location)
        return True

    def pages(self) -> int | None:
        """Not known without scanning the server's keys: None."""
        return None

    def usage(self) -> int:
        """The server's `used_memory` (what maxmemory caps: every key of the database, not only ours)."""
        info = self._call("reading INFO", self._client.info, "memory")
        return int(info.get("used_memory", 0)) if isinstance(info, dict) else 0

    def close(self) -> None:
        """Release the client's connections."""
        try:
            self._client.close()
        except Exception as exc:  # NOTE: closing a dead connection is not worth an error
            logger.debug("closing the redis client: %s", exc)

    def _open(self) -> None:
        self._client.ping()
        try:
            config = {_text(k): _text(v) for k, v in self._client.config_get("maxmemory*").items()}
        except self._fatal:
            raise
        except self._refusal as exc:  # NOTE: managed servers often rename or deny CONFIG
            logger.info("hierarchical cache storage at %s: cannot read maxmemory (%s); the operator caps it",
                        self.location, exc)
            return
        self.capacity_bytes = int(config.get("maxmemory") or 0)
        self.eviction_policy = config.get("maxmemory-policy", "")
        if not self.capacity_bytes or not self.eviction_policy.startswith("allkeys-"):
            logger.warning("hierarchical cache storage at %s has no byte cap for its pages (maxmemory %d, "
                           "maxmemory-policy %s): set maxmemory and maxmemory-policy allkeys-lru on the server "
                           "(docs/hicache.md)", self.location, self.capacity_bytes, self.eviction_policy or "?")

    def _turn_off(self, exc: BaseException, doing: str) -> None:
        self._retry_at = time.monotonic() + self.reconnect_s
        if not self.stats.disabled:
            self.stats.disabled = True
            logger.warning("hierarchical cache storage at %s turned off (%s: %s: %s); serving continues without it",
                           self.location, doing, type(exc).__name__, exc)

    def _call(self, doing: str, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)`, or None while the store is off or if the call failed (which may turn it off)."""
        if self.stats.disabled and not self._reconnect():
            return None
        try:
            return fn(*args)
        except self._fatal as exc:
            self._turn_off(exc, doing)
        except self._refusal as exc:
            self.refused += 1
            log = logger.warning if self.refused == 1 else logger.debug
            log("hierarchical cache storage at %s refused a command (%s: %s); that page is skipped",
                self.location, doing, exc)
        return None

    def _name(self, key: str) -> str:
        if not _KEY_RE.match(key):
            raise ValueError(f"storage key {key!r} must be 1-128 characters of [A-Za-z0-9_-]")
        return self.prefix + key

    # ---- the protocol ---------------------------------------------------------------------------
    def exists(self, key: str) -> bool:
        return bool(self._call("looking up", self._client.exists, self._name(key)))

    def get(self, key: str) -> bytes | None:
        name = self._name(key)
        if not self.enabled:
            return None
        data = self._call("reading", self._client.get, name)
        if data is None:
            self.stats.misses += 1  # NOTE: also evicted by the server since exists(), or a failed read
            return None
        payload = verify_page(data)
        if payload is None:
            logger.warning("hierarchical cache page %s failed its checksum; deleted", name)
            self.stats.corrupt += 1
            self.stats.misses += 1
            self.delete(key)
            return None
        self.stats.hits += 1
        self.stats.bytes_read += len(payload)
        return payload

    def set(self, key: str, payload: bytes) -> bool:
        name = self._name(key)
        if not self.enabled or (self.capacity_bytes and HEADER_BYTES + len(payload) > self.capacity_bytes):
            return False
        if not self._call("writing", self._client.set, name, encode_page(payload)):
            return False
        self.stats.pages_written += 1
        self.stats.bytes_written += len(payload)
        return True

    def delete(self, key: str) -> None:
        self._call("deleting", self._client.delete, self._name(key))


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
