"""Turning the front end's generate and abort messages into queued requests, rejections and aborts.

`InputProcessor` is a part of `Scheduler` with one job: a request that can never run is rejected on
arrival (with the numbers), so it never blocks the queue; an abort ends a request at any stage.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from radixserve.managers.io_struct import MAX_TOP_LOGPROBS, TokenizedGenerateReqInput
from radixserve.managers.req import FinishReason, Req
from radixserve.managers.request_queue import RequestQueue
from radixserve.managers.scheduler_metrics import SchedulerStats
from radixserve.managers.scheduler_output_processor import OutputProcessor
from radixserve.mem_cache.radix_key import check_namespace

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RequestLimits:
    """What every request must fit: the model's context and vocabulary, the KV pool."""

    context_len: int
    pool_tokens: int
    page_size: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]


class InputProcessor:
    def __init__(self, queue: RequestQueue, output: OutputProcessor, stats: SchedulerStats,
                 limits: RequestLimits) -> None:
        self.queue = queue
        self.output = output
        self.stats = stats
        self.limits = limits

    def handle_generate_request(self, msg: TokenizedGenerateReqInput) -> None:
        req = Req(msg.rid, msg.input_ids, msg.sampling_params, msg.extra_key, msg.stream, self.limits.eos_token_ids,
                  msg.logprob)
        error = self.validate_request(req)
        if self.queue.get(msg.rid) is not None:
            error = f"request id {msg.rid!r} is already in use"
        if error is not None:
            self.stats.num_rejected += 1
            logger.warning("Reject %s: %s", msg.rid, error)
            self.output.finish_now(req, FinishReason.abort(error, status_code=400))
            return
        req.admit(self.limits.context_len)
        self.queue.add(req)
        self.stats.num_requests += 1

    def validate_request(self, req: Req) -> str | None:
        """Why `req` can never run (with the numbers), or None. Checked on arrival, so it never blocks the queue."""
        limits = self.limits
        n = len(req.origin_input_ids)
        ps = limits.page_size
        if n == 0:
            return "the prompt is empty"
        if n >= limits.context_len:
            return f"the prompt has {n} tokens, the context length is {limits.context_len}: it must be shorter"
        pool_need = -(-n // ps) * ps + ps
        if pool_need > limits.pool_tokens:
            return (f"the prompt has {n} tokens and needs {pool_need} KV slots, but the KV pool holds "
                    f"{limits.pool_tokens} tokens")
        bad = [t for t in req.origin_input_ids if not 0 <= t < limits.vocab_size]
        if bad:
            return f"token id {bad[0]} is outside the vocabulary (size {limits.vocab_size})"
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

    def abort_request(self, rid: str) -> None:
        """Abort at any stage; unknown or already finished ids are ignored (abort is idempotent)."""
        req = self.queue.get(rid)
        if req is None or req.finished():
            return
        reason = FinishReason.abort("aborted by the client", status_code=499)
        if self.queue.is_waiting(req):
            # NOTE: a waiting request holds no lock and no slot; a retracted one released them.
            self.queue.remove([req])
            self.output.finish_now(req, reason)
        else:
            req.mark_abort(reason)  # running, mid-chunk or in the batch being run: ended at the next step
