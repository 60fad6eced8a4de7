"""Requests and batches: the scheduler's view of who holds which KV slot (reference §1.6, §3, §4.6).

A `Req` owns three kinds of state: its tokens (`origin_input_ids`, `output_ids`, `fill_ids`), its KV
bookkeeping (named exactly as the radix cache expects), and its lifecycle (finish, abort, retraction).
A `ScheduleBatch` is a set of requests that turns into one `ForwardBatch`: `prepare_for_extend`
allocates the rows and slots of a prefill, `prepare_for_decode` one slot per request.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from radixserve.layers.penalties import PenaltyBatchInfo
from radixserve.managers import kv_ops
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


_EMPTY_INDICES = torch.empty((0,), dtype=torch.int64)


class Req:
    """One generation request. The KV attribute names are the radix cache's contract (reference §1.6)."""

    def __init__(self, rid: str, origin_input_ids: list[int], sampling_params: SamplingParams,
                 extra_key: Any = None, stream: bool = False, eos_token_ids: Iterable[int] = (),
                 return_logprob: bool = False, top_logprobs_num: int = 0, logprob_start_len: int = -1) -> None:
        self.rid = rid
        self.origin_input_ids: list[int] = list(origin_input_ids)
        self.output_ids: list[int] = []
        self.fill_ids: list[int] = []  # (origin + output)[:end of the tokens computed this round]
        self.sampling_params = sampling_params
        self.max_new_tokens = sampling_params.max_new_tokens  # may be clamped to the context at admission
        self.extra_key = extra_key
        self.stream = stream
        self.eos_token_ids = frozenset(eos_token_ids)
        self.stop_token_ids = frozenset(sampling_params.stop_token_ids)
        self.stop_str_max_len = max((len(s) for s in sampling_params.stop), default=0)
        self.return_logprob = return_logprob
        self.top_logprobs_num = top_logprobs_num if return_logprob else 0
        self.output_token_logprobs: list[float] = []  # with return_logprob: one per output id
        self.output_top_logprobs: list[list[tuple[int, float]]] = []
        # Input logprobs of prompt positions [logprob_start_len, n) (-1: none). Position 0 has no context.
        self.logprob_start_len = logprob_start_len if return_logprob else -1
        self.input_token_logprobs: list[float | None] = [None] if self.logprob_start_len == 0 else []
        self.input_top_logprobs: list[list[tuple[int, float]]] = [[]] if self.logprob_start_len == 0 else []
        self.input_logprob_next = max(self.logprob_start_len, 1)  # next prompt position a forward will score
        self.input_logprobs_sent = False
        self.penalty_reset = False  # a new row: its penalty history must be rebuilt in the next forward
        # KV bookkeeping (read and written by the radix cache as well).
        self.req_pool_idx: int | None = None
        self.prefix_indices: torch.Tensor = _EMPTY_INDICES
        self.last_node: Any = None
        self.cache_protected_len = 0  # NOTE: row positions [0, cpl) belong to the tree, never freed by us
        self.kv_committed_len = 0
        self.kv_allocated_len = 0
        self.extend_input_len = 0
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
        return (f"Req(rid={self.rid!r}, input={len(self.origin_input_ids)}, output={len(self.output_ids)}, "
                f"row={self.req_pool_idx}, cpl={self.cache_protected_len}, kv={self.kv_allocated_len})")

    @property
    def seqlen(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def wants_input_logprobs(self) -> bool:
        """Some prompt position still has to be scored by a forward."""
        return self.logprob_start_len >= 0 and self.input_logprob_next < len(self.origin_input_ids)

    def input_logprobs_complete(self) -> bool:
        return self.logprob_start_len >= 0 and len(self.input_token_logprobs) == (
            len(self.origin_input_ids) - self.logprob_start_len)

    def init_next_round_input(self, tree_cache: Any = None) -> None:
        """Set `fill_ids` to the whole sequence; with a tree, re-match the prefix (limit: all but one token)."""
        self.fill_ids = self.origin_input_ids + self.output_ids
        if tree_cache is not None:
            # NOTE: at least one token is always computed, so the forward has logits to sample from.
            limit = max(len(self.fill_ids) - 1, 0)
            if self.wants_input_logprobs:
                # NOTE: the logits at position p score prompt token p + 1, and a cached prefix has no
                # logits: positions from input_logprob_next - 1 on are computed, never matched.
                limit = min(limit, self.input_logprob_next - 1)
            match = kv_ops.match_prefix(tree_cache, self.fill_ids[:limit], self.extra_key)
            self.prefix_indices, self.last_node = match.device_indices, match.last_node
            self.cache_protected_len = len(self.prefix_indices)
        self.extend_input_len = len(self.fill_ids) - len(self.prefix_indices)

    def forget_prefix_match(self) -> None:
        """Drop an unlocked match (a waiting request's): it must never be released like a held lock."""
        self.prefix_indices = _EMPTY_INDICES
        self.last_node = None
        self.cache_protected_len = 0

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
        """Forget all KV (already released); keep the outputs so the request resumes where it was."""
        self.prefix_indices = _EMPTY_INDICES
        self.last_node = None
        self.cache_protected_len = 0
        self.kv_committed_len = 0
        self.kv_allocated_len = 0
        self.extend_input_len = 0
        self.req_pool_idx = None
        self.is_chunked = 0
        self.is_retracted = True
        self.retracted_stain = True
        self.retraction_count += 1
        if self.logprob_start_len >= 0:
            # NOTE: under overlap the prefill that scored the prompt may still be in flight; its result is
            # dropped with the retraction, so scoring resumes after what has really arrived.
            self.input_logprob_next = max(self.logprob_start_len + len(self.input_token_logprobs), 1)


class ScheduleBatch:
    """A set of requests run by one forward. The running (decode) batch is one long-lived instance."""

    def __init__(self, reqs: list[Req], req_to_token_pool: Any, allocator: Any, tree_cache: Any,
                 device: torch.device | str = "cpu", page_size: int = 1, stats: Any = None) -> None:
        self.reqs = reqs
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.tree_cache = tree_cache
        self.device = torch.device(device)
        self.page_size = page_size
        self.stats = stats  # SchedulerStats or None; eviction counts go there
        self.forward_mode = ForwardMode.IDLE
        self.forward_batch: ForwardBatch | None = None
        self.prefill_new_tokens = 0  # Σ extend lengths of a prefill batch, for logs and counters
        self.prefill_cached_tokens = 0

    def empty_copy(self, reqs: list[Req] | None = None) -> ScheduleBatch:
        return ScheduleBatch(reqs or [], self.req_to_token_pool, self.allocator, self.tree_cache,
                             self.device, self.page_size, self.stats)

    def is_empty(self) -> bool:
        return not self.reqs

    def batch_size(self) -> int:
        return len(self.reqs)

    # ---- prefill --------------------------------------------------------------------------------
    def prepare_for_extend(self) -> ForwardBatch:
        """Allocate rows and KV slots for each request's `fill_ids[len(prefix):]`, write the rows."""
        self.forward_mode = ForwardMode.EXTEND
        reqs = self.reqs
        self._alloc_rows([r for r in reqs if r.req_pool_idx is None])
        prefix_lens = [len(r.prefix_indices) for r in reqs]
        seq_lens = [len(r.fill_ids) for r in reqs]
        extend_lens = [s - p for s, p in zip(seq_lens, prefix_lens, strict=True)]
        out_cache_loc = kv_ops.alloc_for_extend(self, prefix_lens, seq_lens)
        offset = 0
        for req, pre, seq in zip(reqs, prefix_lens, seq_lens, strict=True):
            table = self.req_to_token_pool.req_to_token
            if pre:
                table[req.req_pool_idx, :pre] = req.prefix_indices.to(table.device, table.dtype)
            table[req.req_pool_idx, pre:seq] = out_cache_loc[offset:offset + seq - pre].to(table.device, table.dtype)
            offset += seq - pre
            req.kv_committed_len = req.kv_allocated_len = seq
            self._count_cached_tokens(req, pre, seq)
        self.prefill_new_tokens = sum(extend_lens)
        input_ids = [t for r, p in zip(reqs, prefix_lens, strict=True) for t in r.fill_ids[p:]]
        rows = [r.req_pool_idx for r in reqs]
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
        fb.extra_top_k = max(r.top_logprobs_num for r, n in zip(self.reqs, counts, strict=True) if n)
        fb.input_logprob_counts = counts

    @staticmethod
    def _count_cached_tokens(req: Req, prefix_len: int, seq_len: int) -> None:
        # NOTE: counted once, at the first prefill; chunk continuations add 0, re-prefills after retraction nothing.
        if not req.retracted_stain:
            req.cached_tokens += max(prefix_len - req.already_computed, 0)
            req.already_computed = seq_len

    def _alloc_rows(self, reqs: list[Req]) -> None:
        if not reqs:
            return
        rows = self.req_to_token_pool.alloc(len(reqs))
        if rows is None:
            raise RuntimeError(f"no free request row for {len(reqs)} request(s): the admission budget was wrong")
        for req, row in zip(reqs, rows, strict=True):
            req.req_pool_idx = row
            req.penalty_reset = True

    # ---- decode ---------------------------------------------------------------------------------
    def prepare_for_decode(self) -> ForwardBatch:
        """One new slot per request for its last sampled token, written at row position `kv_committed_len`."""
        self.forward_mode = ForwardMode.DECODE
        reqs = self.reqs
        out_cache_loc = kv_ops.alloc_for_decode(self)
        table = self.req_to_token_pool.req_to_token
        for i, req in enumerate(reqs):
            # NOTE: before this step the last output token has no KV: kv_committed_len == seqlen - 1.
            table[req.req_pool_idx, req.kv_committed_len] = out_cache_loc[i].to(table.device, table.dtype)
            req.kv_committed_len += 1
            req.kv_allocated_len += 1
        # NOTE: under overlap the newest token may still be in flight (-1 here); the forward resolves it on
        # the device from the FutureMap (scheduler_overlap.py).
        input_ids = [r.output_ids[-1] if r.output_ids else -1 for r in reqs]
        seq_lens = [r.kv_committed_len for r in reqs]
        self.forward_batch = ForwardBatch.for_decode(input_ids, [r.req_pool_idx for r in reqs], seq_lens,
                                                     out_cache_loc, self.device)
        return self.forward_batch

    def decode_tokens_needed(self, reqs: list[Req] | None = None) -> int:
        reqs = self.reqs if reqs is None else reqs
        if self.page_size == 1:
            return len(reqs)
        return self.page_size * sum(1 for r in reqs if r.kv_committed_len % self.page_size == 0)

    def check_decode_mem(self, reqs: list[Req] | None = None) -> bool:
        """Evict the shortfall, then say whether the next decode step's slots are available."""
        needed = self.decode_tokens_needed(reqs)
        kv_ops.evict_from_tree_cache(self, needed)
        return self.allocator.available_size() >= needed

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
            kv_ops.release(req, self.tree_cache, is_insert=False)
            req.reset_for_retract()
            kv_ops.evict_from_tree_cache(self, len(remaining) * RETRACT_DECODE_STEPS)
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
    resets = [(r.req_pool_idx, r.origin_input_ids, list(r.output_ids)) for r in reqs
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
        rows=torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64, device=device),
        frequency=column([p.frequency_penalty for p in params]),
        presence=column([p.presence_penalty for p in params]),
        repetition=column([p.repetition_penalty for p in params]),
        use_history=any(p.uses_history for p in params), resets=resets,
        record=torch.tensor(record, dtype=torch.bool, device=device), banned=banned, bias=bias)
