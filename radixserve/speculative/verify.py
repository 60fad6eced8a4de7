"""A verify forward and its acceptance rule.

A request with draft d1..dk runs k + 1 rows of one decode-shaped forward: its last sampled token and
the draft, at consecutive positions, each row attending over the request's row of `req_to_token` up to
its own position. Every row's K/V is written before any row attends (decode attention and the C decode
step both do), so row i sees the draft tokens before it: a causal chain in a decode batch, with no new
attention kernel. Requests without a draft run their usual single row in the same forward.

Greedy acceptance keeps the longest draft prefix equal to the target's argmax at each row, plus the
target's own token after it: the output is the one plain greedy decoding produces.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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
