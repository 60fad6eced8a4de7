"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

_MAX_STOP_STRINGS = 16


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    n: int = 1
    frequency_penalty: float = 0.0  # OpenAI's, in [-2, 2]: minus penalty x times the token was generated
    presence_penalty: float = 0.0  # OpenAI's, in [-2, 2]: minus penalty once a token was generated
    repetition_penalty: float = 1.0  # CTRL's, in (0, 2]: shrinks the logits of prompt and generated tokens
    min_new_tokens: int = 0  # EOS and stop token ids are banned until this many tokens were generated
    logit_bias: dict[int, float] | None = None  # OpenAI's: token id -> value in [-100, 100] added to its logit

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.verify()

    def verify(self) -> None:
        _check(isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 0,
               "max_new_tokens", f"must be an integer >= 0, got {self.max_new_tokens!r}")
        _check(_is_number(self.temperature) and self.temperature >= 0,
               "temperature", f"must be >= 0, got {self.temperature!r}")
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p!r}")
        _check(isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 1),
               "top_k", f"must be -1 (off) or >= 1, got {self.top_k!r}")
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p!r}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        _check(len(self.stop) <= _MAX_STOP_STRINGS, "stop", f"at most {_MAX_STOP_STRINGS} stop strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids", "must be non-negative integers")
        _check(self.seed is None or isinstance(self.seed, int), "seed", f"must be an integer, got {self.seed!r}")
        _check(isinstance(self.n, int) and 1 <= self.n <= 16, "n", f"must be in [1, 16], got {self.n!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and -2 <= value <= 2, name, f"must be in [-2, 2], got {value!r}")
        _check(_is_number(self.repetition_penalty) and 0 < self.repetition_penalty <= 2, "repetition_penalty",
               f"must be in (0, 2], got {self.repetition_penalty!r}")
        _check(isinstance(self.min_new_tokens, int) and not isinstance(self.min_new_tokens, bool)
               and self.min_new_tokens >= 0, "min_new_tokens", f"must be an integer >= 0, got {self.min_new_tokens!r}")
        _check(self.logit_bias is None or (isinstance(self.logit_bias, dict) and all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 and _is_number(v) and -100 <= v <= 100
            for t, v in self.logit_bias.items())), "logit_bias",
            "must map token ids (integers >= 0) to values in [-100, 100]")

    @property
    def uses_history(self) -> bool:
        """Needs the per-request token history (a frequency, presence or repetition penalty)."""
        return self.frequency_penalty != 0 or self.presence_penalty != 0 or self.repetition_penalty != 1

    @property
    def processes_logits(self) -> bool:
        return self.uses_history or self.min_new_tokens > 0 or bool(self.logit_bias)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @classmethod
    def from_any(cls, value: SamplingParams | dict[str, Any] | None) -> SamplingParams:
        if value is None:
            return cls()
        if isinstance(value, SamplingParams):
            return value
        if not isinstance(value, dict):
            raise TypeError(f"sampling_params must be a dict or SamplingParams, got {type(value).__name__}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}; valid: {', '.join(sorted(known))}")
        return cls(**value)


class SamplingParamsError(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param} {message}")
        self.param = param


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise SamplingParamsError(param, message)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
