"""One batch's grammar rows: which are masked before sampling and which are checked after it.

Filling a row of the token bitmask walks the grammar over the whole vocabulary (~0.3 ms a row for a JSON
schema with a 49k vocabulary, xgrammar on one core); checking one sampled token walks it over one token
(~2 us). So a row whose sampling allows it is **sampled first and masked only if its token is refused**:
- greedy: the unmasked argmax, when the grammar allows it, is the masked argmax (no allowed token can have
  a larger logit, and none before it an equal one), so the refused rows alone are masked and argmaxed again;
- temperature sampling (no top-k, top-p or min-p): draw x from p; keep it if allowed, else draw again from p
  restricted to the allowed set A. P(a) = p(a) + (1 - p(A)) p(a) / p(A) = p(a) / p(A): exactly the masked
  distribution. The second draw takes its own uniform (a seeded row: from its seed, index and the draw).
Rows that are masked first: top-k, top-p or min-p (the filters would keep other tokens of a masked
distribution) and rows that return logprobs (theirs are the masked distribution's). Penalties and
logit_bias change logits and leave -inf alone, so they commute with the mask.

`RADIXSERVE_GRAMMAR_MASK_ALL=1` masks every row first (to compare).
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

import torch

from radixserve import envs


class RowGrammar(Protocol):
    """What sampling needs of a row's grammar (constrained/grammar_backend.Grammar)."""

    def allows(self, token: int) -> bool: ...

    def fill_row(self, bitmask: torch.Tensor, row: int) -> None: ...


def checked_after_sampling(params: Any, returns_logprobs: bool) -> bool:
    """True if a row with these sampling parameters may be sampled first and masked only on refusal."""
    if returns_logprobs or envs.GRAMMAR_MASK_ALL.get():
        return False
    return params.is_greedy or (params.top_k <= 0 and params.top_p >= 1.0 and params.min_p <= 0.0)


class BatchMask:
    """The bitmask of a batch with grammar rows, the event sampling waits on, and the rows to check after it.

    The scheduler fills it (`set_rows` once every earlier token is accepted: module docstring of
    managers/grammar_manager.py); sampling calls `apply` before it samples and `refused` after."""

    def __init__(self, bitmask: torch.Tensor, reqs: list[Any]) -> None:
        self.bitmask = bitmask  # int32 [bs, ceil(vocab / 32)], every token allowed until a row is filled
        self.reqs = reqs  # the batch's requests, row by row (the scheduler's; sampling never reads them)
        self.ready = threading.Event()
        self.masked: list[int] = []  # rows filled before sampling
        self.extra_masked: list[int] = []  # verify rows of drafting requests, filled one by one (grammar_manager)
        self.checked: list[tuple[int, RowGrammar]] = []  # rows whose sampled token is checked
        self.num_refused = 0  # of the checked rows, those masked and sampled again

    def set_rows(self, masked: list[tuple[int, RowGrammar]], checked: list[tuple[int, RowGrammar]],
                 fill: Any) -> None:
        """`fill(bitmask, masked)` fills the masked rows (one batched call); then sampling may go on."""
        try:
            if masked:
                fill(self.bitmask, masked)
            self.masked = [row for row, _ in masked]
            self.checked = checked
        finally:
            self.ready.set()

    def release(self) -> None:
        """Lets sampling go on unmasked (a dropped batch, whose result is discarded)."""
        self.ready.set()

    def apply(self, logits: torch.Tensor) -> None:
        """Waits until the rows are set, then masks the rows filled before sampling, in place."""
        self.ready.wait()
        rows = self.masked + self.extra_masked
        if rows:
            apply_rows(logits, self.bitmask, rows)

    def refused(self, next_ids: torch.Tensor) -> list[int]:
        """The checked rows whose sampled token their grammar refuses; each of them filled in the bitmask.

        NOTE: runs on the forward thread between `ready` and the batch's result; the scheduler thread touches
        a matcher only when it processes a result or fills a batch, never in that window."""
        if not self.checked:
            return []
        tokens = next_ids[[row for row, _ in self.checked]].tolist()
        refused = []
        for (row, grammar), token in zip(self.checked, tokens, strict=True):
            if not grammar.allows(token):
                grammar.fill_row(self.bitmask, row)
                refused.append(row)
        self.num_refused = len(refused)
        return refused


def apply_rows(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Masks `rows` of `logits` in place by the same rows of `bitmask`."""
    from radixserve.constrained.grammar_backend import apply_token_bitmask

    if len(rows) == logits.shape[0]:
        apply_token_bitmask(logits, bitmask)
        return
    index = torch.tensor(rows, device=logits.device)
    part = logits.index_select(0, index)
    apply_token_bitmask(part, bitmask.index_select(0, index.to(bitmask.device)))
    logits.index_copy_(0, index, part)
