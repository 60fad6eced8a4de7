"""Requests and batches: what the scheduler knows of each request, and the sets that run one forward.

A `Req` owns its tokens (`origin_input_ids`, `output_ids`, `fill_ids`), its logprob state and its
lifecycle (finish, abort, retraction); its KV is a `ReqKV` handle (`req.kv`) that only the
`KVManager` writes. A `ScheduleBatch` is a set of requests that turns into one `ForwardBatch`:
`prepare_for_extend` asks the manager for rows and slots of a prefill, `prepare_for_decode` for one
slot per request.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from radixserve.layers.penalties import PenaltyBatchInfo
from radixserve.managers.io_struct import NO_LOGPROBS, LogprobSpec
from radixserve.mem_cache.kv_manager import KVManager, ReqKV
from radixserve.model_executor.forward_batch import ForwardBatch, ForwardMode
from radixserve.sampling_params import SamplingParams

# SGLang's SGLANG_RETRACT_DECODE_STEPS: after a retraction, free room for this many decode steps per survivor.
RETRACT_DECODE_STEPS = 20


@dataclass(frozen=True)
class FinishReason:
    """Why a request ended: `stop` (a stop/EOS token or a stop string), `length`, or `abort`."""

    type: str
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None
    status_code: int | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type}
        if self.type == "stop":
            out["matched"] = self.matched
        elif self.type == "length":
            out["length"] = self.length
        else:
            out["message"] = self.message
            out["status_code"] = self.status_code
        return out

    @staticmethod
    def abort(message: str, status_code: int = 400) -> FinishReason:
        return FinishReason("abort", message=message, status_code=status_code)


class Req:
    """One generation request. Its KV (row, slots, tree lock) is `self.kv`, written by KVManager only."""

    def __init__(self, rid: str, origin_input_ids: list[int], sampling_params: SamplingParams,
                 extra_key: Any = None, stream: bool = False, eos_token_ids: Iterable[int] = (),
                 logprob: LogprobSpec = NO_LOGPROBS) -> None:
        self.rid = rid
        self.origin_input_ids: list[int] = list(origin_input_ids)
        self.output_ids: list[int] = []
        self.fill_ids: list[int] = []  # (origin + output)[:end of the tokens computed this round]
        self.sampling_params = sampling_params
        self.max_new_tokens = sampling_params.max_new_tokens  # may be clamped to the context at admission
        self.extra_key = extra_key
        self.priority = 0  # of the tree nodes it publishes (--radix-eviction-policy priority)
        self.stream = stream
        self.eos_token_ids = frozenset(eos_token_ids)
        self.stop_token_ids = frozenset(sampling_params.stop_token_ids)
        self.stop_str_max_len = max((len(s) for s in sampling_params.stop), default=0)
        self.logprob = logprob
        self.output_token_logprobs: list[float] = []  # with return_logprob: one per output id
        self.output_top_logprobs: list[list[tuple[int, float]]] = []
        # Input logprobs of prompt positions [logprob_start_len, n) (-1: none). Position 0 has no context.
        start = logprob.logprob_start_len
        self.input_token_logprobs: list[float | None] = [None] if start == 0 else []
        self.input_top_logprobs: list[list[tuple[int, float]]] = [[]] if start == 0 else []
        self.input_logprob_next = max(start, 1)  # next prompt position a forward will score
        self.input_logprobs_sent = False
        self.penalty_reset = False  # a new row: its penalty history must be rebuilt in the next forward
        self.kv = ReqKV()
        # Lifecycle.
        self.finished_reason: FinishReason | None = None
        self.to_abort: FinishReason | None = None
        self.is_chunked = 0  # > 0 while a non-final prefill chunk is in flight
        self.is_retracted = False
        self.retracted_stain = False
        self.retraction_count = 0
        self.cached_tokens = 0
        self.already_computed = 0
        self.num_matched_prefix_tokens = 0
        self.wait_since = time.monotonic()
        self.sent_output_len = 0  # output ids already sent to the front end
        self.finish_sent = False
        self.stats_counted = False  # prompt/cached tokens counted (at the first prefill)

    def __repr__(self) -> str:
        kv = self.kv
        return (f"Req(rid={self.rid!r}, input={len(self.origin_input_ids)}, output={len(self.output_ids)}, "
                f"row={kv.req_pool_idx}, cpl={kv.cache_protected_len}, kv={kv.kv_allocated_len})")

    @property
    def seqlen(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def extend_input_len(self) -> int:
        """Tokens this round computes: `fill_ids` beyond the prefix whose KV exists."""
        return len(self.fill_ids) - self.kv.prefix_len

    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def wants_input_logprobs(self) -> bool:
        """Some prompt position still has to be scored by a forward."""
        return self.logprob.logprob_start_len >= 0 and self.input_logprob_next < len(self.origin_input_ids)

    def input_logprobs_complete(self) -> bool:
        start = self.logprob.logprob_start_len
        return start >= 0 and len(self.input_token_logprobs) == len(self.origin_input_ids) - start

    def init_next_round_input(self) -> None:
        """This round covers the whole sequence (the prefill adder may cut it to a chunk)."""
        self.fill_ids = self.origin_input_ids + self.output_ids

    @property
    def prefix_match_limit(self) -> int:
        """How many leading `fill_ids` a cached prefix may cover."""
        # NOTE: at least one token is always computed, so the forward has logits to sample from.
        limit = max(len(self.fill_ids) - 1, 0)
        if self.wants_input_logprobs:
            # NOTE: the logits at position p score prompt token p + 1, and a cached prefix has no
            # logits: positions from input_logprob_next - 1 on are computed, never matched.
            limit = min(limit, self.input_logprob_next - 1)
        return limit

    def check_finished(self, tokenizer: Any = None) -> None:
        """Set `finished_reason` after a token was appended: abort, length, stop token, then stop string."""
        if self.finished_reason is not None:
            return
        if self.to_abort is not None:
            self.finished_reason = self.to_abort
            return
        if len(self.output_ids) >= self.max_new_tokens:
            self.finished_reason = FinishReason("length", length=self.max_new_tokens)
            return
        last = self.output_ids[-1]
        if last in self.stop_token_ids or (not self.sampling_params.ignore_eos and last in self.eos_token_ids):
            self.finished_reason = FinishReason("stop", matched=last)
            return
        if self.stop_str_max_len and tokenizer is not None:
            tail = tokenizer.decode(self.output_ids[-(self.stop_str_max_len + 1):], skip_special_tokens=True)
            for stop in self.sampling_params.stop:
                if stop in tail:
                    self.finished_reason = FinishReason("stop", matched=stop)
                    return

    def reset_for_retract(self) -> None:
        """After its KV was released: keep the outputs, so the request resumes where it was."""
        self.is_chunked = 0
        self.is_retracted = True
        self.retracted_stain = True
        self.retraction_count += 1
        start = self.logprob.logprob_start_len
        if start >= 0:
            # NOTE: under overlap the prefill that scored the prompt may still be in flight; its result is
            # dropped with the retraction, so scoring resumes after what has really arrived.
            self.input_logprob_next = max(start + len(self.input_token_logprobs), 1)


class ScheduleBatch:
    """A set of requests run by one forward. The running (decode) batch is one long-lived instance."""

    def __init__(self, reqs: list[Req], kv_manager: KVManager, device: torch.device | str = "cpu") -> None:
        self.reqs = reqs
        self.kv_manager = kv_manager
        self.device = torch.device(device)
        self.forward_mode = ForwardMode.IDLE
        self.forward_batch: ForwardBatch | None = None
        self.prefill_new_tokens = 0  # Σ extend lengths of a prefill batch, for logs and counters
        self.prefill_cached_tokens = 0

    def empty_copy(self, reqs: list[Req] | None = None) -> ScheduleBatch:
        copy = ScheduleBatch(reqs or [], self.kv_manager, self.device)
        copy.forward_mode = self.forward_mode
        return copy

    def is_empty(self) -> bool:
        return not self.reqs

    def batch_size(self) -> int:
        return len(self.reqs)

    # ---- prefill --------------------------------------------------------------------------------
    def prepare_for_extend(self) -> ForwardBatch:
        """Rows and KV slots for each request's `fill_ids[prefix_len:]`, from the KV manager."""
        self.forward_mode = ForwardMode.EXTEND
        reqs = self.reqs
        for req in reqs:
            req.penalty_reset |= req.kv.req_pool_idx is None  # NOTE: a new row has no penalty history
        prefix_lens = [r.kv.prefix_len for r in reqs]
        seq_lens = [len(r.fill_ids) for r in reqs]
        extend_lens = [s - p for s, p in zip(seq_lens, prefix_lens, strict=True)]
        out_cache_loc = self.kv_manager.alloc_extend(reqs, seq_lens)
        for req, pre, seq in zip(reqs, prefix_lens, seq_lens, strict=True):
            self._count_cached_tokens(req, pre, seq)
        self.prefill_new_tokens = sum(extend_lens)
        input_ids = [t for r, p in zip(reqs, prefix_lens, strict=True) for t in r.fill_ids[p:]]
        rows = [r.kv.req_pool_idx for r in reqs]
        self.forward_batch = ForwardBatch.for_extend(input_ids, rows, prefix_lens, extend_lens,
                                                     out_cache_loc, self.device)
        self._plan_input_logprobs(prefix_lens, extend_lens)
        return self.forward_batch

    def _plan_input_logprobs(self, prefix_lens: list[int], extend_lens: list[int]) -> None:
        """Ask the forward for the logits that score prompt tokens (requests with logprob_start_len)."""
        indices: list[int] = []
        targets: list[int] = []
        counts: list[int] = []
        offset = 0
        for req, pre, ext in zip(self.reqs, prefix_lens, extend_lens, strict=True):
            lo, hi = max(pre, req.input_logprob_next - 1), min(pre + ext, len(req.origin_input_ids) - 1)
            count = max(hi - lo, 0) if req.wants_input_logprobs else 0
            indices.extend(range(offset + lo - pre, offset + lo - pre + count))
            targets.extend(req.origin_input_ids[lo + 1 : lo + 1 + count])
            counts.append(count)
            # NOTE: advanced when scheduled, not when processed: under overlap the next chunk is built
            # before this one's result is back, and must neither re-score nor skip a position.
            req.input_logprob_next += count
            offset += ext
        if not indices:
            return
        fb = self.forward_batch
        fb.extra_logits_indices = torch.tensor(indices, dtype=torch.int64, device=self.device)
        fb.extra_target_ids = torch.tensor(targets, dtype=torch.int64, device=self.device)
        fb.extra_top_k = max(r.logprob.top_logprobs_num for r, n in zip(self.reqs, counts, strict=True) if n)
        fb.input_logprob_counts = counts

    @staticmethod
    def _count_cached_tokens(req: Req, prefix_len: int, seq_len: int) -> None:
        # NOTE: counted once, at the first prefill; chunk continuations add 0, re-prefills after retraction nothing.
        if not req.retracted_stain:
            req.cached_tokens += max(prefix_len - req.already_computed, 0)
            req.already_computed = seq_len

    # ---- decode ---------------------------------------------------------------------------------
    def prepare_for_decode(self) -> ForwardBatch:
        """One new slot per request, for the last sampled token (its input ids are resolved on the device)."""
        self.forward_mode = ForwardMode.DECODE
        reqs = self.reqs
        out_cache_loc = self.kv_manager.alloc_decode(reqs)
        seq_lens = [r.kv.kv_allocated_len for r in reqs]
        self.forward_batch = ForwardBatch.for_decode(None, [r.kv.req_pool_idx for r in reqs], seq_lens,
                                                     out_cache_loc, self.device)
        return self.forward_batch

    def check_decode_mem(self, reqs: list[Req] | None = None) -> bool:
        """Evict the shortfall, then say whether the next decode step's slots are available."""
        return self.kv_manager.can_decode(self.reqs if reqs is None else reqs)

    def retract_decode(self) -> list[Req]:
        """Release requests (fewest outputs first, then longest prompt) until the rest can decode.

        Always retracts at least one and keeps at least one; the caller aborts a lone survivor that
        still does not fit. Retracted requests keep `output_ids` and must be re-queued.
        """
        order = sorted(range(len(self.reqs)), key=lambda i: (len(self.reqs[i].output_ids),
                                                             -len(self.reqs[i].origin_input_ids)), reverse=True)
        retracted: list[Req] = []
        remaining = list(self.reqs)
        while len(remaining) > 1 and (not retracted or not self.check_decode_mem(remaining)):
            req = self.reqs[order.pop()]
            remaining.remove(req)
            retracted.append(req)
            self.kv_manager.release(req, insert=False)
            req.reset_for_retract()
            self.kv_manager.evict(len(remaining) * RETRACT_DECODE_STEPS)
        self.reqs = remaining
        return retracted

    # ---- membership -----------------------------------------------------------------------------
    def filter_batch(self, drop: Req | None = None) -> None:
        """Keep the unfinished requests, minus `drop` (the chunked request)."""
        self.reqs = [r for r in self.reqs if not r.finished() and r is not drop]

    def merge_batch(self, other: ScheduleBatch) -> None:
        self.reqs.extend(r for r in other.reqs if r not in self.reqs)


def penalty_info(reqs: list[Req], output_lens: list[int], device: torch.device,
                 is_extend: bool) -> PenaltyBatchInfo | None:
    """The logit processing of a batch whose rows are assigned; None when no request asks for any.

    `output_lens`: tokens each request has generated before this step (under overlap, the host's
    output_ids lag one step; the caller knows the true count)."""
    if not any(r.sampling_params.processes_logits for r in reqs):
        return None
    params = [r.sampling_params for r in reqs]
    resets = [(r.kv.req_pool_idx, r.origin_input_ids, list(r.output_ids)) for r in reqs
              if r.penalty_reset and r.sampling_params.uses_history]
    for r in reqs:
        r.penalty_reset = False
    banned: tuple[list[int], list[int]] = ([], [])
    bias: tuple[list[int], list[int], list[float]] = ([], [], [])
    for i, (r, p, done) in enumerate(zip(reqs, params, output_lens, strict=True)):
        if done < p.min_new_tokens:
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(r.eos_token_ids))
            banned[0].extend([i] * len(stops))
            banned[1].extend(sorted(stops))
        for token, value in (p.logit_bias or {}).items():
            bias[0].append(i)
            bias[1].append(token)
            bias[2].append(float(value))
    # NOTE: a non-final prefill chunk samples a token that is dropped; it must not enter the history.
    record = [not is_extend or len(r.fill_ids) >= len(r.origin_input_ids) + len(r.output_ids) for r in reqs]

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)

    return PenaltyBatchInfo(
        rows=torch.tensor([r.kv.req_pool_idx for r in reqs], dtype=torch.int64, device=device),
        frequency=column([p.frequency_penalty for p in params]),
        presence=column([p.presence_penalty for p in params]),
        repetition=column([p.repetition_penalty for p in params]),
        use_history=any(p.uses_history for p in params), resets=resets,
        record=torch.tensor(record, dtype=torch.bool, device=device), banned=banned, bias=bias)
