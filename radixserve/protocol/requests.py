"""What a request may be, checked the same way by every front end and by the scheduler, and the message
that carries one choice of it to the scheduler."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from radixserve.mem_cache.radix_key import check_namespace
from radixserve.protocol.io_struct import MAX_TOP_LOGPROBS, LogprobSpec, TokenizedGenerateReqInput
from radixserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    """What every request must fit: the model's context and vocabulary, the KV pool."""

    context_len: int
    pool_tokens: int
    page_size: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]

    @property
    def longest_request(self) -> int:
        """The most tokens (prompt + completion) one request may hold: the context, and the pool in whole pages."""
        # NOTE: a request alone must fit the pool, in whole pages, or it would be aborted mid-decode
        return min(self.context_len, self.pool_tokens // self.page_size * self.page_size)

    @staticmethod
    def of_runner(runner: Any) -> RequestLimits:
        return RequestLimits(runner.context_len, runner.max_total_num_tokens, runner.page_size,
                             runner.model_config.vocab_size, tuple(runner.model_config.eos_token_ids))


@dataclass(frozen=True)
class LengthRefusal:
    """Why prompt + completion cannot fit: `code` is OpenAI's ("context_length_exceeded") or ours
    ("kv_pool_exceeded"); `prompt_too_long`: the prompt alone leaves no room for one new token."""

    message: str
    code: str
    prompt_too_long: bool


def check_length(prompt_len: int, new_tokens: int, limits: RequestLimits, where: str = "prompt") -> LengthRefusal | None:
    """The one length rule (the HTTP front ends before they send, the scheduler on arrival): prompt + completion
    within the context and within the KV pool in whole pages (`RequestLimits.longest_request`)."""
    total = prompt_len + new_tokens
    asked = f"{total} tokens ({prompt_len} in the {where}, {new_tokens} in the completion)"
    longest = limits.longest_request
    if total > limits.context_len:
        return LengthRefusal(f"This model's maximum context length is {limits.context_len} tokens. However, you "
                             f"requested {asked}. Please reduce the length of the {where} or completion.",
                             "context_length_exceeded", prompt_len >= limits.context_len)
    if total > longest:
        return LengthRefusal(f"The KV cache pool holds {limits.pool_tokens} tokens, so the longest request this "
                             f"server can finish is {longest} tokens. However, you requested {asked}. Please reduce "
                             f"the length of the {where} or completion.", "kv_pool_exceeded", prompt_len >= longest)
    return None


def check_request(input_ids: list[int], logprob: LogprobSpec, extra_key: Any, limits: RequestLimits) -> str | None:
    """Why a request can never run (with the numbers), or None."""
    n = len(input_ids)
    if n == 0:
        return "the prompt is empty"
    too_long = check_length(n, 1, limits)  # NOTE: the completion is cut to fit on admission (Req.admit)
    if too_long is not None:
        return too_long.message
    bad = [t for t in input_ids if not 0 <= t < limits.vocab_size]
    if bad:
        return f"token id {bad[0]} is outside the vocabulary (size {limits.vocab_size})"
    if not -1 <= logprob.logprob_start_len < n:
        return f"logprob_start_len must be -1 or a prompt position (0 to {n - 1}), got {logprob.logprob_start_len}"
    if not 0 <= logprob.top_logprobs_num <= MAX_TOP_LOGPROBS:
        return f"top_logprobs_num must be between 0 and {MAX_TOP_LOGPROBS}, got {logprob.top_logprobs_num}"
    try:
        check_namespace(extra_key)
    except TypeError as e:
        return str(e)
    return None


def per_choice_params(params: SamplingParams, n: int | None = None) -> list[SamplingParams]:
    """n samples become n requests (the 2nd..nth hit the first's prompt in the radix cache); with a seed,
    choice i uses seed + i so the choices differ."""
    count = params.n if n is None else n
    return [dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + i)
            for i in range(count)]


def generate_message(rid: str, input_ids: list[int], params: SamplingParams, extra_key: Any,
                     logprob: LogprobSpec, lora_name: str | None = None,
                     embed: str | None = None, session_id: str | None = None,
                     session_field: str = "session_id") -> TokenizedGenerateReqInput:
    """The scheduler's message for one choice. NOTE: always streamed from the scheduler, so a front end
    knows the time of the first token (TTFT) and can stream or collect as its caller asked.
    `embed`: an embedding request's pooling ("last", "mean"; its params must ask for 0 new tokens).
    `session_id`: an open agent session (`session_field`: the request field that named it)."""
    return TokenizedGenerateReqInput(rid, list(input_ids), params, extra_key, True, logprob, lora_name, embed,
                                     session_id, session_field)
