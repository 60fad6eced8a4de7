"""A verify forward and its acceptance rule.

A request with draft d1..dk runs k + 1 rows of one decode-shaped forward: its last sampled token and
the draft, at consecutive positions, each row attending over the request's row of `req_to_token` up to
its own position. Every row's K/V is written before any row attends (decode attention and the C decode
step both do), so row i sees the draft tokens before it: a causal chain in a decode batch, with no new
attention kernel. Requests without a draft run their usual single row in the same forward.

Acceptance keeps the longest draft prefix equal to the token the target chose at each row, plus the target's
own token after it. Greedy rows choose the argmax, so the output is the one plain greedy decoding produces;
sampled rows choose by speculative sampling (layers/sampler.py: keep the draft token d with probability p(d),
else sample p without d), so each token is distributed exactly as without speculation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class VerifyInput:
    """What a verify forward carries besides its ForwardBatch, per request in batch order."""

    drafts: list[list[int]]
    base_lens: list[int]  # tokens with KV before this forward: the first row's position

    @property
    def row_counts(self) -> list[int]:
        return [1 + len(d) for d in self.drafts]

    def row_offsets(self) -> list[int]:
        offsets, at = [], 0
        for n in self.row_counts:
            offsets.append(at)
            at += n
        return offsets

    def draft_ids(self, device: torch.device | str) -> torch.Tensor:
        """Per row, the draft token its sample decides on (the next row's input); -1 on each request's last row."""
        ids = [t for draft in self.drafts for t in (*draft, -1)]
        return torch.tensor(ids, dtype=torch.int64, device=device)

    def row_prefixes(self) -> list[list[int] | None]:
        """Per row, the draft tokens before it (the state its sample is taken in differs from the request's by
        them) for requests that drafted; None on the single row of a request without a draft."""
        out: list[list[int] | None] = []
        for draft in self.drafts:
            out.extend([draft[:j] for j in range(len(draft) + 1)] if draft else [None])
        return out

    def last_rows(self, device: torch.device | str) -> torch.Tensor:
        """Each request's last row (its next input is sampled there when nothing is accepted beyond it)."""
        return torch.tensor([o + n - 1 for o, n in zip(self.row_offsets(), self.row_counts, strict=True)],
                            dtype=torch.int64, device=device)


def accept_greedy(draft: Sequence[int], targets: Sequence[int]) -> list[int]:
    """The tokens a verify step yields: the draft's longest prefix matching `targets` (the argmax after each
    row), then the target's token after it. `targets` has one more entry than `draft`."""
    accepted = 0
    while accepted < len(draft) and draft[accepted] == targets[accepted]:
        accepted += 1
    return [*draft[:accepted], targets[accepted]]


def attach_drafts(info: Any, verify: VerifyInput, device: torch.device | str) -> None:
    """Give a verify batch's sampling info its drafts: the token each row's sample decides on (speculative
    sampling), and for the penalties the draft tokens before each row. A drafting row's sample is not recorded
    in the penalty history on the device: the request's history is rebuilt from the host's tokens, which hold
    exactly the accepted ones (Req.penalties_after_verify)."""
    info.draft_ids = verify.draft_ids(device)
    info.verify = verify
    penalties = info.penalties
    if penalties is None:
        return
    rows, tokens, keep = [], [], []
    for row, prefix in enumerate(verify.row_prefixes()):
        keep.append(prefix is None)
        for token in prefix or ():
            rows.append(row)
            tokens.append(token)
    penalties.drafted = (rows, tokens)
    penalties.record = penalties.record & torch.tensor(keep, dtype=torch.bool, device=penalties.record.device)
