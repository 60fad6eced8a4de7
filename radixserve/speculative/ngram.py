"""N-gram drafts: the continuation of the latest earlier occurrence of a request's last n tokens.

Agents, code edits and retrieval answers copy long spans of their input; where a request's last n
tokens (n from `max_match` down to `min_match`, longest first) occurred before in its prompt or
output, the tokens that followed them there are a cheap guess of what comes next. `NgramIndex` keeps,
per request, the latest end position of every n-gram seen so far, updated as tokens arrive (a dict
probe per n per step, no scan). `DraftBudget` shrinks a request's draft length when little of it is
accepted and pauses drafting when nothing is, so text that does not repeat pays almost nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from radixserve.configs.speculative import SpecConfig
from radixserve.speculative.cost import StepCost, accept_length, accept_rate
from radixserve.speculative.tree_draft import tree_continuation

UNKNOWN_RATE = 0.8  # a request's draft-token acceptance before it verified any draft (optimistic: it gets tried)
RELAX = 0.1  # each step a request's draft is set aside, its rate moves this share back toward UNKNOWN_RATE
ZERO_STREAK_PAUSE = 3  # verifies in a row that accepted nothing before drafting pauses
MAX_PAUSE_STEPS = 64


class NgramIndex:
    """The latest end position of each n-gram (min_match <= n <= max_match) of one token sequence."""

    def __init__(self, min_match: int, max_match: int) -> None:
        self.sizes = range(max_match, min_match - 1, -1)  # NOTE: longest first: the most specific match wins
        self.tokens: list[int] = []
        self.ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self.indexed = 0  # end positions [1, indexed] are in the dicts

    def extend(self, tokens: Sequence[int]) -> None:
        self.tokens.extend(tokens)

    def propose(self, max_tokens: int) -> list[int]:
        """Up to `max_tokens` tokens that followed the latest earlier occurrence of the longest suffix found."""
        tokens = self.tokens
        end = len(tokens)
        self._index_until(end - 1)  # NOTE: the suffix itself (ending at `end`) must not match itself
        for n in self.sizes:
            if n > end:
                continue
            at = self.ends[n].get(tuple(tokens[end - n:]))
            if at is not None:
                return tokens[at: at + max_tokens]
        return []

    def _index_until(self, last_end: int) -> None:
        tokens = self.tokens
        for e in range(self.indexed + 1, last_end + 1):
            for n in self.sizes:
                if n <= e:
                    self.ends[n][tuple(tokens[e - n: e])] = e
        self.indexed = max(self.indexed, last_end)


@dataclass
class DraftBudget:
    """A request's adaptive draft length: about one more than it has lately had accepted."""

    max_tokens: int
    mean_accepted: float = field(default=-1.0)  # exponential mean of accepted drafts per verify; <0: none yet
    rate: float = field(default=-1.0)  # exponential mean of accepted / drafted per verify; <0: none yet
    # NOTE: `rate` also drifts back toward the prior while the request's drafts are set aside (drift_toward_prior:
    # drafter.worth_rows, DraftModelDrafter._pays), so that it is probed again; `measured` is what its verify steps
    # showed, for decisions that cost a whole step
    measured: float = field(default=-1.0)
    zero_streak: int = 0
    paused_steps: int = 0

    def next_length(self) -> int:
        if self.paused_steps > 0:
            return 0
        if self.mean_accepted < 0:
            return self.max_tokens
        return max(1, min(self.max_tokens, int(self.mean_accepted + 0.5) + 1))

    def recent_rate(self) -> float:
        """The share of the request's draft tokens lately accepted (UNKNOWN_RATE before any was verified)."""
        return UNKNOWN_RATE if self.rate < 0 else self.rate

    def measured_rate(self) -> float:
        """The share its verify steps accepted, without the drift back toward the prior that a set-aside draft
        applies (UNKNOWN_RATE before any was verified): a step past the fast rows costs the whole batch, so it is
        bought with what was measured, not with what a probe hopes (drafter.row_limit, could_pay)."""
        return UNKNOWN_RATE if self.measured < 0 else self.measured

    def drift_toward_prior(self) -> None:
        """The request's draft was set aside: its acceptance estimate moves a step back toward the optimistic prior,
        so that it is probed again (text changes, and a rate never tested never moves)."""
        rate = self.recent_rate()
        self.rate = rate + RELAX * (UNKNOWN_RATE - rate)

    def tick(self) -> None:
        """A decode step of the request's batch passed: one step less of a pause."""
        if self.paused_steps > 0:
            self.paused_steps -= 1

    def record(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        share = accepted / drafted
        self.rate = share if self.rate < 0 else 0.5 * self.rate + 0.5 * share
        self.measured = share if self.measured < 0 else 0.5 * self.measured + 0.5 * share
        mean = accepted if self.mean_accepted < 0 else 0.5 * self.mean_accepted + 0.5 * accepted
        self.mean_accepted = mean if accepted < drafted else max(mean, accepted)
        self.zero_streak = self.zero_streak + 1 if accepted == 0 else 0
        if self.zero_streak >= ZERO_STREAK_PAUSE:
            # NOTE: backs off exponentially while drafts keep failing; one accepted token resets it.
            self.paused_steps = min(2 ** (self.zero_streak - ZERO_STREAK_PAUSE + 2), MAX_PAUSE_STEPS)


@dataclass
class SpecState:
    """What speculation keeps on a request (`req.spec`): its budget, its n-gram index (None for a draft model's
    drafts), its counters."""

    index: NgramIndex | None
    budget: DraftBudget
    seen: int = 0  # tokens of prompt + output already in the index
    verify_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    def meta(self) -> dict[str, float]:
        """The request's figures in `meta_info` (SGLang's `spec_verify_ct`; the accept length counts the
        model's own token of each verify step, so it is the tokens a verify step yielded on average)."""
        steps, drafted, accepted = self.verify_steps, self.draft_tokens, self.accepted_tokens
        return {"spec_verify_ct": steps, "spec_draft_tokens": drafted, "spec_accepted_tokens": accepted,
                "spec_accept_rate": accept_rate(accepted, drafted), "spec_accept_length": accept_length(accepted, steps)}

    def record(self, drafted: int, accepted: int) -> None:
        self.verify_steps += 1
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        self.budget.record(drafted, accepted)


def can_draft(req: Any) -> bool:
    """Whether a request may take drafts this step: no jump-forward tokens wait to be fed, its grammar (if any)
    is live, and its host tokens are current (the last sampled token is known and is the only one without KV).
    Greedy and sampled requests alike (speculative sampling), penalties and logit bias included (each verify
    row is processed as if the draft tokens before it were generated: speculative/verify.attach_drafts)."""
    grammar = req.grammar
    live_grammar = grammar is None or not (grammar.rejected or grammar.is_terminated())
    return (live_grammar and not req.forced_pending
            and req.to_abort is None and req.kv.kv_allocated_len == req.seqlen - 1)


class BudgetedDrafter:
    """What every shipped drafter shares: each request's `SpecState` and adaptive draft length, pauses counted in
    decode steps, and the measured row cost (cost.py). Subclasses draft (`propose`, and `prepare` for the batch)."""

    def __init__(self, config: SpecConfig, context_len: int, fast_rows: int | None = None) -> None:
        self.config = config
        self.context_len = context_len
        # NOTE: what a verify row costs here (cost.py), on each side of the model's fast rows (the C decode
        # step's batch limit); the output processor feeds it
        self.cost = StepCost(fast_rows)

    def prepare(self, reqs: Sequence[Any]) -> None:
        """Before the batch's `propose` calls of one step (a drafter that drafts the batch at once does it here)."""

    def release_all(self) -> None:
        """The scheduler went idle: whatever the drafter holds per request can go."""

    def draft_length(self, req: Any) -> int:
        """How many tokens the request may draft now: 0 when it cannot or should not (its budget, `max_new_tokens`
        and the context: every draft is followed by one token of the target's own, and neither may pass them)."""
        if not can_draft(req):
            return 0
        room = min(req.max_new_tokens - len(req.output_ids), self.context_len - req.seqlen) - 1
        return max(min(self.state(req).budget.next_length(), room), 0)

    def paused(self, reqs: Any) -> bool:
        """Whether no request of the batch may draft this step (each has verified and its drafting is paused): then
        the step is a plain decode, and the overlap loop need not wait for the result in flight.

        NOTE: asked before the step's `tick`, which counts each pause down by one before `propose`: a request with
        one step of pause left drafts this step, so it is not paused here."""
        return all(getattr(r, "spec", None) is not None and r.spec.budget.paused_steps > 1 for r in reqs)

    def tick(self, reqs: Any) -> None:
        """Once per decode step of the batch: pauses count down in steps, whether or not drafts were asked for."""
        for req in reqs:
            state = getattr(req, "spec", None)
            if state is not None:
                state.budget.tick()

    def state(self, req: Any) -> SpecState:
        state = getattr(req, "spec", None)
        if state is None:
            state = SpecState(self.new_index(), DraftBudget(self.config.num_draft_tokens))
            req.set_spec(state)
        return state

    def new_index(self) -> NgramIndex | None:
        return None


class NgramDrafter(BudgetedDrafter):
    """Proposes each request's draft from its own prompt and output, else from what followed its whole sequence in
    the radix tree (another request's answer to the same text, in the same namespace: tree_draft.py)."""

    def __init__(self, config: SpecConfig, context_len: int, tree: Any = None, fast_rows: int | None = None) -> None:
        super().__init__(config, context_len, fast_rows)
        self.tree = tree

    def new_index(self) -> NgramIndex:
        return NgramIndex(self.config.min_match, self.config.max_match)

    def propose(self, req: Any) -> list[int]:
        """The draft of one running request (empty when it cannot or should not draft)."""
        length = self.draft_length(req)
        if length <= 0:
            return []
        state = self.state(req)
        self._catch_up(req, state)
        draft = state.index.propose(length)
        if not draft and self.tree is not None:
            draft = tree_continuation(self.tree, state.index.tokens, req.extra_key, length)
        return draft  # NOTE: cut at the first token the grammar refuses by batch_drafts (within_grammar)

    @staticmethod
    def _catch_up(req: Any, state: SpecState) -> None:
        prompt = len(req.origin_input_ids)
        if state.seen < prompt:
            state.index.extend(req.origin_input_ids[state.seen:])
            state.seen = prompt
        state.index.extend(req.output_ids[state.seen - prompt:])
        state.seen = prompt + len(req.output_ids)
