"""What the scheduler needs of a drafter: the seam where another way of drafting plugs in.

The decode planner asks `propose(req)` for each running request before a decode step; a non-empty answer
makes the step a verify step (verify.py). Everything after the draft is shared by every drafter: the verify
rows, acceptance (greedy or speculative sampling), the KV of rejected tokens, the figures on `req.spec`
(a `SpecState`, which the output processor records into). `NgramDrafter` (ngram.py) is the one shipped; an
EAGLE head or a small draft model would keep its own KV (its own pool and tree; an EAGLE draft's tree in the
bigram view, `RadixCache(is_eagle=True)`) and draft from its forward.
"""

from __future__ import annotations

from typing import Any, Protocol


class Drafter(Protocol):
    config: Any  # a SpecConfig: the decode planner reads max_verify_rows
    cost: Any  # a StepCost (cost.py): the output processor records each decode step's rows and time

    def propose(self, req: Any) -> list[int]:
        """Up to the request's draft length of tokens to verify after its last one; [] for none. Must leave
        `req.spec` set (a SpecState) when it returns a draft."""
        ...
