"""Jump-forward: where a request's grammar allows exactly one continuation (a JSON key, punctuation, the
rest of an enum value), append it without decode steps.

Each time a sampled token is appended (the output processor, after the stop checks), a request whose grammar
now forces a string of at least `MIN_JUMP_TOKENS` tokens gets those tokens appended too (its matcher accepts
each; logprob 0, the only choice the grammar left). The decision is a function of the tokens alone, so both
loops, a request retracted on the way, and a speculative one (its verify step's accepted run ends at the first
jump point) jump at the same points and write the same tokens. Their KV is
computed one of two ways (`extends`, decided by the decode planner at the next step):
- one extend: the planner hands the request's KV to the radix tree (`release(insert=True)`, as a finished
  request's) and puts it at the front of the waiting queue; its next prefill finds everything cached and
  computes its last token and the forced ones in one forward instead of a decode step each;
- fed: it stays in the decode batch, and each decode step takes the next forced token as its input (the host
  knows it: `ScheduleBatch.prepare_for_decode`) and drops its sample, until the last forced token's step,
  whose sample is kept (`Req.samples_next`). No step of its own, for batches where an extend would stall more
  rows than it saves.
NOTE: under the overlap loop a decode step launched before the jump samples from the state before the forced
tokens; its token is dropped (`Req.samples_next`), its KV (of the token before them) kept.

The forced string is tokenized on its own, and kept only if those tokens spell exactly it after the
request's last token (no merge across the boundary, no added leading space) and the grammar accepts each;
its last token is left to the model, so the end of the forced text tokenizes as the model would write it.
"""

from __future__ import annotations

from typing import Any

from radixserve.constrained.reasoning_budget import ReasoningBudgets

MIN_JUMP_TOKENS = 3  # fewer: one extend step would save too little over as many decode steps
EXTEND_ALWAYS_TOKENS = 7  # a forced string this long takes one extend in a batch of any size
EXTEND_MAX_BATCH = 2  # a shorter one only in a running batch this small; else it is fed through decode steps


def extends(forced: int, batch_size: int) -> bool:
    """Whether `forced` tokens are computed by one extend (the request leaves the decode batch for a step of
    its own, which the other rows wait for) or fed through decode steps, one per step (no step of its own,
    no speed-up, no mask to fill). NOTE: the tokens are the same either way; only how their KV is computed
    differs. Measured (bench_structured.py's schemas, docs/structured_outputs.md): short keys (3-6 forced
    tokens) gain from extends at batch 1-2 (1.1-1.5x) and lose at 4-32 (0.77-0.98x); long keys (7-18) gain at
    every batch size from 1 to 32 (1.3-2.7x)."""
    return forced >= EXTEND_ALWAYS_TOKENS or batch_size <= EXTEND_MAX_BATCH


class JumpForward:
    def __init__(self, tokenizer: Any, enabled: bool = True) -> None:
        self.tokenizer = tokenizer
        self.enabled = enabled and tokenizer is not None
        self.budgets = ReasoningBudgets(tokenizer)  # NOTE: forced whether or not jumps are enabled

    def forced_tokens(self, req: Any) -> list[int]:
        """The tokens the request's grammar forces next, already accepted by its matcher; [] when none (or too
        few, or the request is in a state a jump must not touch). A spent reasoning budget's closing tag comes
        first (constrained/reasoning_budget.py)."""
        closing = self.budgets.forced_tokens(req)
        if closing:
            return closing
        if not self.enabled or req.grammar is None or req.finished() or not self._may_jump(req):
            return []
        matcher = req.grammar.matcher
        forced = matcher.find_jump_forward_string()
        if not forced:
            return []
        # NOTE: the last forced token is left to the model: sampled under the mask, it may merge with the text
        # that follows (a closing quote with the next word), as the model's own tokenization would
        ids = self._spelled(req.output_ids[-1], forced)[:-1]
        # NOTE: one token of the budget stays for the step that follows; a stop or EOS token ends the jump
        ids = ids[:max(req.max_new_tokens - len(req.output_ids) - 1, 0)]
        ends = req.stop_token_ids | req.eos_token_ids
        ids = ids[:next((i for i, t in enumerate(ids) if t in ends), len(ids))]
        accepted = 0
        for token in ids:
            if not matcher.accept_token(token):
                break
            accepted += 1
        if accepted < MIN_JUMP_TOKENS:
            if accepted:
                matcher.rollback(accepted)
            return []
        return ids[:accepted]

    def _spelled(self, last: int, text: str) -> list[int]:
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        before = self.tokenizer.decode([last], skip_special_tokens=False)
        after = self.tokenizer.decode([last, *ids], skip_special_tokens=False)
        return ids if after == before + text else []

    @staticmethod
    def _may_jump(req: Any) -> bool:
        return (bool(req.output_ids) and req.to_abort is None
                and not req.sampling_params.stop)  # NOTE: a stop string could end inside the forced text
