"""What the HTTP process and the scheduler process agree on before the first request: the ZMQ endpoints
between them (`PortArgs`) and what the scheduler reports once its model is loaded (`SchedulerInfo`: the model,
its tokenizer, the pools' sizes and the request limits they set)."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from typing import Any

from radixserve.protocol.requests import RequestLimits


@dataclass(frozen=True)
class PortArgs:
    """ZMQ endpoints between the HTTP process and the scheduler process."""

    request_endpoint: str  # HTTP process PUSH (bind) -> scheduler PULL (connect)
    output_endpoint: str  # scheduler PUSH (connect) -> HTTP process PULL (bind)
    folder: str | None = None  # the private temporary folder of the ipc files, removed at shutdown

    @classmethod
    def new(cls) -> PortArgs:
        folder = tempfile.mkdtemp(prefix="radixserve-ipc-")
        return cls(f"ipc://{folder}/requests", f"ipc://{folder}/outputs", folder)


@dataclass(frozen=True)
class SchedulerInfo:
    """What the HTTP process needs to know about the loaded model and pools."""

    model_name: str
    tokenizer: Any
    context_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_total_num_tokens: int
    page_size: int
    max_running_requests: int
    dtype: str
    device: str
    pid: int
    platform: dict[str, Any] = field(default_factory=dict)  # ModelRunner.platform_info(): dtype reason, CPU
    lora_enabled: bool = False  # requests may name LoRA adapters (the scheduler holds the registry)
    hidden_size: int = 0  # the width of the final norm's output: an embedding's dimensions (/v1/embeddings)

    @property
    def effective_max_context(self) -> int:
        """Longest prompt + completion that can always finish (`RequestLimits.longest_request`)."""
        return self.limits.longest_request

    @property
    def limits(self) -> RequestLimits:
        """What every request must fit (the rule the scheduler checks on arrival)."""
        return RequestLimits(self.context_len, self.max_total_num_tokens, self.page_size, self.vocab_size,
                             self.eos_token_ids)

    def describe(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("tokenizer", "platform")} | {
            "effective_max_context": self.effective_max_context
        }
