"""Drafts from a smaller model of the same vocabulary (`--speculative-algorithm standalone`; SGLang's STANDALONE,
vLLM's draft model): it reads each request's new tokens and then decodes a few tokens greedily, in batched forwards.

The draft model is a second `ModelRunner` with its own KV pool and request rows, so its KV never mixes with the
target's: the target's `KVManager`, radix tree and conservation identity are untouched. Per request the drafter
keeps the tokens its pool holds K/V for (`DraftSeq`). Before each step that may verify drafts (`prepare`):

1. each request's draft KV is cut back to the longest prefix of the request's tokens now (what the target
   rejected goes back to the draft pool), always short of the last token, which is fed again;
2. one batched forward runs every request's tokens since: the 1-2 a verify step added as decode rows, a new
   request's prompt (the draft's prefill) as an extend; its logits give each request's first draft token;
3. batched decode steps give the rest (d_i in, d_i+1 out, the argmax), each request to its own draft length.

A draft model's forwards are not free as n-gram lookups are: before drafting, `prepare` weighs the step it would
buy (the batch's tokens plus the drafts' expected accepted tokens, over the verify step's measured time plus the
draft forwards' measured time) against a plain step. When drafting does not pay (a draft model nearly as slow as
the target, or one the target keeps rejecting), the batch decodes plainly and each request's acceptance estimate
drifts back toward the optimistic prior, so drafting is tried again some steps later: text changes.

A request that leaves the running batch gives its draft KV back at the next step (`tick`), and all of it goes
when the scheduler is idle (`release_all`). A greedy draft is a single token with certainty, so verification
(greedy, or speculative sampling: verify.py) stays exact whatever the draft model is; only how much is accepted
depends on how well the draft predicts the target.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

from radixserve.configs.speculative import SpecConfig
from radixserve.mem_cache.radix_key import common_prefix_len, pack_tokens
from radixserve.speculative.cost import MIN_STEPS, beats_plain
from radixserve.speculative.ngram import BudgetedDrafter

logger = logging.getLogger(__name__)

DECODE_FEED = 4  # a request feeding at most this many tokens runs them as decode rows (a verify step adds 1-2)
FORWARD_DECAY = 0.8  # weight of the previous mean in the draft forward's measured seconds


@dataclass
class DraftSeq:
    """One request in the draft model's pools: its request row, and the tokens (with their slots) whose K/V it holds
    at positions 0 .. len - 1."""

    row: int
    tokens: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)


class DraftModelDrafter(BudgetedDrafter):
    """Drafts each running request's next tokens with `runner`, a draft model over its own pools."""

    def __init__(self, config: SpecConfig, context_len: int, runner: Any, fast_rows: int | None = None) -> None:
        super().__init__(config, context_len, fast_rows)
        self.runner = runner
        self.seqs: dict[str, DraftSeq] = {}
        self.drafts: dict[str, list[int]] = {}
        self.forwards = 0  # the draft model's forwards, and the seconds they took (figures for benchmarks)
        self.seconds = 0.0
        self.forward_s: float | None = None  # mean seconds of one draft decode step (None: not measured); the feed
        # forward that starts each draft is priced as one more
        self.skipped = 0  # steps on which drafting did not pay and the batch decoded plainly

    # ---- the Drafter protocol ----------------------------------------------------------------------------------
    def prepare(self, reqs: Sequence[Any]) -> None:
        self.drafts = {}
        want = [(r, n) for r in reqs if (n := self.draft_length(r)) > 0]
        if not want or not self._pays(reqs, want):
            return
        started = time.perf_counter()
        feeds = [self._sync(r) for r, _ in want]
        need = sum(map(len, feeds)) + sum(n - 1 for _, n in want)
        # NOTE: the draft pool holds the running requests' tokens and their drafts (draft_server_args); when it
        # cannot, this step runs without drafts rather than take slots from anyone
        if need > self.runner.token_to_kv_pool_allocator.available_size():
            return
        drafts = self._extend([r for r, _ in want], feeds)
        decoding, forwards = time.perf_counter(), self.forwards
        self._decode([r for r, _ in want], drafts, [n for _, n in want])
        self.drafts = {r.rid: d for (r, _), d in zip(want, drafts, strict=True)}
        done = time.perf_counter()
        self.seconds += done - started
        if self.forwards > forwards:  # NOTE: the decode steps only: the feed may be a prompt's whole prefill
            per_forward = (done - decoding) / (self.forwards - forwards)
            self.forward_s = per_forward if self.forward_s is None else \
                FORWARD_DECAY * self.forward_s + (1 - FORWARD_DECAY) * per_forward

    def _pays(self, reqs: Sequence[Any], want: list[tuple[Any, int]]) -> bool:
        """Whether this step yields more tokens a second with the drafts than without: (batch + expected accepted)
        / (verify step + draft forwards) against batch / plain step, by the measured times (true while any is
        unknown). When not, each drafting request's acceptance estimate drifts toward the optimistic prior."""
        batch, drafted = len(reqs), sum(n for _, n in want)
        cost = self.cost
        if cost.side(batch) is cost.side(batch + drafted) and cost.fit(batch) is None:
            # NOTE: a batch that always drafts never shows what a plain step costs: the mean step of its side is a
            # verify step's. Once that side has steps enough for a line, one plain step gives it a second row count
            return cost.side(batch).steps < MIN_STEPS
        plain, verify = cost.step_seconds(batch), cost.step_seconds(batch + drafted)
        if plain is None or verify is None or self.forward_s is None:
            return True
        expected = sum(r.spec.budget.recent_rate() * n for r, n in want)
        if beats_plain(batch, expected, plain, verify + max(n for _, n in want) * self.forward_s):
            return True
        for r, _ in want:
            r.spec.budget.drift_toward_prior()
        self.skipped += 1
        return False

    def propose(self, req: Any) -> list[int]:
        return self.drafts.pop(req.rid, [])  # NOTE: cut to the grammar by batch_drafts (within_grammar)

    def tick(self, reqs: Sequence[Any]) -> None:
        super().tick(reqs)
        live = {r.rid for r in reqs}
        for rid in [rid for rid in self.seqs if rid not in live]:
            self._release(rid)

    def release_all(self) -> None:
        for rid in list(self.seqs):
            self._release(rid)
        self.drafts = {}

    # ---- the draft model's KV ----------------------------------------------------------------------------------
    def _sync(self, req: Any) -> list[int]:
        """The request's tokens the draft must still read: its KV cut back to the prefix it shares with them."""
        tokens = [*req.origin_input_ids, *req.output_ids]
        seq = self.seqs.get(req.rid)
        if seq is None:
            rows = self.runner.req_to_token_pool.alloc(1)
            if rows is None:  # NOTE: rows are sized for the target's running requests (draft_server_args)
                raise RuntimeError("the draft model has no free request row")
            seq = self.seqs[req.rid] = DraftSeq(rows[0])
        keep = min(common_prefix_len(pack_tokens(seq.tokens), pack_tokens(tokens), 0), len(tokens) - 1)
        self._truncate(seq, keep)
        return tokens[keep:]

    def _extend(self, reqs: list[Any], feeds: list[list[int]]) -> list[list[int]]:
        """Feed each request's new tokens; the first draft token of each. A few tokens each (what a verify step
        added) run as one decode-shaped forward, a row per token at consecutive positions (each row attends over
        the rows before it, as verify rows do: verify.py), which is the model's fast decode path; a longer feed (a
        new request's prompt) runs as an extend."""
        from radixserve.forward_batch import ForwardBatch

        seqs = [self.seqs[r.rid] for r in reqs]
        prefix_lens = [len(s.tokens) for s in seqs]
        slots = self._place(seqs, feeds)
        inputs = [t for f in feeds for t in f]
        if max(map(len, feeds)) > DECODE_FEED:
            fb = ForwardBatch.for_extend(inputs, [s.row for s in seqs], prefix_lens, list(map(len, feeds)), slots,
                                         self.runner.device)
            return [[t] for t in self._argmax(fb)]
        rows = [s.row for s, f in zip(seqs, feeds, strict=True) for _ in f]
        seq_lens = [p + i + 1 for p, f in zip(prefix_lens, feeds, strict=True) for i in range(len(f))]
        tokens = self._argmax(ForwardBatch.for_decode(inputs, rows, seq_lens, slots, self.runner.device))
        return [[tokens[end - 1]] for end in accumulate(map(len, feeds))]  # NOTE: each request's last row

    def _decode(self, reqs: list[Any], drafts: list[list[int]], lengths: list[int]) -> None:
        """Extend each draft to its length, one batched decode step per token."""
        from radixserve.forward_batch import ForwardBatch

        for step in range(1, max(lengths)):
            active = [i for i, n in enumerate(lengths) if n > step]
            seqs = [self.seqs[reqs[i].rid] for i in active]
            inputs = [drafts[i][-1] for i in active]
            slots = self._place(seqs, [[t] for t in inputs])
            fb = ForwardBatch.for_decode(inputs, [s.row for s in seqs], [len(s.tokens) for s in seqs], slots,
                                         self.runner.device)
            for i, token in zip(active, self._argmax(fb), strict=True):
                drafts[i].append(token)

    def _place(self, seqs: list[DraftSeq], feeds: list[list[int]]) -> Any:
        """Slots for each sequence's next tokens, written into its request row (the caller checked the room)."""
        slots = self.runner.token_to_kv_pool_allocator.alloc(sum(map(len, feeds)))
        table = self.runner.req_to_token_pool.req_to_token
        at = 0
        for seq, feed in zip(seqs, feeds, strict=True):
            part = slots[at: at + len(feed)]
            table[seq.row, len(seq.tokens): len(seq.tokens) + len(feed)] = part
            seq.tokens.extend(feed)
            seq.slots.extend(part.tolist())
            at += len(feed)
        return slots

    def _argmax(self, fb: Any) -> list[int]:
        self.forwards += 1
        return self.runner.forward(fb).argmax(dim=-1).tolist()

    def _truncate(self, seq: DraftSeq, keep: int) -> None:
        if keep < len(seq.tokens):
            import torch

            allocator = self.runner.token_to_kv_pool_allocator
            allocator.free(torch.tensor(seq.slots[keep:], dtype=torch.int64, device=allocator.device))
            del seq.tokens[keep:], seq.slots[keep:]

    def _release(self, rid: str) -> None:
        seq = self.seqs.pop(rid)
        self._truncate(seq, 0)
        self.runner.req_to_token_pool.free(seq.row)


def draft_server_args(args: Any, target: Any, config: SpecConfig) -> Any:
    """The draft model's ServerArgs: the target's device, its own model, the dtype `auto` picks there (a draft's
    numbers never reach the output, only its speed does), pools for every running request of the target with its
    context and its drafts, page size 1, no speculation or adapters, its own quantization."""
    pool = target.max_total_num_tokens + target.max_running_requests * (config.num_draft_tokens + 1)
    return dataclasses.replace(args, model_path=config.draft_model_path, dtype="auto", kv_cache_dtype="auto",
                               speculative_algorithm="none",
                               max_total_tokens=pool, max_running_requests=target.max_running_requests, page_size=1,
                               enable_lora=False, lora_paths=(), quantization=config.draft_quantization,
                               mem_fraction_static=None)


def load_draft_runner(args: Any, target: Any, config: SpecConfig) -> Any:
    """The draft model's ModelRunner; refuses a model whose vocabulary is not the target's."""
    from radixserve.model_executor.model_runner import ModelRunner

    runner = ModelRunner(draft_server_args(args, target, config))
    ours, theirs = runner.model_config.vocab_size, target.model_config.vocab_size
    if ours != theirs:
        raise ValueError(f"the draft model ({config.draft_model_path or 'embedded SmolLM2-135M'}) has a vocabulary of "
                         f"{ours} tokens, the served model {theirs}: a draft model must share the served model's "
                         "tokenizer")
    logger.info("speculative standalone: draft model %s (%s, quantization %s), its own KV pool of %d tokens",
                runner.loaded.name, runner.dtype_choice.dtype, config.draft_quantization, runner.max_total_num_tokens)
    return runner
