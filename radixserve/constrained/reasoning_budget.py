"""Reasoning budgets on the scheduler side: a request whose think block is still open once it has generated
its budget of tokens (`SamplingParams.reasoning_budget`, a `ThinkBudget`) gets the closing tag's tokens
appended as forced tokens, the way a grammar's jump-forward appends its (constrained/jump_forward.py: the
decode planner computes their KV by one extend or feeds them through decode steps; each has logprob 0).

The decision is taken once per request, when its output first reaches the budget: the output is decoded and
read by the style's `ReasoningParser` (started inside the block, or the block opened at the start of the
output); a block still open is closed, one already closed (or never opened) is left alone. Like a jump, it is
a function of the tokens alone, so both loops and a retracted request force at the same point.
"""

from __future__ import annotations

import weakref
from typing import Any

from radixserve.function_call.reasoning import ReasoningParser, closing_tag_ids


class ReasoningBudgets:
    """Which requests have had their budget decided (weakly, by request), and each style's closing tokens."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._decided: weakref.WeakSet[Any] = weakref.WeakSet()
        self._closing: dict[str, list[int]] = {}
        self.forced_closes = 0  # requests whose think block a budget ended

    def forced_tokens(self, req: Any) -> list[int]:
        """The closing tag's tokens when `req` has just spent its reasoning budget inside an open think block
        (and its grammar, if any, accepts them, and `max_new_tokens` leaves room for them and one token
        more); else []."""
        budget = req.sampling_params.reasoning_budget
        if (budget is None or self.tokenizer is None or req in self._decided or req.finished()
                or req.to_abort is not None or len(req.output_ids) < budget.tokens):
            return []
        self._decided.add(req)  # NOTE: decided once: later steps never force again
        parser = ReasoningParser(budget.style, started_in_prompt=budget.started_in_prompt)
        parser.feed(self.tokenizer.decode(req.output_ids, skip_special_tokens=False))
        if not parser.in_reasoning:  # NOTE: closed already, or no block at all (qwen3 without <think>)
            return []
        ids = self._closing.get(budget.style)
        if ids is None:
            ids = self._closing[budget.style] = closing_tag_ids(budget.style, self.tokenizer)
        if not ids or len(req.output_ids) + len(ids) >= req.max_new_tokens:
            return []  # NOTE: no room for the whole tag and a token after it: the length limit ends it
        if req.grammar is not None and not _accepted(req.grammar.matcher, ids):
            return []
        self.forced_closes += 1
        return list(ids)


def _accepted(matcher: Any, ids: list[int]) -> bool:
    """Whether the grammar's matcher accepts every one of `ids` (then they are accepted; else none is)."""
    accepted = 0
    for token in ids:
        if not matcher.accept_token(token):
            break
        accepted += 1
    if accepted == len(ids):
        return True
    if accepted:
        matcher.rollback(accepted)
    return False
