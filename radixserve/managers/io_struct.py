"""Messages between the front end (Engine or HTTP tokenizer manager) and the scheduler.

Plain dataclasses so they pickle over ZMQ and pass through in-process queues alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from radixserve.sampling_params import SamplingParams

MAX_TOP_LOGPROBS = 20  # the most alternatives per token a request may ask for, as OpenAI's top_logprobs


@dataclass
class TokenizedGenerateReqInput:
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    extra_key: Any = None  # hashable namespace; different values never share KV
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0  # with return_logprob: the most likely tokens to report at each step
    logprob_start_len: int = -1  # with return_logprob: also the prompt's logprobs from this position


@dataclass
class AbortReq:
    rid: str


@dataclass
class FlushCacheReq:
    pass


@dataclass
class FlushCacheOut:
    success: bool
    tokens_freed: int = 0
    message: str = ""
    cache_epoch: int = 0  # successful flushes so far: a benchmark can prove its run started cold


@dataclass
class GetInternalStateReq:
    pass


@dataclass
class GetInternalStateOut:
    state: dict[str, Any]


@dataclass
class CacheTreeReq:
    """Ask for a bounded snapshot of the radix tree and its recent events (the cache explorer).

    The scheduler answers between two steps; the first request starts the tree's event log.
    """

    max_nodes: int = 400  # nodes nearest the root, breadth first
    max_tokens: int = 48  # token ids shown per node
    since: int = 0  # events after this sequence number
    max_events: int = 300  # at most the newest this many of them


@dataclass
class CacheTreeOut:
    snapshot: dict[str, Any]


@dataclass
class BatchTokenIDOut:
    """Incremental output of one scheduler step: for each request, its new token ids since the last message."""

    rids: list[str]
    new_token_ids: list[list[int]]
    finished_reasons: list[dict[str, Any] | None]  # None while running; {"type": "stop"|"length"|"abort", ...}
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    # With return_logprob: the logprob of each new token, and its top alternatives as (token id, logprob).
    output_logprobs: list[list[float] | None] = field(default_factory=list)
    output_top_logprobs: list[list[list[tuple[int, float]]] | None] = field(default_factory=list)
    # With logprob_start_len >= 0: the prompt's logprobs from that position (None for position 0),
    # sent once, in the first message after the prompt was fully computed; else None.
    input_token_logprobs: list[list[float | None] | None] = field(default_factory=list)
    input_top_logprobs: list[list[list[tuple[int, float]]] | None] = field(default_factory=list)
