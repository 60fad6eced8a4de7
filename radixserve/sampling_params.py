"""Per-request sampling parameters, validated on construction, and against the loaded model before use.

The rules live here once, for every front end (OpenAI and native HTTP endpoints, the offline Engine):
`SamplingParams(...)` checks types and ranges that need no model; `verify_for_model(vocab_size)`
checks token ids against the vocabulary; `check_input_ids` checks a token-id prompt. A failure is a
`SamplingParamsError` naming the parameter (HTTP 400 in the server, ValueError in the Engine).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

MAX_STOP_STRINGS = 16  # NOTE: also checked on the raw body before validation (frontend/request_bounds.py)
MAX_N = 16
# NOTE: a temperature below this samples greedily. Dividing logits by a tiny temperature overflows
# float32 (1e-300 is 0.0 there: inf / inf = NaN logprobs and garbage tokens); 1e-5 keeps |logit| / T
# finite for any logit below ~3e33 and is already indistinguishable from argmax.
TEMPERATURE_FLOOR = 1e-5
# NOTE: CTRL's penalty divides positive logits by it: below this floor a logit of ~1e4 leaves float32's
# range, and a value like 1e-300 is 0.0 there (every logit then divides by zero or zeroes out).
REPETITION_PENALTY_FLOOR = 1e-6
MAX_TOP_K = 2**31 - 1  # a larger top_k means the whole vocabulary as much as -1 does; refused, not wrapped
MAX_TOKEN_ID = 2**31 - 1
GRAMMAR_PARAMS = ("json_schema", "regex", "ebnf", "structural_tag")
MAX_GRAMMAR_CHARS = 1 << 20
_FLOAT32_MAX = 3.4e38


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0  # below TEMPERATURE_FLOOR: greedy
    top_p: float = 1.0
    top_k: int = -1  # -1: off; at or above the vocabulary size: the whole vocabulary
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True  # False: the text keeps special tokens (a stop token matched is still dropped)
    seed: int | None = None
    n: int = 1
    frequency_penalty: float = 0.0  # OpenAI's, in [-2, 2]: minus penalty x times the token was generated
    presence_penalty: float = 0.0  # OpenAI's, in [-2, 2]: minus penalty once a token was generated
    repetition_penalty: float = 1.0  # CTRL's, in [1e-6, 2]: shrinks the logits of prompt and generated tokens
    min_new_tokens: int = 0  # EOS and stop token ids are banned until this many tokens were generated
    logit_bias: dict[int, float] | None = None  # OpenAI's: token id -> value in [-100, 100] added to its logit
    # Constrained decoding (at most one; SGLang's names): the output must match a JSON schema (a JSON string, or
    # a dict), a regular expression, an EBNF grammar (GBNF syntax, `root` rule), or a structural tag (free text,
    # and after a trigger a tagged grammar; xgrammar's JSON format or SGLang's structures + triggers; a string
    # or a dict). constrained/grammar_backend.py
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    # A spent reasoning budget ends the think block: function_call/reasoning.py's ThinkBudget (or its fields as a
    # dict); the scheduler forces the closing tag (constrained/reasoning_budget.py). None: no budget.
    reasoning_budget: Any = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(self.stop is None or isinstance(self.stop, (list, tuple)), "stop",
               f"must be a string or a list of strings, got {type(self.stop).__name__}")
        _check(self.stop_token_ids is None or isinstance(self.stop_token_ids, (list, tuple)), "stop_token_ids",
               f"must be a list of token ids, got {type(self.stop_token_ids).__name__}")
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.json_schema, dict):
            self.json_schema = json.dumps(self.json_schema)
        if isinstance(self.structural_tag, dict):
            self.structural_tag = json.dumps(self.structural_tag)
        if isinstance(self.reasoning_budget, dict):
            from radixserve.function_call.reasoning import ThinkBudget

            _check(set(self.reasoning_budget) <= {"tokens", "style", "started_in_prompt"}, "reasoning_budget",
                   "takes tokens, style and started_in_prompt")
            self.reasoning_budget = ThinkBudget(**self.reasoning_budget)
        self.verify()

    def verify(self) -> None:
        """Types and ranges that need no model; raises SamplingParamsError naming the parameter."""
        _check(_is_int(self.max_new_tokens) and self.max_new_tokens >= 0,
               "max_new_tokens", f"must be an integer >= 0, got {_show(self.max_new_tokens)}")
        _check(_is_number(self.temperature) and self.temperature >= 0,
               "temperature", f"must be a finite number >= 0, got {_show(self.temperature)}")
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {_show(self.top_p)}")
        _check(_is_int(self.top_k) and (self.top_k == -1 or 1 <= self.top_k <= MAX_TOP_K),
               "top_k", f"must be -1 (off) or in [1, {MAX_TOP_K}], got {_show(self.top_k)}")
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {_show(self.min_p)}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        _check(all(_is_text(s) for s in self.stop), "stop", "must be valid Unicode (no lone surrogates)")
        _check(len(self.stop) <= MAX_STOP_STRINGS, "stop", f"at most {MAX_STOP_STRINGS} stop strings")
        _check(all(_is_int(t) and 0 <= t <= MAX_TOKEN_ID for t in self.stop_token_ids),
               "stop_token_ids", "must be token ids (integers >= 0)")
        _check(isinstance(self.ignore_eos, bool), "ignore_eos", f"must be true or false, got {_show(self.ignore_eos)}")
        _check(self.seed is None or _is_int(self.seed), "seed", f"must be an integer, got {_show(self.seed)}")
        _check(_is_int(self.n) and 1 <= self.n <= MAX_N, "n", f"must be in [1, {MAX_N}], got {_show(self.n)}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and -2 <= value <= 2, name, f"must be in [-2, 2], got {_show(value)}")
        _check(_is_number(self.repetition_penalty) and REPETITION_PENALTY_FLOOR <= self.repetition_penalty <= 2,
               "repetition_penalty", f"must be in [{REPETITION_PENALTY_FLOOR:g}, 2] (1 is off), "
               f"got {_show(self.repetition_penalty)}")
        _check(_is_int(self.min_new_tokens) and self.min_new_tokens >= 0,
               "min_new_tokens", f"must be an integer >= 0, got {_show(self.min_new_tokens)}")
        _check(self.logit_bias is None or (isinstance(self.logit_bias, dict) and all(
            _is_int(t) and 0 <= t <= MAX_TOKEN_ID and _is_number(v) and -100 <= v <= 100
            for t, v in self.logit_bias.items())), "logit_bias",
            "must map token ids (integers >= 0) to values in [-100, 100]")
        if self.reasoning_budget is not None:
            from radixserve.function_call.reasoning import STYLES, ThinkBudget

            budget = self.reasoning_budget
            _check(isinstance(budget, ThinkBudget) and _is_int(budget.tokens) and budget.tokens >= 1
                   and budget.style in STYLES, "reasoning_budget",
                   f"must give tokens >= 1 and a style of {', '.join(STYLES)}, got {_show(budget)}")
        grammars = [name for name in GRAMMAR_PARAMS if getattr(self, name) is not None]
        for name in grammars:
            value = getattr(self, name)
            _check(isinstance(value, str) and value.strip() != "", name, "must be a non-empty string")
            _check(_is_text(value), name, "must be valid Unicode (no lone surrogates)")
            _check(len(value) <= MAX_GRAMMAR_CHARS, name, f"is longer than {MAX_GRAMMAR_CHARS} characters")
        _check(len(grammars) <= 1, grammars[-1] if grammars else "json_schema",
               f"cannot be combined with {', '.join(grammars[:-1])}: give at most one of {', '.join(GRAMMAR_PARAMS)}")

    def verify_for_model(self, vocab_size: int) -> None:
        """Token ids (stop ids, logit_bias keys) must lie in the loaded model's vocabulary [0, vocab_size)."""
        bad = next((t for t in self.stop_token_ids if t >= vocab_size), None)
        _check(bad is None, "stop_token_ids", f"must be token ids in [0, {vocab_size}), got {_show(bad)}")
        bad = next((t for t in self.logit_bias or {} if t >= vocab_size), None)
        _check(bad is None, "logit_bias", f"keys must be token ids in [0, {vocab_size}), got {_show(bad)}")

    @property
    def uses_history(self) -> bool:
        """Needs the per-request token history (a frequency, presence or repetition penalty)."""
        return self.frequency_penalty != 0 or self.presence_penalty != 0 or self.repetition_penalty != 1

    @property
    def processes_logits(self) -> bool:
        return self.uses_history or self.min_new_tokens > 0 or bool(self.logit_bias)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < TEMPERATURE_FLOOR or self.top_k == 1

    @classmethod
    def from_any(cls, value: SamplingParams | dict[str, Any] | None) -> SamplingParams:
        if value is None:
            return cls()
        if isinstance(value, SamplingParams):
            return value
        if not isinstance(value, dict):
            raise TypeError(f"sampling_params must be a dict or SamplingParams, got {type(value).__name__}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(value) - known, key=str)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(map(str, unknown))}; "
                             f"valid: {', '.join(sorted(known))}")
        return cls(**value)


class SamplingParamsError(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param} {message}")
        self.param = param


def check_input_ids(input_ids: Any, vocab_size: int, param: str = "input_ids") -> None:
    """A token-id prompt: a non-empty list of integers in [0, vocab_size)."""
    _check(isinstance(input_ids, (list, tuple)) and len(input_ids) > 0, param, "must be a non-empty list of token ids")
    bad = next((t for t in input_ids if not _is_int(t) or not 0 <= t < vocab_size), None)
    _check(bad is None, param, f"token id {_show(bad)} is outside the vocabulary [0, {vocab_size})")


def _show(value: Any, limit: int = 40) -> str:
    try:
        text = repr(value)
    except ValueError:  # an int over Python's digit limit
        return f"an integer of {value.bit_length()} bits"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise SamplingParamsError(param, message)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    """A finite int or float that float32 holds (a huge int would overflow the sampler's tensors)."""
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return False
    try:
        return math.isfinite(x) and abs(x) < _FLOAT32_MAX
    except OverflowError:
        return False


def _is_text(s: str) -> bool:
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False
