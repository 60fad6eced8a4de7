"""Grammars for constrained decoding, on xgrammar: compiled off the scheduler thread, cached, one matcher each.

A request that asks for structured output names one grammar (`GrammarSpec`: a JSON schema, any JSON
object is the schema {"type": "object"}, a regex, an EBNF grammar or a structural tag). `GrammarBackend.submit`
compiles it on a worker thread (xgrammar's compiler, built once per tokenizer) and caches the result by the spec,
so a thousand requests with one schema compile it once and a request never holds up the batch while its grammar
compiles: it waits in the scheduler's grammar queue (managers/grammar_manager.py). Each request then gets its own
`Grammar`, a matcher that follows its tokens: it fills the request's row of the batch's token bitmask before
sampling and accepts each sampled token after.

Bounds (docs/structured_outputs.md, "Limits and errors"): before compiling, a grammar too large to compile in
reasonable time, or one that can never end, or a schema keyword xgrammar would ignore, is refused
(constrained/grammar_checks.py); after, one whose compiled size is over the cache's budget, or that allows no
first token. Every cache of compiled grammars has a byte budget, `--grammar-cache-bytes`: xgrammar's own
compiler cache takes `XGRAMMAR_CACHE_SHARE` of it (its rule-level cache of token masks is what makes a schema
similar to an earlier one compile fast), ours (`ByteLRU`, constrained/grammar_cache.py) the rest.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from radixserve.constrained.grammar_cache import ByteLRU, CompileWorkers
from radixserve.constrained.grammar_checks import (
    MAX_GRAMMAR_STATES,
    MAX_GRAMMAR_WORK,
    GrammarError,
    Shape,
    refused_schema_keywords,
    shape,
    tag_schemas,
)
from radixserve.sampling_params import GRAMMAR_PARAMS

__all__ = ["DEFAULT_CACHE_BYTES", "Compiled", "Grammar", "GrammarBackend", "GrammarError", "GrammarSpec",
           "allowed_tokens", "apply_token_bitmask"]

DEFAULT_CACHE_BYTES = 256 << 20  # --grammar-cache-bytes
XGRAMMAR_CACHE_SHARE = 4  # xgrammar's compiler cache gets 1/4 of the budget (2/3 of that whole grammars, 1/3 masks)
FILL_THREADS = 2  # xgrammar's threads for a batch's bitmask (a row costs ~0.3 ms in a JSON schema)


@dataclass(frozen=True)
class GrammarSpec:
    """What a request asks its output to match: `kind` is a GRAMMAR_PARAMS name, `source` its text (OpenAI's
    `json_object` is the schema {"type": "object"})."""

    kind: str
    source: str

    @staticmethod
    def of_params(params: Any) -> GrammarSpec | None:
        """The grammar a SamplingParams names, or None (at most one is allowed; SamplingParams checks)."""
        for field in GRAMMAR_PARAMS:
            value = getattr(params, field, None)
            if value is not None:
                return GrammarSpec(field, value)
        return None


class Grammar:
    """One request's matcher: which tokens may come next, and the tokens that came."""

    def __init__(self, matcher: Any, field: str = "grammar", vocab_size: int | None = None) -> None:
        self._matcher = matcher
        self.field = field  # the request's parameter that named it (json_schema, regex, ebnf, structural_tag)
        self.vocab_size = vocab_size
        self.rejected = False  # a token the grammar did not allow was appended (a dead end, or our bug)

    @property
    def matcher(self) -> Any:
        return self._matcher

    def accept_token(self, token: int) -> None:
        if not self.rejected and not self._matcher.accept_token(token):
            self.rejected = True

    def dead_end(self, banned: frozenset[int]) -> str | None:
        """Why the token just rejected could not be helped, or None (then allowed tokens were there: our bug).
        "grammar": the grammar allows no token here; "banned": it allows only tokens in `banned` (the stop
        tokens min_new_tokens forbids). NOTE: valid after a rejection only: the matcher then stays in the state
        before the rejected token (no token is accepted after one)."""
        if self.vocab_size is None:
            return None
        bitmask = torch.full((1, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        self._matcher.fill_next_token_bitmask(bitmask, 0)
        allowed = allowed_tokens(bitmask[0], self.vocab_size)
        if not allowed:
            return "grammar"
        return "banned" if set(allowed) <= banned else None

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()

    def allows(self, token: int) -> bool:
        """Whether `token` may come next; the matcher's state is left as it was."""
        if not self._matcher.accept_token(token):
            return False
        self._matcher.rollback(1)
        return True

    def fill_row(self, bitmask: torch.Tensor, row: int) -> None:
        """Fills `row` of `bitmask` with the tokens that may come next."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def allowed_prefix(self, tokens: list[int]) -> int:
        """How many leading `tokens` may come next, one after another (a speculative draft's part the grammar
        allows); the matcher's state is left as it was.

        NOTE: a token that ends the grammar (its stop token) is not part of it: the verify row after it would need
        the mask of a terminated matcher; the model samples the end itself, in the row after the prefix."""
        n = 0
        for token in tokens:
            if not self._matcher.accept_token(token):
                break
            n += 1
            if self._matcher.is_terminated():
                n -= 1
                self._matcher.rollback(1)
                break
        if n:
            self._matcher.rollback(n)
        return n

    def fill_row_after(self, bitmask: torch.Tensor, row: int, tokens: list[int]) -> None:
        """Fills `row` with the tokens that may come after `tokens` (allowed: a verified draft's prefix)."""
        for token in tokens:
            if not self._matcher.accept_token(token):
                raise RuntimeError(f"draft token {token} is not allowed by the grammar it was checked against")
        self._matcher.fill_next_token_bitmask(bitmask, row)
        if tokens:
            self._matcher.rollback(len(tokens))


@dataclass(frozen=True)
class Compiled:
    """A compiled grammar as cached: xgrammar's, its size, and the first tokens when it allows only stop tokens
    (it matches only the empty output: None otherwise)."""

    grammar: Any
    field: str
    nbytes: int
    empty_only: frozenset[int] | None = None


class GrammarBackend:
    """xgrammar's compiler for one tokenizer and vocabulary, the worker threads that run it, and the cache."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int],
                 cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=stop_token_ids or None)
        self.vocab_size = vocab_size
        self.stop_token_ids = frozenset(info.stop_token_ids)
        self.cache_bytes = cache_bytes
        # NOTE: one budget: xgrammar's cache is bounded (its default has no bound: 900 distinct schemas took a
        # scheduler from 1.8 to 10.3 GB) and ours gets the rest, so evicting from ours frees the grammar
        xgr_bytes = cache_bytes // XGRAMMAR_CACHE_SHARE
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True, cache_limit_bytes=xgr_bytes)
        self._cache = ByteLRU(cache_bytes - xgr_bytes, size_of=lambda c: c.nbytes)
        self._workers = CompileWorkers()
        self._submit_lock = threading.Lock()
        self._batch = xgr.BatchGrammarMatcher(max_threads=FILL_THREADS)

    def submit(self, spec: GrammarSpec) -> Future:
        """A future of the `Compiled` grammar (raises GrammarError when it is refused); one per spec."""
        with self._submit_lock:  # NOTE: one compile per spec, whichever thread asks
            future = self._cache.get(spec)
            if future is None:
                future = self._workers.submit(lambda: self._compile(spec))  # NOTE: looked up when it runs (tests)
                self._cache.put(spec, future, len(spec.source) + 100)
            return future

    def check_overdue(self, timeout_s: float) -> None:
        """A compile running past `timeout_s` no longer holds up the grammars queued behind it."""
        self._workers.check_overdue(timeout_s)

    def flush(self) -> tuple[int, int]:
        """Drops the cached grammars no request is waiting for, and xgrammar's cache; (entries, bytes) of ours."""
        dropped = self._cache.clear()
        self._compiler.clear_cache()
        return dropped

    def cache_info(self) -> dict[str, int]:
        return {"grammar_cache_entries": len(self._cache), "grammar_cache_bytes": self._cache.bytes,
                "grammar_cache_evictions": self._cache.evictions, "xgrammar_cache_bytes":
                self._compiler.get_cache_size_bytes(), "grammar_compiles_overdue": self._workers.num_overdue}

    def matcher(self, compiled: Any) -> Grammar:
        """A new matcher of a `Compiled` grammar (or of xgrammar's compiled grammar itself)."""
        if isinstance(compiled, Compiled):
            return Grammar(self._xgr.GrammarMatcher(compiled.grammar), compiled.field, self.vocab_size)
        return Grammar(self._xgr.GrammarMatcher(compiled), vocab_size=self.vocab_size)

    def fill_bitmask(self, bitmask: torch.Tensor, rows: list[tuple[int, Grammar]]) -> None:
        """Fills the given rows of `bitmask`, each from its grammar's matcher, in one call over FILL_THREADS."""
        if rows:
            self._batch.batch_fill_next_token_bitmask([g.matcher for _, g in rows], bitmask, [r for r, _ in rows])

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        """int32 [rows, ceil(vocab / 32)], every token allowed."""
        return self._xgr.allocate_token_bitmask(rows, self.vocab_size)

    def _legacy_tag(self, tag: Any) -> tuple[list[Any], list[str]] | None:
        """SGLang's older structural tag ({"structures": [{"begin", "schema", "end"}], "triggers": [...]}) as
        xgrammar's items and triggers; None for xgrammar's own format."""
        if not (isinstance(tag, dict) and "structures" in tag):
            return None
        return ([self._xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                 for s in tag["structures"]], tag.get("triggers") or [])

    def _grammar(self, spec: GrammarSpec) -> Any:
        """xgrammar's `Grammar` of the spec (a few ms: no token masks), to check before compiling."""
        grammar = self._xgr.Grammar
        if spec.kind == "json_schema":
            return grammar.from_json_schema(spec.source, any_whitespace=False)
        if spec.kind == "structural_tag":
            legacy = self._legacy_tag(json.loads(spec.source))
            return grammar.from_structural_tag(*legacy) if legacy else grammar.from_structural_tag(spec.source)
        return grammar.from_regex(spec.source) if spec.kind == "regex" else grammar.from_ebnf(spec.source)

    def _regex_shape(self, pattern: str) -> Shape:
        try:
            return shape(str(self._xgr.Grammar.from_regex(pattern)))
        except Exception:  # noqa: BLE001 - a pattern xgrammar reads differently alone: the compile judges it
            return Shape(0, 0, None)

    def _check(self, spec: GrammarSpec) -> None:
        """Refuses, before compiling, a schema keyword xgrammar ignores, a grammar that cannot end, or one too
        large to compile in reasonable time (grammar_checks.py)."""
        schemas = [("", json.loads(spec.source))] if spec.kind == "json_schema" else \
            tag_schemas(json.loads(spec.source)) if spec.kind == "structural_tag" else []
        for where, schema in schemas:
            refused = refused_schema_keywords(schema)
            if refused:
                keyword, at = refused[0]
                at = f"{where} {at}" if where else at
                raise GrammarError(spec.kind, f"keyword '{keyword}' (at {at}) is not supported: xgrammar would "
                                              "ignore it, so the output could break it")
        found = shape(str(self._grammar(spec)), self._regex_shape)
        if found.unending is not None:
            raise GrammarError(spec.kind, f"no output can match it: rule '{found.unending}' never ends (it "
                                          "refers back to itself with no way out, e.g. a required $ref cycle)")
        if found.states > MAX_GRAMMAR_STATES or found.work > MAX_GRAMMAR_WORK:
            raise GrammarError(spec.kind, f"the grammar is too large to compile: {found.states} repetition states "
                                          f"({found.work} distinct), over {MAX_GRAMMAR_STATES} "
                                          f"({MAX_GRAMMAR_WORK}); lower maxLength/maxItems or {{m,n}} bounds",
                               reason="grammar too large")

    def _compile(self, spec: GrammarSpec) -> Compiled:
        compiler = self._compiler
        try:
            if spec.kind in ("json_schema", "structural_tag"):
                json.loads(spec.source)  # NOTE: a clear message for text that is not JSON at all
            self._check(spec)
            if spec.kind == "json_schema":
                # NOTE: compact JSON (no free whitespace between tokens): a small model given free whitespace
                # can emit newlines until max_new_tokens (seen with the 135M default model), as vLLM also found
                compiled = compiler.compile_json_schema(spec.source, any_whitespace=False)
            elif spec.kind == "structural_tag":
                legacy = self._legacy_tag(json.loads(spec.source))
                compiled = compiler.compile_structural_tag(*legacy) if legacy else \
                    compiler.compile_structural_tag(spec.source)
            elif spec.kind == "regex":
                compiled = compiler.compile_regex(spec.source)
            else:
                compiled = compiler.compile_grammar(spec.source)
        except json.JSONDecodeError as e:
            raise GrammarError(spec.kind, f"is not valid JSON ({e})") from None
        except GrammarError:
            raise
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError with the parser's message
            raise GrammarError(spec.kind, _first_line(e)) from None
        return self._admit(spec, compiled)

    def _admit(self, spec: GrammarSpec, compiled: Any) -> Compiled:
        """The compiled grammar if it fits the cache's budget and allows a first token."""
        nbytes = compiled.memory_size_bytes
        if nbytes > self._cache.budget_bytes:
            raise GrammarError(spec.kind, f"the compiled grammar takes {nbytes / 2**20:.1f} MiB, over the "
                                          f"{self._cache.budget_bytes / 2**20:.1f} MiB --grammar-cache-bytes "
                                          f"({self.cache_bytes / 2**20:.1f} MiB) leaves for compiled grammars",
                               reason="grammar too large")
        bitmask = self.allocate_bitmask(1)
        self._xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask, 0)
        first = allowed_tokens(bitmask[0], self.vocab_size)
        if not first:
            raise GrammarError(spec.kind, "no output can match it (the grammar allows no first token)")
        empty_only = frozenset(first) if set(first) <= self.stop_token_ids else None
        return Compiled(compiled, spec.kind, nbytes, empty_only)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Sets the logits of tokens outside each row's mask to -inf, in place.

    The bitmask is xgrammar's (bit i of int32 word j: token 32 j + i). Its bytes index a table of 8 "forbidden"
    flags each, so the unpacking is one gather and the write one masked fill: 3.6x faster than xgrammar's own
    CPU kernel at 32 x 49,152 (1.6 ms against 5.8; `benchmarks/bench_structured.py`'s shape), bit for bit the
    same, and the same code on CUDA (no triton)."""
    # NOTE: the byte view assumes a little-endian host (x86, ARM and CUDA hosts all are)
    table = _forbidden_table(logits.device)
    forbidden = table[bitmask.to(logits.device, non_blocking=True).view(torch.uint8).long()]
    logits.masked_fill_(forbidden.view(bitmask.shape[0], -1)[:, : logits.shape[1]], float("-inf"))


_TABLES: dict[torch.device, torch.Tensor] = {}


def _forbidden_table(device: torch.device) -> torch.Tensor:
    """bool [256, 8]: for each byte value, which of its 8 bits (low first) are 0, i.e. forbidden tokens."""
    table = _TABLES.get(device)
    if table is None:
        table = _TABLES[device] = torch.tensor([[(b >> i) & 1 == 0 for i in range(8)] for b in range(256)],
                                               dtype=torch.bool, device=device)
    return table


def allowed_tokens(row: torch.Tensor, vocab_size: int) -> list[int]:
    """The token ids one row of an xgrammar bitmask (int32 [ceil(vocab / 32)]) allows."""
    bits = np.unpackbits(row.cpu().contiguous().numpy().view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits).tolist()  # NOTE: ~0.7 ms at 49k; torch's gather of the table took ~25 ms


def _first_line(e: Exception) -> str:
    text = str(e).strip() or type(e).__name__
    return text if len(text) <= 500 else text[:497] + "..."
