"""Requests whose grammar is compiling, and the token bitmask of each batch that has grammar rows.

`GrammarManager` is a part of `Scheduler` with one job: constrained decoding's scheduling. A request that
names a grammar (sampling parameters `json_schema`, `regex`, `ebnf`, `structural_tag`) waits here, outside the
waiting queue, while its grammar compiles on the backend's worker thread; `move_ready` (every step) queues it
once compiled, or ends it with a 400 carrying the compiler's message, or with a 400 after
`--grammar-compile-timeout` seconds. So a slow grammar never holds up the batch; nor the grammars queued behind
it: a compile running past half the timeout is left to finish on its own thread while the queue goes on
(constrained/grammar_cache.py). A request whose grammar matches only the empty output while it asks for
`min_new_tokens` ends with a 400 here, before it runs.

The bitmask. A batch with grammar rows carries a bitmask (`SamplingBatchInfo.vocab_mask`) that sampling
applies to the logits in place, after waiting for `mask_ready`. Row r may only be filled once the request
has accepted every token it sampled before, that is once every earlier batch's result is processed:
- the normal loop processes each batch before the next launch, so `fill` runs at launch;
- the overlap loop launches batch k+1 before processing batch k: k+1's mask is filled right after k's
  result is processed, while k+1's forward runs, and its sampling waits only if the forward finishes first.
A batch dropped after a failure has its mask released unfilled (`release`), so no sampling waits forever.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from radixserve.managers.req import FinishReason, Req

if TYPE_CHECKING:
    from radixserve.constrained.grammar_backend import GrammarBackend
    from radixserve.managers.request_queue import RequestQueue
    from radixserve.managers.scheduler_output_processor import OutputProcessor

class GrammarManager:
    def __init__(self, model_runner: Any, queue: RequestQueue, output: OutputProcessor, eos_token_ids: tuple[int, ...],
                 compile_timeout_s: float, cache_bytes: int) -> None:
        self.model_runner = model_runner
        self.queue = queue
        self.output = output
        self.eos_token_ids = eos_token_ids
        self.compile_timeout_s = compile_timeout_s
        self.cache_bytes = cache_bytes  # --grammar-cache-bytes
        self.compiling: dict[str, tuple[Req, Future, float]] = {}  # rid -> (request, compiled grammar, since)
        self._backend: GrammarBackend | None = None  # built on the first grammar (xgrammar's tokenizer tables)

    @property
    def backend(self) -> GrammarBackend:
        if self._backend is None:
            from radixserve.constrained.grammar_backend import GrammarBackend

            runner = self.model_runner
            self._backend = GrammarBackend(runner.tokenizer, runner.model_config.vocab_size, list(self.eos_token_ids),
                                           self.cache_bytes)
        return self._backend

    def flush(self) -> str:
        """Drops the cached grammars no request waits for (/flush_cache); what was dropped, in words."""
        if self._backend is None:
            return "no grammar cached"
        entries, freed = self._backend.flush()
        return f"{entries} compiled grammar(s), {freed / 2**20:.1f} MiB"

    def cache_info(self) -> dict[str, int]:
        return {} if self._backend is None else self._backend.cache_info()

    # ---- requests waiting for their grammar ---------------------------------------------------------
    def submit(self, req: Req) -> bool:
        """Starts compiling `req`'s grammar and holds the request until it is ready; False: it names none."""
        from radixserve.constrained.grammar_backend import GrammarSpec

        spec = GrammarSpec.of_params(req.sampling_params)
        if spec is None:
            return False
        self.compiling[req.rid] = (req, self.backend.submit(spec), time.monotonic())
        return True

    def get(self, rid: str) -> Req | None:
        entry = self.compiling.get(rid)
        return None if entry is None else entry[0]

    def waiting(self) -> list[Req]:
        """The requests whose grammar is still compiling (not queued yet)."""
        return [req for req, _, _ in self.compiling.values()]

    def move_ready(self) -> None:
        """Queues requests whose grammar compiled; ends those whose grammar failed or took too long (400)."""
        from radixserve.constrained.grammar_backend import GrammarError

        if not self.compiling:
            return
        # NOTE: half the timeout, so a grammar queued behind a compile that will time out still has half its own
        self.backend.check_overdue(self.compile_timeout_s / 2)
        now = time.monotonic()
        for rid, (req, future, since) in list(self.compiling.items()):
            if future.done():
                del self.compiling[rid]
                try:
                    compiled = future.result()
                except GrammarError as e:
                    self.output.finish_now(req, FinishReason.abort(f"{e.reason}: {e}", status_code=400))
                    continue
                refused = _empty_output_refused(req, compiled)
                if refused is not None:
                    self.output.finish_now(req, FinishReason.abort(refused, status_code=400))
                    continue
                req.set_grammar(self.backend.matcher(compiled))
                self.queue.add(req)
            elif now - since > self.compile_timeout_s:
                del self.compiling[rid]
                self.output.finish_now(req, FinishReason.abort(
                    f"the grammar did not compile within {self.compile_timeout_s:g} s (--grammar-compile-timeout)",
                    status_code=400))

    def abort(self, rid: str) -> bool:
        """Ends a request still waiting for its grammar; False if none waits under `rid`."""
        entry = self.compiling.pop(rid, None)
        if entry is None:
            return False
        self.output.finish_now(entry[0], FinishReason.abort("aborted by the client", status_code=499))
        return True

    # ---- the batch's bitmask --------------------------------------------------------------------------
    def attach(self, info: Any, reqs: list[Req]) -> None:
        """Gives a batch with grammar rows an all-allowed bitmask to fill, and the event sampling waits on."""
        from radixserve.constrained.batch_mask import BatchMask

        if not any(r.grammar is not None for r in reqs):
            return
        info.grammar_mask = BatchMask(self.backend.allocate_bitmask(len(reqs)), list(reqs))

    def fill(self, info: Any) -> None:
        """Fills the grammar rows that sampling masks first and names those it checks after it
        (constrained/batch_mask.py), then lets sampling go on. Only once every earlier result is processed
        (module docstring); rows of requests that finished or whose token is dropped (a non-final chunk) stay
        unconstrained."""
        from radixserve.constrained.batch_mask import checked_after_sampling

        mask = getattr(info, "grammar_mask", None)
        if mask is None or mask.ready.is_set():
            return
        masked, checked = [], []
        verify = getattr(info, "verify", None)
        drafts = verify.row_prefixes() if verify is not None else None
        try:
            for row, req in enumerate(mask.reqs):
                grammar = req.grammar
                if (grammar is None or req.finished() or req.is_chunked or grammar.rejected or grammar.is_terminated()
                        or not req.samples_next(req.kv.kv_allocated_len)):  # NOTE: a sample to be dropped
                    continue
                if drafts is not None and drafts[row] is not None:
                    # NOTE: a verify row of a drafting request: the state after the draft tokens before it,
                    # filled before sampling (speculative sampling needs the whole masked distribution)
                    grammar.fill_row_after(mask.bitmask, row, drafts[row])
                    mask.extra_masked.append(row)
                    continue
                rows = checked if checked_after_sampling(req.sampling_params, req.logprob.return_logprob) else masked
                rows.append((row, grammar))
        finally:
            mask.set_rows(masked, checked, self.backend.fill_bitmask)

    def release(self, info: Any) -> None:
        """Lets a dropped batch's sampling go on without filling (after a failure: its result is discarded)."""
        mask = getattr(info, "grammar_mask", None)
        if mask is not None:
            mask.release()


def _empty_output_refused(req: Req, compiled: Any) -> str | None:
    """Why a grammar that only matches the empty output cannot serve a request with min_new_tokens, or None."""
    params = req.sampling_params
    if compiled.empty_only is None or params.min_new_tokens <= 0:
        return None
    banned = req.min_new_tokens_banned(0)
    if not compiled.empty_only <= banned:
        return None
    return (f"min_new_tokens: the {compiled.field} grammar only matches the empty output, and min_new_tokens is "
            f"{params.min_new_tokens}")
