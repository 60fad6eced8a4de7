"""`RequestState`: one request in flight as a front end tracks it, the part both front ends share.

What the scheduler told the front end about the request (its token counts, what it found cached and in which tier,
the scheduler's figures, how it ended) and when (sent, first token, last token, end), updated by `observe` from
each of its `TokenIDOut` records. Each front end extends it with how it delivers the tokens: the Engine's
(entrypoints/request_state.py) keeps every token and logprob for a result or a stream on the caller's thread; the
HTTP server's (frontend/tokenizer_manager.py) waits for admission and detokenizes into an asyncio queue.
"""

from __future__ import annotations

import time
from typing import Any

from radixserve.protocol.io_struct import TokenIDOut


class RequestState:
    def __init__(self, rid: str, prompt_tokens: int) -> None:
        self.rid = rid
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.cached_tokens_details: dict[str, int] | None = None  # by tier, with the hierarchical cache
        self.figures: dict[str, float] | None = None  # the scheduler's (TokenIDOut.figures)
        self.finish_reason: dict[str, Any] | None = None
        self.submitted_at = time.perf_counter()
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.finished_at: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def observe(self, record: TokenIDOut, now: float) -> None:
        """One record of this request from the scheduler (`now`: time.perf_counter()): counts, cache, timing, end."""
        if record.new_token_ids:
            if self.first_token_at is None:
                self.first_token_at = now
            self.last_token_at = now
        self.prompt_tokens, self.completion_tokens = record.prompt_tokens, record.completion_tokens
        self.cached_tokens = record.cached_tokens
        self.cached_tokens_details = record.cached_tokens_details or self.cached_tokens_details
        self.figures = record.figures or self.figures
        if record.finished_reason is not None:
            self.finish_reason = record.finished_reason
            self.finished_at = now

    def ttft(self) -> float | None:
        """Seconds from sending it to its first token; None before."""
        return None if self.first_token_at is None else self.first_token_at - self.submitted_at

    def elapsed(self) -> float:
        """Seconds from sending it to its end (to now while it runs)."""
        return (self.finished_at or time.perf_counter()) - self.submitted_at
