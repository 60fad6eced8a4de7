"""Logit processing before sampling: frequency / presence / repetition penalties, min_new_tokens, logit_bias.

Penalties need each request's token history. It lives on the device, one row per `ReqToTokenPool`
row (allocated on first use): `counts` (how often each token was generated) and `seen` (the prompt
and generated tokens, for the repetition penalty). Rows are rebuilt from the host's exact history
when a request (re)starts its prefill, and every kept sample is recorded after sampling, on the same
stream as the forward, so the overlap loop needs no host round trip.

* frequency / presence (OpenAI): logit -= frequency * count + presence * (count > 0)
* repetition (CTRL, as SGLang and transformers): a seen token's logit is divided by the penalty
  when positive, multiplied when negative
* min_new_tokens: EOS and stop token ids are banned until that many tokens were generated
* logit_bias (OpenAI): added to the logits of the given token ids
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PenaltyBatchInfo:
    """One batch's logit processing, built by the scheduler after the batch's KV rows are assigned."""

    rows: torch.Tensor  # int64 [bs]: each request's ReqToTokenPool row
    frequency: torch.Tensor  # float32 [bs, 1]
    presence: torch.Tensor  # float32 [bs, 1]
    repetition: torch.Tensor  # float32 [bs, 1]; 1.0 = off
    use_history: bool  # some request has a frequency, presence or repetition penalty
    resets: list[tuple[int, list[int], list[int]]]  # (row, prompt ids, output ids): rebuild before use
    record: torch.Tensor  # bool [bs]: this step's sample is kept (not a non-final prefill chunk)
    banned: tuple[list[int], list[int]]  # (batch index, token id) pairs set to -inf (min_new_tokens)
    bias: tuple[list[int], list[int], list[float]]  # (batch index, token id, value) added (logit_bias)
    # Speculative decoding: (batch index, token id) of the draft tokens before a verify row, which its history
    # counts as if generated (the request's own row history has not seen them yet)
    drafted: tuple[list[int], list[int]] = ([], [])


class PenaltyState:
    """Per-row token history on the device, allocated at the first batch that needs it."""

    def __init__(self, num_rows: int) -> None:
        self.num_rows = num_rows
        self.counts: torch.Tensor | None = None  # int32 [rows, vocab]
        self.seen: torch.Tensor | None = None  # bool [rows, vocab]

    def process(self, logits: torch.Tensor, info: PenaltyBatchInfo) -> torch.Tensor:
        """Penalized float32 logits (a new tensor); `logits` itself is left as it was."""
        logits = logits.float().clone()
        if info.use_history:
            self._ensure(logits.shape[-1], logits.device)
            self._reset(info.resets)
            counts = self.counts[info.rows].float()
            seen = self.seen[info.rows]
            if info.drafted[0]:
                index = (_long(info.drafted[0], logits.device), _long(info.drafted[1], logits.device))
                counts.index_put_(index, torch.ones(len(info.drafted[0]), device=logits.device), accumulate=True)
                seen[index] = True
            logits -= info.frequency * counts + info.presence * (counts > 0)
            scaled = torch.where(logits > 0, logits / info.repetition, logits * info.repetition)
            logits = torch.where(seen, scaled, logits)
        rows, tokens, values = info.bias
        if rows:
            index = (_long(rows, logits.device), _long(tokens, logits.device))
            logits.index_put_(index, torch.tensor(values, dtype=logits.dtype, device=logits.device), accumulate=True)
        rows, tokens = info.banned
        if rows:
            logits[_long(rows, logits.device), _long(tokens, logits.device)] = float("-inf")
        return logits

    def record(self, next_ids: torch.Tensor, info: PenaltyBatchInfo) -> None:
        """Count this step's kept samples (on the forward's stream, after sampling)."""
        if not info.use_history or self.counts is None:
            return
        rows, ids = info.rows[info.record], next_ids[info.record]
        self.counts.index_put_((rows, ids), torch.ones_like(ids, dtype=self.counts.dtype), accumulate=True)
        self.seen[rows, ids] = True

    def _ensure(self, vocab: int, device: torch.device) -> None:
        if self.counts is None:
            self.counts = torch.zeros(self.num_rows, vocab, dtype=torch.int32, device=device)
            self.seen = torch.zeros(self.num_rows, vocab, dtype=torch.bool, device=device)

    def _reset(self, resets: list[tuple[int, list[int], list[int]]]) -> None:
        # NOTE: a row is rebuilt in the forward that first uses it, on the forward's stream, so a
        # forward still in flight for the row's previous owner can never write into the new history.
        device = self.counts.device
        for row, prompt_ids, output_ids in resets:
            outputs = _long(output_ids, device)
            self.counts[row] = torch.bincount(outputs, minlength=self.counts.shape[1])[: self.counts.shape[1]]
            self.seen[row] = False
            self.seen[row, _long(prompt_ids + output_ids, device)] = True


def _long(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)
