"""Turning a forward's sampled tokens into request progress, finishes and output messages.

`OutputProcessor` is a part of `Scheduler` with one job: a launched batch's result in, request
progress and `BatchTokenIDOut` messages out. It also ends requests outside a result (`finish_now`:
aborts, rejections, out of memory), so every finish releases KV and tells the client the same way.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from radixserve.constrained.jump_forward import JumpForward
from radixserve.managers.req import FinishReason, Req
from radixserve.managers.scheduler_metrics import DecodeThroughput, SchedulerStats, decode_log_line
from radixserve.protocol.io_struct import BatchTokenIDOut
from radixserve.speculative.cost import StepCost
from radixserve.speculative.verify import accept_greedy

if TYPE_CHECKING:
    from radixserve.layers.sampler import TokenLogprobs
    from radixserve.managers.forward_pipeline import LaunchedBatch, PipelineCounters, StepOutput
    from radixserve.managers.prefill_planner import PrefillPlanner
    from radixserve.managers.request_queue import RequestQueue
    from radixserve.managers.schedule_batch import ScheduleBatch
    from radixserve.managers.session_cache import SessionPins
    from radixserve.mem_cache.kv_manager import KVManager

logger = logging.getLogger(__name__)


class GenerationBatchResult(NamedTuple):
    next_token_ids: list[int]  # one sampled token per request of the batch, in batch order
    logprobs: list[float] | None = None  # of each sampled token; None when no request asked
    top_logprobs: list[list[tuple[int, float]]] | None = None  # (token id, logprob), most likely first
    # Per request (extend only): the prompt positions this forward scored, as (logprobs, top), or None.
    input_logprobs: list[tuple[list[float], list[list[tuple[int, float]]]] | None] | None = None
    # Per request (extend only, when some request embeds): its pooled hidden state (ForwardBatch.pooled_hidden).
    pooled: list[Any] | None = None

    def select(self, rows: list[int]) -> GenerationBatchResult:
        """The result of the batch rows `rows`, in that order."""
        return GenerationBatchResult(*(None if values is None else [values[i] for i in rows] for values in self))


def logprob_top_k(reqs: list[Req]) -> int | None:
    """How many alternatives a batch's logprobs need per row; None when no request asked for logprobs."""
    asking = [r.logprob.top_logprobs_num for r in reqs if r.logprob.return_logprob]
    return max(asking) if asking else None


def host_input_logprobs(lp: TokenLogprobs | None, counts: list[int] | None) -> list | None:
    """Device input logprobs as per-request host slices (see GenerationBatchResult.input_logprobs)."""
    if lp is None:
        return None
    values, tops = host_logprobs(lp)
    per_request, at = [], 0
    for n in counts:
        per_request.append((values[at : at + n], tops[at : at + n]) if n else None)
        at += n
    return per_request


def host_logprobs(lp: TokenLogprobs | None) -> tuple[list[float] | None, list[list[tuple[int, float]]] | None]:
    """Device logprobs of one step as host lists (a sync on the device)."""
    if lp is None:
        return None, None
    top = [list(zip(ids, values, strict=True)) for ids, values in zip(lp.top_ids.tolist(), lp.top_logprobs.tolist(),
                                                                        strict=True)]
    return lp.token_logprobs.tolist(), top


class OutputProcessor:
    def __init__(self, kv_manager: KVManager, queue: RequestQueue, planner: PrefillPlanner, stats: SchedulerStats,
                 tokenizer: Any, output_sink: Callable[[Any], None], log_interval: int, pool_tokens: int,
                 jump_forward: JumpForward, step_cost: StepCost | None = None) -> None:
        self.kv_manager = kv_manager
        self.step_cost = step_cost  # speculative decoding's cost of a row (speculative/cost.py); None when off
        self.jump_forward = jump_forward
        self.pool_tokens = pool_tokens
        self.queue = queue
        self.planner = planner
        self.stats = stats
        self.tokenizer = tokenizer
        self.output_sink = output_sink
        self.log_interval = max(log_interval, 1)
        self.decode_throughput = DecodeThroughput()
        self.sessions: SessionPins | None = None  # the scheduler's agent sessions (set by Scheduler)

    def process_batch_result(self, launched: LaunchedBatch, counters: PipelineCounters) -> None:
        """Wait for a launched batch's tokens, then process them for the requests that still own their rows."""
        launched.copy_done.synchronize()
        output: StepOutput = launched.host_output.result()
        counts = launched.forward_batch.input_logprob_counts
        result = GenerationBatchResult(output.next_token_ids.tolist(), *host_logprobs(output.logprobs),
                                       host_input_logprobs(output.input_logprobs, counts),
                                       None if output.pooled is None else list(output.pooled))
        is_extend = launched.batch.forward_mode.is_extend()
        self._count_grammar_rows(launched.sampling_info)
        if self.step_cost is not None and not is_extend and output.forward_s > 0:
            self.step_cost.observe(launched.forward_batch.batch_size, output.forward_s)
        if launched.lag == 0:
            # NOTE: the normal loop waits for each forward at once: its wall time (unknown under overlap)
            elapsed = time.perf_counter() - launched.launched_at
            if is_extend:
                self.stats.prefill_forward_s += elapsed
            else:
                self.stats.decode_forward_s += elapsed
        if launched.forward_batch.verify is not None:
            self.process_batch_result_verify(launched, result, counters)
            return
        live, keep = [], []
        for i, (req, row) in enumerate(zip(launched.batch.reqs, launched.rows, strict=True)):
            if req.finished() or req.kv.req_pool_idx != row:
                continue  # NOTE: finished in an earlier result, aborted, or retracted: handled once
            self.kv_manager.commit(req, launched.seq_lens[i])
            live.append(req)
            keep.append(i)
        counters.processed += 1
        counters.dropped_tokens += len(result.next_token_ids) - len(live)
        batch, result = launched.batch.empty_copy(live), result.select(keep)
        if is_extend:
            self.process_batch_result_prefill(batch, result, counters.launched)
        else:
            self.process_batch_result_decode(batch, result)

    def _count_grammar_rows(self, info: Any) -> None:
        mask = getattr(info, "grammar_mask", None)  # NOTE: a test's fake runner has no sampling info
        if mask is not None:
            self.stats.grammar_rows_masked += len(mask.masked)
            self.stats.grammar_rows_checked += len(mask.checked)
            self.stats.grammar_rows_refused += mask.num_refused

    def process_batch_result_prefill(self, batch: ScheduleBatch, result: GenerationBatchResult,
                                     launched: int) -> None:
        """`launched`: the forward steps launched so far, for each first token's `queue_steps`."""
        for i, (req, token) in enumerate(zip(batch.reqs, result.next_token_ids, strict=True)):
            if result.input_logprobs is not None and result.input_logprobs[i] is not None and not req.finished():
                req.add_input_logprobs(*result.input_logprobs[i])
            if req.embed is not None and result.pooled is not None and not req.finished():
                req.add_pooled(result.pooled[i], final=req.is_chunked == 0)
            if req.end_chunk():
                continue  # NOTE: a non-final chunk samples nothing; its KV is stashed at the next step.
            if req.finished():
                continue
            if req.to_abort is not None or req.max_new_tokens == 0:
                # NOTE: an abort that arrived while the batch ran ends it without the sampled token.
                req.finish(req.to_abort or FinishReason("length", length=0))
            else:
                req.note_first_token(launched)
                self.append_output_token(req, token, result, i)
                req.check_finished(self.tokenizer)
            if req.finished():
                self.release_finished_req(req)
            else:
                self.kv_manager.cache_unfinished_req(req)
                self.jump(req)
        self.stream_output(batch.reqs)

    def process_batch_result_decode(self, batch: ScheduleBatch, result: GenerationBatchResult) -> None:
        for i, (req, token) in enumerate(zip(batch.reqs, result.next_token_ids, strict=True)):
            if req.finished():
                continue
            if req.to_abort is None and not req.samples_next(req.kv.kv_committed_len):
                continue  # NOTE: a forced token was fed, or launched before a jump-forward: its sample is dropped
            if req.to_abort is None:
                self.append_output_token(req, token, result, i)
            req.check_finished(self.tokenizer)
            if req.finished():
                self.release_finished_req(req)
            else:
                self.jump(req)
        self.decode_throughput.add(len(batch.reqs))
        self.stats.num_decode_batches += 1
        if self.stats.num_decode_batches % self.log_interval == 0:
            self.log_decode_stats(len(batch.reqs))
        self.stream_output(batch.reqs)

    def process_batch_result_verify(self, launched: LaunchedBatch, result: GenerationBatchResult,
                                    counters: PipelineCounters) -> None:
        """A verify step (speculative/verify.py): each request keeps its accepted draft tokens and the model's
        token after them; the KV of rejected draft tokens goes back to the allocator at once."""
        verify = launched.forward_batch.verify
        counters.processed += 1
        live, appended = [], 0
        for req, row, draft, base, offset in zip(launched.batch.reqs, launched.rows, verify.drafts, verify.base_lens,
                                                 verify.row_offsets(), strict=True):
            if req.finished() or req.kv.req_pool_idx != row:
                counters.dropped_tokens += 1 + len(draft)
                continue  # NOTE: finished in an earlier result, aborted, or retracted: handled once
            live.append(req)
            tokens = accept_greedy(draft, result.next_token_ids[offset: offset + 1 + len(draft)])
            if draft:
                self._count_draft(req, len(draft), len(tokens) - 1)
                req.penalties_after_verify()
            forced: list[int] = []
            if req.to_abort is None and req.samples_next(base + 1):
                for i, token in enumerate(tokens):
                    self.append_output_token(req, token, result, offset + i)
                    appended += 1
                    req.check_finished(self.tokenizer)
                    if req.finished():
                        break
                    forced = self.jump_forward.forced_tokens(req)
                    if forced:
                        # NOTE: a jump point inside the accepted run ends it, so that requests jump where they would
                        # without drafts (the decision is a function of the tokens): the model's tokens after it go
                        tokens = tokens[: i + 1]
                        break
            else:
                req.check_finished(self.tokenizer)
            self.kv_manager.commit(req, base + len(tokens))
            if req.finished():
                self.release_finished_req(req)  # NOTE: frees the rejected slots with the rest
            else:
                self.kv_manager.release_tail(req, base + len(tokens))
                self.take_jump(req, forced)
        self.decode_throughput.add(appended)
        self.stats.num_decode_batches += 1
        if self.stats.num_decode_batches % self.log_interval == 0:
            self.log_decode_stats(len(live))
        self.stream_output(live)

    def _count_draft(self, req: Req, drafted: int, accepted: int) -> None:
        req.spec.record(drafted, accepted)
        self.stats.spec_verify_steps += 1
        self.stats.spec_draft_tokens += drafted
        self.stats.spec_accepted_tokens += accepted

    def jump(self, req: Req) -> None:
        """Appends what the request's grammar forces next, if enough (constrained/jump_forward.py)."""
        self.take_jump(req, self.jump_forward.forced_tokens(req))

    def take_jump(self, req: Req, tokens: list[int]) -> None:
        """Appends `tokens`, forced by its grammar and already accepted by its matcher (none: no jump)."""
        if tokens:
            req.jump_forward(tokens)
            self.stats.num_jump_forwards += 1
            self.stats.jump_forward_tokens += len(tokens)

    def append_output_token(self, req: Req, token: int, result: GenerationBatchResult, row: int) -> None:
        self.stats.generated_tokens += 1
        wants = req.logprob.return_logprob
        req.append_token(token, result.logprobs[row] if wants else None, result.top_logprobs[row] if wants else None)

    def log_decode_stats(self, running_req: int) -> None:
        total = self.pool_tokens
        used = total - self.kv_manager.free_and_evictable()
        logger.info(decode_log_line(running_req, used, used / total, self.decode_throughput.take(),
                                    len(self.queue)))

    # ---- finishing ------------------------------------------------------------------------------
    def release_finished_req(self, req: Req) -> None:
        """Hand a finished request's KV to the tree (not an aborted one's), free the rest, count it."""
        aborted = req.finished_reason.type == "abort"
        session = self.sessions.context_of(req) if self.sessions is not None else None
        self.kv_manager.release(req, insert=not aborted)
        if session is not None and not aborted:  # NOTE: after the insert, before anything can evict it
            self.sessions.on_finished(*session)
        self.queue.forget(req)
        self.planner.room_freed()
        if aborted:
            self.stats.num_aborts += 1
        else:
            self.stats.num_finished += 1

    def finish_now(self, req: Req, reason: FinishReason) -> None:
        """End a request outside a batch result (abort, rejection, OOM), release its KV, tell the client."""
        req.finish(reason)
        self.release_finished_req(req)
        self.stream_output([req])

    def stream_output(self, reqs: list[Req]) -> None:
        """Send new tokens of streaming requests, and the rest of every finished request."""
        out = BatchTokenIDOut([req.take_output() for req in reqs if req.has_output_to_send()])
        if out.outputs:
            self.output_sink(out)
