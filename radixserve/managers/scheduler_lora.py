"""The scheduler's LoRA part: adapters for arriving requests, loading and unloading at run time, and the
adapter limit of a batch.

`LoraControl` is a part of `Scheduler` with one job: keep the registry (the model runner's `LoraManager`)
and the requests consistent: a request names a registered adapter or is refused (404); an adapter is
unloaded only when no live request uses it (else 409), and its cached KV goes with it.
"""

from __future__ import annotations

import logging
from typing import Any

from radixserve.lora.adapter import LoraAdapter, LoraLoadError
from radixserve.managers.grammar_manager import GrammarManager
from radixserve.managers.req import Req
from radixserve.managers.request_queue import RequestQueue
from radixserve.mem_cache.kv_manager import KVManager
from radixserve.protocol.io_struct import (
    ListLoraAdaptersReq,
    LoadLoraAdapterReq,
    LoraAdapterOut,
    UnloadLoraAdapterReq,
)

logger = logging.getLogger(__name__)

LORA_MESSAGES = (LoadLoraAdapterReq, UnloadLoraAdapterReq, ListLoraAdaptersReq)
LORA_OFF = "LoRA is off on this server; start it with --enable-lora or --lora-paths"


def adapter_namespace(extra_key: Any, adapter: LoraAdapter) -> tuple:
    """The request's namespace narrowed to its adapter: the same tokens under another adapter (or the base
    model) are other keys and values, so they never share KV.

    NOTE: a server namespace (a tuple of (kind, value) pairs, tenant first) keeps its parts and gains the
    adapter's last; any other value becomes one ("key", value) part before it."""
    part = adapter.namespace_part
    if extra_key is None:
        return (part,)
    if isinstance(extra_key, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in extra_key):
        return (*extra_key, part)
    return (("key", extra_key), part)


class LoraControl:
    def __init__(self, manager: Any, queue: RequestQueue, grammars: GrammarManager, kv_manager: KVManager,
                 max_per_batch: int) -> None:
        self.manager = manager  # lora/manager.LoraManager, or None: LoRA off
        self.queue = queue
        self.grammars = grammars
        self.kv_manager = kv_manager
        self.max_per_batch = max_per_batch

    # ---- requests -------------------------------------------------------------------------------
    def attach(self, req: Req, name: str) -> tuple[str, int] | None:
        """Gives `req` its adapter and namespace; or (why not, HTTP status)."""
        if self.manager is None:
            return LORA_OFF, 400
        adapter = self.manager.get(name)
        if adapter is None:
            return f"LoRA adapter {name!r} is not loaded (loaded: {', '.join(self.manager.registry) or 'none'})", 404
        req.set_lora(adapter, adapter_namespace(req.extra_key, adapter))
        return None

    def admits(self, adapters: set[str], req: Req) -> bool:
        """Whether a batch already running `adapters` may take `req` too (--max-loras-per-batch); base-model
        requests count against no adapter."""
        return req.lora is None or req.lora.name in adapters or len(adapters) < self.max_per_batch

    # ---- control messages -----------------------------------------------------------------------
    def handle(self, msg: Any) -> LoraAdapterOut:
        if self.manager is None:
            return LoraAdapterOut(False, 400, LORA_OFF)
        if isinstance(msg, LoadLoraAdapterReq):
            return self.load(msg.lora_name, msg.lora_path)
        if isinstance(msg, UnloadLoraAdapterReq):
            return self.unload(msg.lora_name)
        assert isinstance(msg, ListLoraAdaptersReq)
        return self._out(True, 200, f"{len(self.manager.registry)} adapter(s)")

    def load(self, name: str, path: str) -> LoraAdapterOut:
        try:
            adapter = self.manager.register(name, path)
        except LoraLoadError as e:
            return self._out(False, 400, str(e))
        logger.info("LoRA adapter %s loaded from %s (rank %d, %s)", name, path, adapter.rank,
                    ", ".join(adapter.target_modules))
        return self._out(True, 200, f"loaded LoRA adapter {name!r}")

    def unload(self, name: str) -> LoraAdapterOut:
        adapter = self.manager.get(name)
        if adapter is None:
            return self._out(False, 404, f"LoRA adapter {name!r} is not loaded")
        users = self.users(adapter)
        if users:
            # NOTE: refused, never forced: the requests keep their adapter to the end
            return self._out(False, 409, f"LoRA adapter {name!r} is used by {len(users)} request(s) in flight "
                                         f"({', '.join(r.rid for r in users[:8])}); retry when they finish")
        part = adapter.namespace_part
        freed = self.kv_manager.drop_namespaces(lambda key: isinstance(key, tuple) and part in key)
        self.manager.unregister(name)
        logger.info("LoRA adapter %s unloaded, %d cached tokens freed", name, freed)
        out = self._out(True, 200, f"unloaded LoRA adapter {name!r}; freed {freed} cached tokens")
        out.freed_tokens = freed
        return out

    def users(self, adapter: LoraAdapter) -> list[Req]:
        """Live requests (queued, running, or waiting for their grammar) that run `adapter`."""
        live = [*self.queue.live.values(), *self.grammars.waiting()]
        return [r for r in live if r.lora is adapter and not r.finished()]

    def _out(self, success: bool, status: int, message: str) -> LoraAdapterOut:
        return LoraAdapterOut(success, status, message, self.manager.describe())
