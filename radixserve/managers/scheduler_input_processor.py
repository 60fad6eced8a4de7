"""Turning the front end's messages into scheduler actions: admit, reject, abort, flush, report.

A mixin of `Scheduler` (as SGLang splits its scheduler): it reads and writes the scheduler's state directly.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from radixserve.managers.cache_observer import cache_tree_snapshot
from radixserve.managers.io_struct import (
    MAX_TOP_LOGPROBS,
    AbortReq,
    CacheTreeReq,
    FlushCacheOut,
    FlushCacheReq,
    GetInternalStateOut,
    GetInternalStateReq,
    TokenizedGenerateReqInput,
)
from radixserve.managers.schedule_batch import FinishReason, Req
from radixserve.mem_cache.radix_key import check_namespace

if TYPE_CHECKING:
    from radixserve.managers.scheduler import Scheduler

logger = logging.getLogger(__name__)


class SchedulerInputProcessorMixin:
    def process_input_requests(self: Scheduler, msgs: list[Any]) -> None:
        for msg in msgs:
            if isinstance(msg, TokenizedGenerateReqInput):
                self.handle_generate_request(msg)
            elif isinstance(msg, AbortReq):
                self.abort_request(msg.rid)
            elif isinstance(msg, FlushCacheReq):
                self.output_sink(self.flush_cache())
            elif isinstance(msg, GetInternalStateReq):
                self.output_sink(GetInternalStateOut(self.get_internal_state()))
            elif isinstance(msg, CacheTreeReq):
                self.output_sink(cache_tree_snapshot(self, msg))
            else:
                logger.error("unknown message %r ignored", type(msg).__name__)

    def handle_generate_request(self: Scheduler, msg: TokenizedGenerateReqInput) -> None:
        req = Req(msg.rid, msg.input_ids, msg.sampling_params, msg.extra_key, msg.stream, self.eos_token_ids,
                  msg.logprob)
        error = self.validate_request(req)
        if msg.rid in self.reqs:
            error = f"request id {msg.rid!r} is already in use"
        if error is not None:
            self.stats.num_rejected += 1
            logger.warning("Reject %s: %s", msg.rid, error)
            self.finish_now(req, FinishReason.abort(error, status_code=400))
            return
        req.max_new_tokens = min(req.max_new_tokens, self.context_len - len(req.origin_input_ids))
        self.reqs[req.rid] = req
        self.waiting_queue.append(req)
        self.stats.num_requests += 1

    def validate_request(self: Scheduler, req: Req) -> str | None:
        """Why `req` can never run (with the numbers), or None. Checked on arrival, so it never blocks the queue."""
        n = len(req.origin_input_ids)
        ps = self.page_size
        if n == 0:
            return "the prompt is empty"
        if n >= self.context_len:
            return f"the prompt has {n} tokens, the context length is {self.context_len}: it must be shorter"
        pool_need = -(-n // ps) * ps + ps
        if pool_need > self.max_total_num_tokens:
            return (f"the prompt has {n} tokens and needs {pool_need} KV slots, but the KV pool holds "
                    f"{self.max_total_num_tokens} tokens")
        bad = [t for t in req.origin_input_ids if not 0 <= t < self.vocab_size]
        if bad:
            return f"token id {bad[0]} is outside the vocabulary (size {self.vocab_size})"
        logprob = req.logprob
        if not -1 <= logprob.logprob_start_len < n:
            return f"logprob_start_len must be -1 or a prompt position (0 to {n - 1}), got {logprob.logprob_start_len}"
        if not 0 <= logprob.top_logprobs_num <= MAX_TOP_LOGPROBS:
            return f"top_logprobs_num must be between 0 and {MAX_TOP_LOGPROBS}, got {logprob.top_logprobs_num}"
        try:
            check_namespace(req.extra_key)
        except TypeError as e:
            return str(e)
        return None

    def abort_request(self: Scheduler, rid: str) -> None:
        """Abort at any stage; unknown or already finished ids are ignored (abort is idempotent)."""
        req = self.reqs.get(rid)
        if req is None or req.finished():
            return
        reason = FinishReason.abort("aborted by the client", status_code=499)
        if any(r is req for r in self.waiting_queue):
            # NOTE: a waiting request holds no lock and no slot; a retracted one released them.
            self.waiting_queue = [r for r in self.waiting_queue if r is not req]
            self.finish_now(req, reason)
        else:
            req.to_abort = reason  # running, mid-chunk or in the batch being run: ended at the next step

    def flush_cache(self) -> FlushCacheOut:
        """Empty the tree, only when no request holds KV (no lock, no row)."""
        busy = self.active_requests()
        if busy:
            return FlushCacheOut(False, 0, f"{len(busy)} request(s) hold KV: {', '.join(r.rid for r in busy[:8])}",
                                 self.cache_epoch)
        freed = self.kv_manager.flush()
        for req in self.waiting_queue:  # NOTE: their unlocked matches point into the old tree
            self.kv_manager.forget_match(req)
        self.cache_epoch += 1
        return FlushCacheOut(True, freed, f"flushed {freed} cached tokens", self.cache_epoch)
