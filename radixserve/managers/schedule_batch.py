"""Batches: the sets of requests (req.py) that run one forward.

A `ScheduleBatch` is a set of requests that turns into one `ForwardBatch`:
`prepare_for_extend` asks the manager for rows and slots of a prefill, `prepare_for_decode` for one
slot per request.
"""

from __future__ import annotations

import torch

from radixserve.forward_batch import ForwardBatch, ForwardMode
from radixserve.layers.penalties import PenaltyBatchInfo
from radixserve.managers.req import FinishReason, Req, ReqPhase
from radixserve.mem_cache.kv_manager import KVManager

# SGLang's SGLANG_RETRACT_DECODE_STEPS: after a retraction, free room for this many decode steps per survivor.
RETRACT_DECODE_STEPS = 20

__all__ = ["RETRACT_DECODE_STEPS", "FinishReason", "Req", "ReqPhase", "ScheduleBatch", "penalty_info"]


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
            req.start_running()
            self._count_cached_tokens(req, pre, seq)
        self.prefill_new_tokens = sum(extend_lens)
        input_ids = [t for r, p in zip(reqs, prefix_lens, strict=True) for t in r.fill_ids[p:]]
        rows = [r.kv.req_pool_idx for r in reqs]
        self.forward_batch = ForwardBatch.for_extend(input_ids, rows, prefix_lens, extend_lens,
                                                     out_cache_loc, self.device)
        self.forward_batch.lora_adapters = lora_adapters(reqs)
        if any(r.embed is not None for r in reqs):  # NOTE: the model pools their final hidden states too
            self.forward_batch.pooling = [r.embed for r in reqs]
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

    def _count_cached_tokens(self, req: Req, prefix_len: int, seq_len: int) -> None:
        # NOTE: counted once, at the first prefill; chunk continuations add 0, re-prefills after retraction nothing.
        if not req.retracted_stain:
            req.cached_tokens += max(prefix_len - req.already_computed, 0)
            req.already_computed = seq_len
            req.cached_tokens_details = self.kv_manager.cached_by_tier(req.kv, req.cached_tokens)

    # ---- decode ---------------------------------------------------------------------------------
    def prepare_for_decode(self) -> ForwardBatch:
        """One new slot per request, for the last sampled token (its input ids are resolved on the device)."""
        self.forward_mode = ForwardMode.DECODE
        reqs = self.reqs
        out_cache_loc = self.kv_manager.alloc_decode(reqs)
        seq_lens = [r.kv.kv_allocated_len for r in reqs]
        fb = ForwardBatch.for_decode(None, [r.kv.req_pool_idx for r in reqs], seq_lens, out_cache_loc, self.device)
        fb.host_input_ids = self._forced_inputs(seq_lens)
        fb.lora_adapters = lora_adapters(reqs)
        self.forward_batch = fb
        return fb

    def inputs_on_host(self) -> bool:
        """Whether the host knows every request's next input token (position `kv_allocated_len`): always in the
        normal loop; under overlap not for a request whose last sample is still in flight."""
        return all(r.kv.kv_allocated_len < r.seqlen for r in self.reqs)

    def prepare_for_verify(self, drafts: list[list[int]]) -> ForwardBatch:
        """A decode step whose requests with a draft run one row per token: the last sampled one, then the draft
        (speculative/verify.py). Every input token must be known on the host (`inputs_on_host`)."""
        from radixserve.speculative.verify import VerifyInput

        self.forward_mode = ForwardMode.DECODE
        reqs = self.reqs
        if not self.inputs_on_host():
            # NOTE: checked before anything is allocated: a refused verify step holds no slot
            lagging = [r.rid for r in reqs if r.kv.kv_allocated_len >= r.seqlen]
            raise RuntimeError(f"a verify step needs every input token on the host; {lagging[:4]} lag")
        base = [r.kv.kv_allocated_len for r in reqs]
        # NOTE: the slots come flat in request order, one per row
        slots = self.kv_manager.alloc_extend(reqs, [b + 1 + len(d) for b, d in zip(base, drafts, strict=True)])
        inputs, rows, seq_lens = [], [], []
        for req, b, draft in zip(reqs, base, drafts, strict=True):
            # NOTE: the token at position b: the last one, or a jump-forward's forced token being fed
            prompt = len(req.origin_input_ids)
            inputs.extend([req.origin_input_ids[b] if b < prompt else req.output_ids[b - prompt], *draft])
            rows.extend([req.kv.req_pool_idx] * (1 + len(draft)))
            seq_lens.extend(range(b + 1, b + 2 + len(draft)))
        fb = ForwardBatch.for_decode(inputs, rows, seq_lens, slots, self.device)
        fb.verify = VerifyInput(drafts, base)
        fb.lora_adapters = lora_adapters(reqs)
        self.forward_batch = fb
        return fb

    def _forced_inputs(self, seq_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The rows whose input token (position seq_len - 1) the host knows: every row in the normal loop, and
        under overlap the rows fed a jump-forward's forced tokens, whose previous sample was dropped
        (Req.samples_next); the others take the in-flight sample from the FutureMap."""
        fed = [(i, r.output_ids[s - 1 - len(r.origin_input_ids)]) for i, (r, s) in enumerate(zip(self.reqs, seq_lens,
                                                                                              strict=True))
               if s <= r.seqlen]
        if not fed:
            return None
        as_long = lambda xs: torch.tensor(xs, dtype=torch.int64, device=self.device)  # noqa: E731
        return as_long([i for i, _ in fed]), as_long([t for _, t in fed])

    def sampled_rows(self) -> tuple[list[Req], list[int]]:
        """The request of each row the forward samples, and the output index of that row's token.

        NOTE: under overlap the host's output_ids lag one step, the allocated length does not (0 for a
        non-final chunk, whose token is dropped). A verify step samples after every row of a draft."""
        reqs = self.reqs
        verify = self.forward_batch.verify if self.forward_batch is not None else None
        if verify is None:
            return reqs, [max(r.kv.kv_allocated_len - len(r.origin_input_ids), 0) for r in reqs]
        rows, lens = [], []
        for req, base, n in zip(reqs, verify.base_lens, verify.row_counts, strict=True):
            first = base + 1 - len(req.origin_input_ids)
            rows.extend([req] * n)
            lens.extend(range(first, first + n))
        return rows, lens

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


def lora_adapters(reqs: list[Req]) -> list | None:
    """Each request's LoRA adapter for the forward, or None when every request runs the base model."""
    adapters = [r.lora for r in reqs]
    return adapters if any(a is not None for a in adapters) else None


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
    # NOTE: nor a decode step's sample dropped while a jump-forward's forced tokens are fed (Req.samples_next).
    record = [r.samples_next(len(r.fill_ids) if is_extend else r.kv.kv_allocated_len) for r in reqs]

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)

    return PenaltyBatchInfo(
        rows=torch.tensor([r.kv.req_pool_idx for r in reqs], dtype=torch.int64, device=device),
        frequency=column([p.frequency_penalty for p in params]),
        presence=column([p.presence_penalty for p in params]),
        repetition=column([p.repetition_penalty for p in params]),
        use_history=any(p.uses_history for p in params), resets=resets,
        record=torch.tensor(record, dtype=torch.bool, device=device), banned=banned, bias=bias)
