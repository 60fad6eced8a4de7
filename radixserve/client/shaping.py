"""Logprobs in SGLang's native shape (`meta_info`), the same from the Engine and from /generate:
[logprob, token id, text] per token, and per position its most likely alternatives in that shape."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

TopLogprobs = list[tuple[int, float]]  # (token id, logprob), most likely first

# NOTE: JSON has no -inf; a logprob below this (an underflow) is reported as this floor.
LOGPROB_FLOOR = -9999.0


def finite(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def maybe_finite(logprob: float | None) -> float | None:
    return None if logprob is None else finite(logprob)


def native_logprobs(text: Callable[[int], str], token_ids: list[int], logprobs: list[float] | None,
                    top_logprobs: list[TopLogprobs] | None, input_ids: list[int] | None = None,
                    input_logprobs: list[float | None] | None = None,
                    input_top_logprobs: list[TopLogprobs] | None = None) -> dict[str, Any]:
    """`output_token_logprobs` / `output_top_logprobs` of `token_ids`; with `input_ids` (the prompt from
    logprob_start_len on) also `input_token_logprobs` (null at position 0) and `input_top_logprobs`, both
    empty until the scheduler sent them."""
    values = logprobs or []
    tops = top_logprobs or [[] for _ in values]
    info: dict[str, Any] = {}
    if input_ids is not None:
        scored = zip(input_ids, input_logprobs, strict=False) if input_logprobs is not None else []
        info["input_token_logprobs"] = [[maybe_finite(lp), t, text(t)] for t, lp in scored]
        info["input_top_logprobs"] = [[[finite(v), t, text(t)] for t, v in top] for top in input_top_logprobs or []]
    info["output_token_logprobs"] = [[finite(lp), t, text(t)] for t, lp in zip(token_ids, values, strict=True)]
    info["output_top_logprobs"] = [[[finite(v), t, text(t)] for t, v in top] for top in tops]
    return info
