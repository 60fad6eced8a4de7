"""A request as the scheduler sees it: its tokens, its logprob state, and its lifecycle.

The lifecycle is one stored phase (`Req.phase`), moved only by the methods below and only along
`PHASE_MOVES`; nothing outside this module writes a lifecycle field (`ScheduleBatch` writes the
per-forward progress: `input_logprob_next`, `cached_tokens`, `penalty_reset`). Its KV is a `ReqKV` handle
(`req.kv`) that only the `KVManager` writes. Who may write each field: `FIELD_WRITERS`.

    WAITING   -- start_running (a row, slots, a lock) ----------->  RUNNING (ABORTING with an abort pending)
    RUNNING   -- reset_for_retract / leave_for_extend ----------->  WAITING (KV released, outputs kept)
    RUNNING   -- mark_abort (applied at its next step) ---------->  ABORTING
    any       -- finish (KV released by KVManager.release) ------>  FINISHED
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from radixserve import envs
from radixserve.mem_cache.kv_manager import ReqKV
from radixserve.protocol.io_struct import NO_LOGPROBS, LogprobSpec, TokenIDOut
from radixserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from radixserve.constrained.grammar_backend import Grammar
    from radixserve.lora.adapter import LoraAdapter
    from radixserve.speculative.ngram import SpecState


class ReqPhase(enum.Enum):
    WAITING = "waiting"  # queued: holds no row and no lock (a retracted request is back here)
    RUNNING = "running"  # admitted: holds a row, its KV and a tree lock (a prefill chunk, or decoding)
    ABORTING = "aborting"  # running, with an abort to apply at its next step
    FINISHED = "finished"  # ended: its KV released (cached in the tree unless aborted)


_W, _R, _A, _F = ReqPhase.WAITING, ReqPhase.RUNNING, ReqPhase.ABORTING, ReqPhase.FINISHED
# NOTE: every move a request may make. A new phase (KV on its way from the host or disk tier, or from another
# process, between WAITING and RUNNING) enters here with the method that makes its move; any other move raises.
PHASE_MOVES: dict[ReqPhase, frozenset[ReqPhase]] = {
    _W: frozenset({_R, _A, _F}),  # admitted into a prefill (ABORTING: retracted with an abort pending); ended queued
    _R: frozenset({_W, _A, _F}),  # retracted, or left for a jump-forward extend; an abort marked; ended
    _A: frozenset({_W, _A, _F}),  # retracted before its abort applied; a second abort; ended at its next step
    _F: frozenset(),
}


class PhaseError(RuntimeError):
    """A request was moved along a transition PHASE_MOVES does not have: a scheduler bug."""


@dataclass(frozen=True)
class FinishReason:
    """Why a request ended: `stop` (a stop/EOS token or a stop string), `length`, or `abort`."""

    type: str
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None
    status_code: int | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type}
        if self.type == "stop":
            out["matched"] = self.matched
        elif self.type == "length":
            out["length"] = self.length
        else:
            out["message"] = self.message
            out["status_code"] = self.status_code
        return out

    @staticmethod
    def abort(message: str, status_code: int = 400) -> FinishReason:
        return FinishReason("abort", message=message, status_code=status_code)


class Req:
    """One generation request. Its KV (row, slots, tree lock) is `self.kv`, written by KVManager only."""

    def __init__(self, rid: str, origin_input_ids: list[int], sampling_params: SamplingParams,
                 extra_key: Any = None, stream: bool = False, eos_token_ids: Iterable[int] = (),
                 logprob: LogprobSpec = NO_LOGPROBS, embed: str | None = None) -> None:
        self.rid = rid
        # An embedding request: its pooling ("last" or "mean"); it runs as a prefill that generates no token and ends
        # with `embedding`, the L2-normalised pooled final-norm output (layers/pooler.py). None: it generates.
        self.embed = embed
        self.embed_sum: Any = None  # "mean": the sum of its rows' vectors over its prefill chunks (float32 tensor)
        self.embedding: list[float] | None = None
        self.origin_input_ids: list[int] = list(origin_input_ids)
        self.output_ids: list[int] = []
        self.fill_ids: list[int] = []  # (origin + output)[:end of the tokens computed this round]
        self.sampling_params = sampling_params
        self.max_new_tokens = sampling_params.max_new_tokens  # may be clamped to the context at admission
        self.extra_key = extra_key
        self.priority = 0  # of the tree nodes it publishes (--radix-eviction-policy priority)
        self.stream = stream
        self.eos_token_ids = frozenset(eos_token_ids)
        self.stop_token_ids = frozenset(sampling_params.stop_token_ids)
        self.stop_str_max_len = max((len(s) for s in sampling_params.stop), default=0)
        self.logprob = logprob
        self.output_token_logprobs: list[float] = []  # with return_logprob: one per output id
        self.output_top_logprobs: list[list[tuple[int, float]]] = []
        # Input logprobs of prompt positions [logprob_start_len, n) (-1: none). Position 0 has no context.
        start = logprob.logprob_start_len
        self.input_token_logprobs: list[float | None] = [None] if start == 0 else []
        self.input_top_logprobs: list[list[tuple[int, float]]] = [[]] if start == 0 else []
        self.input_logprob_next = max(start, 1)  # next prompt position a forward will score
        self.input_logprobs_sent = False
        self.penalty_reset = False  # a new row: its penalty history must be rebuilt in the next forward
        self.kv = ReqKV()
        self.grammar: Grammar | None = None  # constrained decoding: its matcher, once compiled (GrammarManager)
        self.lora: LoraAdapter | None = None  # its LoRA adapter, set on arrival (LoraControl); None: the base model
        self.spec: SpecState | None = None  # speculative decoding's state, once it drafted (the drafter's)
        self.forced_pending = 0  # jump-forward tokens appended since its last round: the decode planner decides
        # Lifecycle.
        self._phase = ReqPhase.WAITING
        self.finished_reason: FinishReason | None = None
        self.to_abort: FinishReason | None = None
        self.is_chunked = 0  # > 0 while a non-final prefill chunk is in flight
        self.is_retracted = False
        self.retracted_stain = False
        self.retraction_count = 0
        self.cached_tokens = 0
        self.cached_tokens_details: dict[str, int] | None = None  # by tier, with the hierarchical cache
        self.already_computed = 0
        self.num_matched_prefix_tokens = 0
        self.wait_since = time.monotonic()
        self.arrival_step = 0  # forward steps the scheduler had launched when it arrived
        # Steps launched from its arrival to the one whose result gave its first token, that one included (under
        # the overlap loop, the step launched before that result was read too); None until then.
        self.queue_steps: int | None = None
        self.sent_output_len = 0  # output ids already sent to the front end
        self.finish_sent = False
        self.stats_counted = False  # prompt/cached tokens counted (at the first prefill)

    def __repr__(self) -> str:
        kv = self.kv
        return (f"Req(rid={self.rid!r}, input={len(self.origin_input_ids)}, output={len(self.output_ids)}, "
                f"row={kv.req_pool_idx}, cpl={kv.cache_protected_len}, kv={kv.kv_allocated_len})")

    @property
    def seqlen(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    def samples_next(self, kv_len: int) -> bool:
        """Whether a forward that leaves `kv_len` tokens with KV samples a token this request keeps: no token
        after them is known yet. False while a jump-forward's forced tokens are fed through decode steps (or a
        decode step launched before the jump), whose samples are dropped."""
        return kv_len >= self.seqlen

    def feed_forced(self) -> None:
        """Its forced tokens go through decode steps, one per step, instead of one extend (decode_planner.py);
        its penalty history is rebuilt from the host's tokens (the forced ones in, dropped samples out)."""
        self.forced_pending = 0
        self.penalty_reset = True

    def penalties_after_verify(self) -> None:
        """A verify step sampled after draft tokens that were not all kept: its penalty history is rebuilt from
        the host's tokens (speculative/verify.attach_drafts)."""
        self.penalty_reset = self.sampling_params.uses_history

    @property
    def extend_input_len(self) -> int:
        """Tokens this round computes: `fill_ids` beyond the prefix whose KV exists."""
        return len(self.fill_ids) - self.kv.prefix_len

    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def phase(self) -> ReqPhase:
        return self._phase

    def phase_problem(self) -> str | None:
        """Why its stored phase disagrees with what it holds (a row while WAITING, none while RUNNING), or None."""
        holds_row = self.kv.req_pool_idx is not None
        if holds_row != (self._phase in (_R, _A)) or (self._phase is _F) != (self.finished_reason is not None):
            return f"{self.rid}: phase {self._phase.value}, row {self.kv.req_pool_idx}, finished {self.finished_reason}"
        return None

    def _move(self, to: ReqPhase) -> None:
        if to not in PHASE_MOVES[self._phase]:
            raise PhaseError(f"request {self.rid}: no move from {self._phase.value} to {to.value}")
        self._phase = to

    # ---- lifecycle transitions (the only writers of the lifecycle fields) -------------------------
    def start_running(self) -> None:
        """A prefill gave it a row, slots and a lock (KVManager.alloc_extend): it runs until it ends, is retracted
        or leaves for a jump-forward extend. No move when it already runs (its next chunk)."""
        if self._phase is _W:
            self._move(_R if self.to_abort is None else _A)

    def leave_for_extend(self) -> None:
        """Its KV went to the tree (KVManager.release) and it goes back to the queue, for one extend of its jump-forward
        tokens (decode_planner.py)."""
        self._move(_W)

    def admit(self, longest_request: int, arrival_step: int = 0) -> None:
        """Accepted into the waiting queue when the scheduler had launched `arrival_step` forwards: its output may
        not run past the context or the KV pool (`RequestLimits.longest_request`), so a request alone always
        finishes."""
        self.max_new_tokens = min(self.max_new_tokens, longest_request - len(self.origin_input_ids))
        self.arrival_step = arrival_step

    def note_first_token(self, launched: int) -> None:
        """A result gives it a token when `launched` forwards were launched: its first one sets `queue_steps`."""
        if self.queue_steps is None:
            self.queue_steps = launched - self.arrival_step

    def mark_abort(self, reason: FinishReason) -> None:
        """Abort a request that is running (or in a batch being run): it ends at its next step."""
        self.to_abort = reason
        if self._phase is not _W:  # NOTE: a retracted one moves when it runs again (start_running)
            self._move(_A)

    def finish(self, reason: FinishReason) -> None:
        self._move(_F)
        self.finished_reason = reason

    def set_grammar(self, grammar: Grammar) -> None:
        """Its grammar compiled: from now on each appended token is accepted by the matcher."""
        self.grammar = grammar

    def set_lora(self, adapter: LoraAdapter, extra_key: Any) -> None:
        """Its LoRA adapter, and the cache namespace its KV lives in (an adapter never shares KV with another)."""
        self.lora = adapter
        self.extra_key = extra_key

    def set_spec(self, state: SpecState) -> None:
        """Speculative decoding's record of it, made by the drafter the first time it drafts."""
        self.spec = state

    def note_match(self, matched: int) -> None:
        """The length of its cached prefix, as the cache-aware policy last matched it."""
        self.num_matched_prefix_tokens = matched

    def cut_round(self, length: int) -> None:
        """This round computes only `fill_ids[:length]` (a prefill chunk)."""
        self.fill_ids = self.fill_ids[:length]

    def begin_chunk(self) -> None:
        """A non-final prefill chunk of it was launched; its result samples nothing."""
        self.is_chunked += 1

    def end_chunk(self) -> bool:
        """The result of a chunk arrived: True if it was a non-final chunk (nothing to sample)."""
        if self.is_chunked <= 0:
            return False
        self.is_chunked -= 1
        return True

    def count_once(self) -> bool:
        """True the first time it is prefilled (not after a retraction): its prompt counts in the stats."""
        if self.stats_counted or self.retracted_stain:
            return False
        self.stats_counted = True
        return True

    def append_token(self, token: int, logprob: float | None, top: list[tuple[int, float]] | None) -> None:
        self.output_ids.append(token)
        if self.grammar is not None:
            self.grammar.accept_token(token)
        if self.logprob.return_logprob:
            # NOTE: one entry per output token, so output_token_logprobs stays aligned with output_ids.
            self.output_token_logprobs.append(logprob)
            self.output_top_logprobs.append(top[: self.logprob.top_logprobs_num])

    def add_input_logprobs(self, values: list[float], tops: list[list[tuple[int, float]]]) -> None:
        self.input_token_logprobs.extend(values)
        self.input_top_logprobs.extend(top[: self.logprob.top_logprobs_num] for top in tops)

    def add_pooled(self, vector: Any, final: bool) -> None:
        """An embedding request's pooled vector from one prefill forward (ForwardBatch.pooled_hidden): the last row's
        ("last"), or the sum over that forward's rows ("mean"); after the `final` chunk its `embedding` is set."""
        if self.embed == "mean":
            self.embed_sum = vector if self.embed_sum is None else self.embed_sum + vector
        else:
            self.embed_sum = vector
        if final:
            from radixserve.layers.pooler import normalize

            # NOTE: mean pooling matched no prefix (prefix_match_limit), so the rows summed are the whole prompt
            self.embedding = normalize(self.embed_sum)

    def has_output_to_send(self) -> bool:
        return not self.finish_sent and (self.finished() or (self.stream and len(self.output_ids) > self.sent_output_len))

    def take_output(self) -> TokenIDOut:
        """What it has not sent to the front end yet, marked as sent."""
        sent, logprobs = self.sent_output_len, self.logprob.return_logprob
        self.finish_sent = self.finished()
        self.sent_output_len = len(self.output_ids)
        send_input = self.input_logprobs_complete() and not self.input_logprobs_sent
        self.input_logprobs_sent |= send_input
        return TokenIDOut(
            self.rid, self.output_ids[sent:], self.finished_reason.to_json() if self.finished() else None,
            len(self.origin_input_ids), len(self.output_ids), self.cached_tokens,
            self.output_token_logprobs[sent:] if logprobs else None,
            self.output_top_logprobs[sent:] if logprobs else None,
            self.input_token_logprobs if send_input else None,
            self.input_top_logprobs if send_input else None,
            self.figures(), self.embedding if self.finish_sent else None, self.cached_tokens_details)

    def figures(self) -> dict[str, float] | None:
        """Its figures for meta_info (TokenIDOut.figures)."""
        spec = self.spec.meta() if self.spec is not None and self.spec.verify_steps else {}
        if self.queue_steps is None:
            return spec or None
        return {"queue_steps": self.queue_steps, **spec}

    @property
    def wants_input_logprobs(self) -> bool:
        """Some prompt position still has to be scored by a forward."""
        return self.logprob.logprob_start_len >= 0 and self.input_logprob_next < len(self.origin_input_ids)

    def input_logprobs_complete(self) -> bool:
        start = self.logprob.logprob_start_len
        return start >= 0 and len(self.input_token_logprobs) == len(self.origin_input_ids) - start

    def init_next_round_input(self) -> None:
        """This round covers the whole sequence (the prefill adder may cut it to a chunk)."""
        self.fill_ids = self.origin_input_ids + self.output_ids
        self.forced_pending = 0

    @property
    def prefix_match_limit(self) -> int:
        """How many leading `fill_ids` a cached prefix may cover."""
        # NOTE: at least one token is always computed, so the forward has logits to sample from.
        limit = max(len(self.fill_ids) - 1, 0)
        if self.embed == "mean":
            # NOTE: mean pooling needs every prompt row's hidden state, and a cached prefix has none: computed whole
            return 0
        if self.wants_input_logprobs:
            # NOTE: the logits at position p score prompt token p + 1, and a cached prefix has no
            # logits: positions from input_logprob_next - 1 on are computed, never matched.
            limit = min(limit, self.input_logprob_next - 1)
        return limit

    def check_finished(self, tokenizer: Any = None) -> None:
        """Set `finished_reason` after a token was appended: abort, a token the grammar refused, length, stop token,
        then stop string."""
        if self._phase is _F:
            return
        if self.to_abort is not None:
            self.finish(self.to_abort)
            return
        if self.grammar is not None and self.grammar.rejected:
            # NOTE: before the length and stop checks: the token is one the grammar refused, whatever it is
            self.finish(self._grammar_rejected(self.output_ids[-1]))
            return
        if len(self.output_ids) >= self.max_new_tokens:
            self.finish(FinishReason("length", length=self.max_new_tokens))
            return
        last = self.output_ids[-1]
        if last in self.stop_token_ids or (not self.sampling_params.ignore_eos and last in self.eos_token_ids):
            self.finish(FinishReason("stop", matched=last))
            return
        if self.grammar is not None and self.grammar.is_terminated():
            self.finish(FinishReason("stop", matched=last))
            return
        if self.stop_str_max_len and tokenizer is not None:
            tail = tokenizer.decode(self.output_ids[-(self.stop_str_max_len + 1):], skip_special_tokens=True)
            for stop in self.sampling_params.stop:
                if stop in tail:
                    self.finish(FinishReason("stop", matched=stop))
                    return

    def min_new_tokens_banned(self, done: int) -> frozenset[int]:
        """The tokens min_new_tokens bans after `done` output tokens: the stop ids, and EOS unless ignore_eos (as
        schedule_batch bans them in the logits)."""
        if done >= self.sampling_params.min_new_tokens:
            return frozenset()
        return self.stop_token_ids | (frozenset() if self.sampling_params.ignore_eos else self.eos_token_ids)

    def _grammar_rejected(self, last: int) -> FinishReason:
        """The grammar refused the token just appended. The client's grammar (or min_new_tokens) when the row had
        no token to give: the grammar allowed none (400 on the grammar's field), or only stop tokens that
        min_new_tokens banned (400 on min_new_tokens). Otherwise a token was sampled the mask forbade: our bug
        (500)."""
        done = len(self.output_ids) - 1
        why = self.grammar.dead_end(self.min_new_tokens_banned(done))
        field = self.grammar.field
        if why == "grammar":
            return FinishReason.abort(f"invalid grammar: {field}: no output can match it: after {done} token(s) "
                                      "the grammar allows no next token", status_code=400)
        if why == "banned":
            return FinishReason.abort(f"min_new_tokens: the {field} grammar must end after {done} token(s), before "
                                      f"min_new_tokens ({self.sampling_params.min_new_tokens})", status_code=400)
        return FinishReason.abort(f"the grammar rejected token {last}", status_code=500)

    def jump_forward(self, tokens: list[int]) -> None:
        """The tokens its grammar forced (its matcher accepted them) follow its outputs, each with logprob 0 (the
        only choice left); the decode planner then has them extended or fed (`forced_pending`, jump_forward.py)."""
        self.output_ids.extend(tokens)
        self.forced_pending += len(tokens)
        if self.logprob.return_logprob:
            self.output_token_logprobs.extend([0.0] * len(tokens))
            self.output_top_logprobs.extend([(t, 0.0)][: self.logprob.top_logprobs_num] for t in tokens)
        self.retracted_stain = True  # NOTE: its prompt was counted; the re-prefill's cache hit is not the prompt's

    def reset_for_retract(self) -> None:
        """After its KV was released: keep the outputs, so the request resumes where it was."""
        self._move(_W)
        self.is_chunked = 0
        self.is_retracted = True
        self.retracted_stain = True
        self.retraction_count += 1
        self.embed_sum = None  # NOTE: a re-prefill computes every row again
        start = self.logprob.logprob_start_len
        if start >= 0:
            # NOTE: under overlap the prefill that scored the prompt may still be in flight; its result is
            # dropped with the retraction, so scoring resumes after what has really arrived.
            self.input_logprob_next = max(start + len(self.input_token_logprobs), 1)


if envs.CHECK_REQ_WRITES.get():  # NOTE: read once, at import: the tests set it before importing the package
    from radixserve.managers.req_owners import guard_field_writes

    guard_field_writes(Req)
