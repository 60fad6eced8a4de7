"""Messages between the front end (Engine or HTTP tokenizer manager) and the scheduler.

Plain dataclasses so they pickle over ZMQ and pass through in-process queues alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from radixserve.sampling_params import SamplingParams

MAX_TOP_LOGPROBS = 20  # the most alternatives per token a request may ask for, as OpenAI's top_logprobs


@dataclass(frozen=True)
class LogprobSpec:
    """The logprobs a request asks for, carried as one value from the front end to the scheduler.

    Without `return_logprob` the other two fields are normalised to "none" (0 and -1).
    """

    return_logprob: bool = False
    top_logprobs_num: int = 0  # the most likely tokens to report at each position
    logprob_start_len: int = -1  # also the prompt's logprobs from this position (-1: none)

    def __post_init__(self) -> None:
        if not self.return_logprob:
            object.__setattr__(self, "top_logprobs_num", 0)
            object.__setattr__(self, "logprob_start_len", -1)


NO_LOGPROBS = LogprobSpec()


@dataclass
class TokenizedGenerateReqInput:
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    extra_key: Any = None  # hashable namespace; different values never share KV
    stream: bool = False
    logprob: LogprobSpec = NO_LOGPROBS
    lora_name: str | None = None  # a registered LoRA adapter; None: the base model
    embed: str | None = None  # an embedding request's pooling ("last", "mean"): a prefill that generates nothing
    session_id: str | None = None  # an open agent session of its namespace's owner (session_cache.py)
    session_field: str = "session_id"  # the request field that named it (the 404 names it)


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
class OpenSessionReq:
    """Open an agent session (SGLang's /open_session) for `owner` (the API key id, None without keys)."""

    owner: str | None
    session_id: str | None = None  # None: the scheduler names it
    ttl_s: float | None = None  # idle timeout; None: --session-idle-timeout-s
    capacity_of_str_len: int | None = None  # accepted for SGLang's clients; the token bounds apply


@dataclass
class CloseSessionReq:
    owner: str | None
    session_id: str


@dataclass
class CheckSessionReq:
    """Is this session open for `owner`? (the front end's check before it sends a request naming it)"""

    owner: str | None
    session_id: str


@dataclass
class SessionOut:
    """The answer to an open or close: `status_code` 200, 404 (no such open session of this owner), 409 (the id is
    taken) or 429 (--max-sessions reached)."""

    success: bool
    status_code: int
    session_id: str | None
    message: str = ""


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
class LoadLoraAdapterReq:
    """Register a PEFT LoRA folder under `lora_name` (SGLang's /load_lora_adapter)."""

    lora_name: str
    lora_path: str


@dataclass
class UnloadLoraAdapterReq:
    """Forget an adapter and drop its cached KV; refused while a request uses it."""

    lora_name: str


@dataclass
class LoraAdapterOut:
    """The answer to a load or unload: `status_code` 200, 400 (bad adapter, LoRA off), 404 (unknown name) or
    409 (in use); `adapters`, the registered adapters afterwards."""

    success: bool
    status_code: int
    message: str
    adapters: list[dict[str, Any]] = field(default_factory=list)
    freed_tokens: int = 0


@dataclass
class ListLoraAdaptersReq:
    pass


@dataclass
class TokenIDOut:
    """One request's new output since its last message."""

    rid: str
    new_token_ids: list[int]
    finished_reason: dict[str, Any] | None  # None while running; {"type": "stop"|"length"|"abort", ...}
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    # With return_logprob: the logprob of each new token, and its top alternatives as (token id, logprob).
    output_logprobs: list[float] | None = None
    output_top_logprobs: list[list[tuple[int, float]]] | None = None
    # With logprob_start_len >= 0: the prompt's logprobs from that position (None for position 0),
    # sent once, in the first message after the prompt was fully computed; else None.
    input_token_logprobs: list[float | None] | None = None
    input_top_logprobs: list[list[tuple[int, float]]] | None = None
    # The request's scheduler figures, merged into its meta_info: `queue_steps` once it has a first token
    # (Req.queue_steps); with speculative decoding, once it verified a draft, spec_verify_ct,
    # spec_draft_tokens, spec_accepted_tokens, spec_accept_rate, spec_accept_length (SpecState.meta).
    figures: dict[str, float] | None = None
    # An embedding request's L2-normalised pooled hidden state, in its finishing record (Req.embed); else None.
    embedding: list[float] | None = None
    # With the hierarchical cache: `cached_tokens` by tier, {"device", "host", "storage"} (they sum to it); else None.
    cached_tokens_details: dict[str, int] | None = None


@dataclass
class BatchTokenIDOut:
    """The output of one scheduler step: a record for each request that has something new."""

    outputs: list[TokenIDOut] = field(default_factory=list)
