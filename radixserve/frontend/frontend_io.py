"""What crosses the HTTP side's boundary with the scheduler's client: the front end's settings
(`FrontendConfig`), one request as a front end hands it over (`GenerateReq`), and one step of its
output as the client yields it (`GenerateOutput`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixserve.client.shaping import TopLogprobs
from radixserve.frontend.request_bounds import RequestBounds
from radixserve.sampling_params import SamplingParams
from radixserve.server_args import FRONTEND_LIMITS, REQUEST_BOUNDS, ServerArgs


@dataclass(frozen=True)
class FrontendConfig:
    """HTTP-side knobs: the HTTP-only flags, and the limits of ServerArgs the HTTP process applies."""

    max_body_bytes: int = 4 * 1024 * 1024
    health_timeout_s: float = 30.0  # /health fails when the scheduler has been silent this long
    heartbeat_interval_s: float = 1.0
    control_timeout_s: float = 30.0  # flush_cache, get_server_info, health_generate
    max_scheduler_restarts: int = 3  # within restart_window_s; one more death and the server exits
    restart_window_s: float = 600.0
    restart_wait_s: float = 120.0  # a request arriving during a restart waits this long for it
    # The limits of ServerArgs that the HTTP process applies (server_args.FRONTEND_LIMITS), same defaults.
    max_request_fanout: int = ServerArgs.max_request_fanout  # prompts x n of one request
    max_queued_requests: int = ServerArgs.max_queued_requests  # tickets waiting here or in the scheduler
    fair_share_slice: int = ServerArgs.fair_share_slice  # tickets of one request queued in the scheduler at a time
    frontend_workers: int = ServerArgs.frontend_workers  # parser processes, render threads (fair_work)
    max_frontend_queue: int = ServerArgs.max_frontend_queue  # jobs waiting for a front-end thread; more: 503
    keyless_rate_limit: float = ServerArgs.keyless_rate_limit  # keyless /health_generate, /get_load per second
    tool_call_parser: str = ServerArgs.tool_call_parser  # the tool-call format (function_call/formats.py)
    reasoning_parser: str | None = ServerArgs.reasoning_parser  # the think-block style (function_call/reasoning.py)
    bounds: RequestBounds = RequestBounds()  # per-request size bounds (request_bounds.py)

    @classmethod
    def from_server_args(cls, server_args: Any, **http_flags: Any) -> FrontendConfig:
        """The HTTP-only flags plus the limits of `ServerArgs` the HTTP process applies."""
        limits = {name: getattr(server_args, name) for name in FRONTEND_LIMITS}
        bounds = RequestBounds(**{name: getattr(server_args, name) for name in REQUEST_BOUNDS})
        return cls(**limits, bounds=bounds, **http_flags)


@dataclass
class GenerateReq:
    input_ids: list[int]
    sampling_params: SamplingParams
    extra_key: Any = None
    return_logprob: bool = False
    top_logprobs_num: int = 0  # with return_logprob: alternatives per token, at most MAX_TOP_LOGPROBS
    logprob_start_len: int = -1  # with return_logprob: also score the prompt from this position (-1: no)
    client_rid: str | None = None  # the client's name for it (SGLang's rid), for /abort_request
    group: Any = None  # the HTTP request it belongs to (fair admission); None: its own
    lora_name: str | None = None  # a LoRA adapter the scheduler holds; None: the base model
    embed: str | None = None  # an embedding request's pooling ("last", "mean"); None: it generates
    session_id: str | None = None  # an open agent session of its owner (docs/radix_cache.md, "Agent sessions")
    session_field: str = "session_id"  # the request field that named it (a 404 names it)


class FinishView:
    """The parts of a scheduler finish reason (`finish`: SGLang's {"type": "stop"|"length"|"abort", ...}, None
    while running) that the OpenAI routes read."""

    finish: dict[str, Any] | None

    @property
    def finish_reason(self) -> str | None:
        """"stop" | "length" | "abort" once finished."""
        return None if self.finish is None else str(self.finish.get("type", "stop"))

    @property
    def finish_message(self) -> str | None:
        return None if self.finish is None else self.finish.get("message")

    @property
    def finish_status(self) -> int | None:
        """An abort's HTTP-like status from the scheduler (400, 499, 500)."""
        return None if self.finish is None else self.finish.get("status_code")


@dataclass
class GenerateOutput(FinishView):
    rid: str
    text_delta: str
    token_ids: list[int]  # new token ids of this step
    finish: dict[str, Any] | None  # the scheduler's finish reason, whole (FinishView); None while running
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    # With return_logprob: one entry per token of `token_ids` (a matched stop token included).
    logprobs: list[float] | None = None
    top_logprobs: list[TopLogprobs] | None = None
    # With logprob_start_len >= 0, in one output only (the first after the prompt was computed): one
    # entry per prompt position from logprob_start_len on (None and [] at position 0); else None.
    input_logprobs: list[float | None] | None = None
    input_top_logprobs: list[TopLogprobs] | None = None
    figures: dict[str, float] | None = None  # the scheduler's figures of the request (TokenIDOut.figures)
    embedding: list[float] | None = None  # an embedding request's L2-normalised vector, in its finishing output
    cached_tokens_details: dict[str, int] | None = None  # by tier, with the hierarchical cache (TokenIDOut's)
