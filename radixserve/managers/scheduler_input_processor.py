"""Turning the front end's generate and abort messages into queued requests, rejections and aborts.

`InputProcessor` is a part of `Scheduler` with one job: a request that can never run is rejected on
arrival (with the numbers), so it never blocks the queue; an abort ends a request at any stage.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from radixserve.managers.grammar_manager import GrammarManager
from radixserve.managers.req import FinishReason, Req
from radixserve.managers.request_queue import RequestQueue
from radixserve.managers.scheduler_lora import LoraControl
from radixserve.managers.scheduler_metrics import SchedulerStats
from radixserve.managers.scheduler_output_processor import OutputProcessor
from radixserve.managers.session_cache import SessionPins
from radixserve.mem_cache.radix_key import namespace_owner
from radixserve.protocol.io_struct import TokenizedGenerateReqInput
from radixserve.protocol.requests import RequestLimits, check_request

logger = logging.getLogger(__name__)


class InputProcessor:
    def __init__(self, queue: RequestQueue, output: OutputProcessor, stats: SchedulerStats,
                 limits: RequestLimits, grammars: GrammarManager, launched_steps: Callable[[], int],
                 lora: LoraControl | None = None) -> None:
        self.queue = queue
        self.launched_steps = launched_steps  # forward steps launched so far (PipelineCounters.launched)
        self.output = output
        self.stats = stats
        self.limits = limits
        self.grammars = grammars
        self.lora = lora
        self.sessions: SessionPins | None = None  # the scheduler's agent sessions (set by Scheduler)

    def handle_generate_request(self, msg: TokenizedGenerateReqInput) -> None:
        req = Req(msg.rid, msg.input_ids, msg.sampling_params, msg.extra_key, msg.stream, self.limits.eos_token_ids,
                  msg.logprob, msg.embed)
        error, status = self.validate_request(req), 400
        if self.queue.get(msg.rid) is not None or self.grammars.get(msg.rid) is not None:
            error = f"request id {msg.rid!r} is already in use"
        if error is None and msg.lora_name is not None:
            error, status = self._attach_adapter(req, msg.lora_name) or (None, 400)
        if error is None and msg.session_id is not None and self.sessions is not None:
            # NOTE: a session is its owner's only: another API key's request gets the same 404 as an unknown id
            error = self.sessions.attach(msg.rid, namespace_owner(msg.extra_key), msg.session_id, msg.session_field)
            status = 404
        if error is not None:
            self.stats.num_rejected += 1
            logger.warning("Reject %s: %s", msg.rid, error)
            self.output.finish_now(req, FinishReason.abort(error, status_code=status))
            return
        req.admit(self.limits.longest_request, arrival_step=self.launched_steps())
        self.stats.num_requests += 1
        if not self.grammars.submit(req):  # NOTE: a request with a grammar is queued once it has compiled
            self.queue.add(req)

    def _attach_adapter(self, req: Req, name: str) -> tuple[str, int] | None:
        if self.lora is None:
            return "LoRA is off on this scheduler", 400
        return self.lora.attach(req, name)

    def validate_request(self, req: Req) -> str | None:
        """Why `req` can never run (with the numbers), or None. Checked on arrival, so it never blocks the queue;
        the front ends check the same rule (protocol/requests.py) before they send."""
        return check_request(req.origin_input_ids, req.logprob, req.extra_key, self.limits)

    def abort_request(self, rid: str) -> None:
        """Abort at any stage; unknown or already finished ids are ignored (abort is idempotent)."""
        req = self.queue.get(rid)
        if req is None and self.grammars.abort(rid):
            return
        if req is None or req.finished():
            return
        reason = FinishReason.abort("aborted by the client", status_code=499)
        if self.queue.is_waiting(req):
            # NOTE: a waiting request holds no lock and no slot; a retracted one released them.
            self.queue.remove([req])
            self.output.finish_now(req, reason)
        else:
            req.mark_abort(reason)  # running, mid-chunk or in the batch being run: ended at the next step
