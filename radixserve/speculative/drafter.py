"""What the scheduler needs of a drafter, the seam where another way of drafting plugs in, and the batch's
draft policy that every drafter shares.

The decode planner asks `batch_drafts` before a decode step, which asks `propose(req)` for each running
request, keeps the drafts whose rows pay (cost.py) and cuts them to the row limit; a non-empty answer makes
the step a verify step (verify.py). Everything after the draft is shared by every drafter: the verify
rows, acceptance (greedy or speculative sampling), the KV of rejected tokens, the figures on `req.spec`
(a `SpecState`, which the output processor records into). Two are shipped: `NgramDrafter` (ngram.py) and
`DraftModelDrafter` (draft_model.py: a smaller model of the same vocabulary, with its own KV pool). An EAGLE
head would plug in like the draft model (its KV keyed by the bigram view, `RadixCache(is_eagle=True)`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from radixserve.speculative.cost import beats_plain


class Drafter(Protocol):
    config: Any  # a SpecConfig: the decode planner reads max_verify_rows
    cost: Any  # a StepCost (cost.py): the output processor records each decode step's rows and time

    def prepare(self, reqs: Sequence[Any]) -> None:
        """Called once per verify-eligible decode step before the batch's `propose` calls: a drafter that runs a
        model drafts the whole batch here, in batched forwards over its own KV (draft_model.py)."""
        ...

    def release_all(self) -> None:
        """The scheduler went idle: release whatever the drafter keeps per request (a draft model's KV)."""
        ...

    def propose(self, req: Any) -> list[int]:
        """Up to the request's draft length of tokens to verify after its last one; [] for none. Must leave
        `req.spec` set (a SpecState) when it returns a draft."""
        ...

    def draft_length(self, req: Any) -> int:
        """How many tokens the request may draft now (its adaptive budget, its room); 0 when it cannot."""
        ...

    def paused(self, reqs: Sequence[Any]) -> bool:
        """True when no request of the batch will draft this step whatever its latest token (read-only)."""
        ...

    def tick(self, reqs: Sequence[Any]) -> None:
        """Called once per decode step of the batch, before `propose`."""
        ...


def batch_drafts(drafter: Drafter, reqs: Sequence[Any]) -> list[list[int]]:
    """Each request's draft for the next step: proposed, kept only where its rows pay (`worth_rows`), cut to the
    row limit (`fit_rows`): the model's fast rows where a step cut to them yields more tokens a second
    (`row_limit`), else `max_verify_rows`."""
    cost = drafter.cost
    if not could_pay(drafter, reqs):
        return [[] for _ in reqs]
    threshold = cost.row_value_threshold(len(reqs))
    drafter.prepare(reqs)
    drafts = [worth_rows(within_grammar(drafter.propose(r), r), r, threshold) for r in reqs]
    return fit_rows(drafts, reqs, row_limit(cost, drafts, reqs, drafter.config.max_verify_rows))


def could_pay(drafter: Drafter, reqs: Sequence[Any]) -> bool:
    """False when the batch fills the fast rows (no room for a draft there) and no set of its requests, each drafting
    its full length at the share of draft tokens its verify steps measured, would yield more tokens a second than
    a plain step: then nobody proposes (no n-gram lookups, no draft forwards) and the step decodes plainly. Taking
    requests best-measured first, the best set is a prefix of that order, so the prefixes are all that is tried."""
    cost, batch = drafter.cost, len(reqs)
    if cost.fast_rows is None or batch < cost.fast_rows:
        return True
    plain = cost.step_seconds(batch)
    candidates = [(r.spec.budget.measured_rate(), n) for r in reqs if (n := drafter.draft_length(r)) > 0]
    if plain is None or not candidates:
        return plain is None
    rows, expected = batch, 0.0
    for rate, n in sorted(candidates, reverse=True):
        rows, expected = rows + n, expected + rate * n
        seconds = cost.step_seconds(rows)
        if seconds is None or beats_plain(batch, expected, plain, seconds):
            return True
    return False


def row_limit(cost: Any, drafts: list[list[int]], reqs: Sequence[Any], max_rows: int) -> int:
    """`cost.fast_rows` or `max_rows`: the limit whose verify step yields more tokens a second, by the measured
    step times on each side of the fast rows and each request's share of draft tokens lately accepted. A side
    not yet measured is tried first (the far side first: the choice without a fast path)."""
    fast, batch = cost.fast_rows, len(reqs)
    # NOTE: only a choice when the plain step is fast and the drafts would take it past the fast rows
    if fast is None or not batch <= fast < min(max_rows, batch + sum(map(len, drafts))):
        return max_rows

    def tokens_per_second(limit: int) -> float | None:
        cut = fit_rows(drafts, reqs, limit)
        seconds = cost.step_seconds(batch + sum(map(len, cut)))
        if seconds is None:
            return None
        expected = sum(r.spec.budget.measured_rate() * len(d) for r, d in zip(reqs, cut, strict=True) if d)
        return (batch + expected) / seconds

    far = tokens_per_second(max_rows)
    if far is None:
        return max_rows
    near = tokens_per_second(fast)
    return fast if near is None or near >= far else max_rows


def within_grammar(draft: list[int], req: Any) -> list[int]:
    """The draft up to its first token the request's grammar refuses (every drafter's draft goes through this)."""
    if draft and req.grammar is not None:
        return draft[: req.grammar.allowed_prefix(draft)]
    return draft


def fit_rows(drafts: list[list[int]], reqs: Sequence[Any], max_rows: int) -> list[list[int]]:
    """The drafts cut so that requests plus draft tokens stay within `max_rows`, the room going first to the
    requests whose drafts were accepted most lately (SpecState's budget; a request not yet verified counts as
    fully accepted, so that it is tried)."""
    room = max_rows - len(drafts)
    if sum(map(len, drafts)) <= room:
        return drafts

    def accepted(i: int) -> float:
        budget = reqs[i].spec.budget
        return budget.mean_accepted if budget.mean_accepted >= 0 else budget.max_tokens

    order = sorted((i for i in range(len(drafts)) if drafts[i]), key=accepted, reverse=True)
    out = [[] for _ in drafts]
    for i in order:
        out[i] = drafts[i][: max(room, 0)]
        room -= len(out[i])
    return out


def worth_rows(draft: list[int], req: Any, threshold: float) -> list[int]:
    """The draft, when the request's draft rows pay for themselves (speculative/cost.py): the share of its draft
    tokens lately accepted (accepted tokens come in runs, so the measured share, not a per-token guess) must
    exceed the acceptance a row needs here. A request whose draft is dropped drifts back toward the optimistic
    rate, so that it is probed again: text changes, and a rate never tested never moves."""
    if not draft or threshold <= 0.0:
        return draft
    budget = req.spec.budget
    if budget.recent_rate() > threshold:
        return draft
    budget.drift_toward_prior()
    return []


def make_drafter(config: Any, context_len: int, tree: Any, fast_rows: int | None, args: Any, runner: Any) -> Any:
    """The drafter `config` asks for (None when speculation is off): n-gram drafts over the radix tree, or a draft
    model loaded beside `runner` (the target's ModelRunner) with pools of its own."""
    if config is None:
        return None
    if config.algorithm == "standalone":
        from radixserve.speculative.draft_model import DraftModelDrafter, load_draft_runner

        return DraftModelDrafter(config, context_len, load_draft_runner(args, runner, config), fast_rows)
    from radixserve.speculative.ngram import NgramDrafter

    return NgramDrafter(config, context_len, tree, fast_rows)
