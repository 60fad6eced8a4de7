"""What the scheduler needs of a model runner, written down: `ModelRunner` is one, the tests' fakes are others.

The scheduler reads the sizes and pools once at construction (its KVManager owns the pools from then
on) and calls `forward`, `sample` and `logprobs` through its ForwardPipeline; nothing else. Optional: a runner
may have `fast_decode_rows` (the most rows its fast decode path takes), which sizes speculative drafts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from radixserve.forward_batch import ForwardBatch
    from radixserve.mem_cache.allocator import TokenToKVPoolAllocator
    from radixserve.mem_cache.memory_pool import ReqToTokenPool


class RunnerModelConfig(Protocol):
    vocab_size: int
    eos_token_ids: Sequence[int]


class SchedulerRunner(Protocol):
    device: torch.device
    page_size: int
    context_len: int
    max_total_num_tokens: int
    max_running_requests: int
    model_config: RunnerModelConfig
    tokenizer: Any  # None where there is none (a fake runner): then no stop-string text matching
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool_allocator: TokenToKVPoolAllocator

    def forward(self, forward_batch: ForwardBatch, read_done: Any = None) -> torch.Tensor: ...

    def sample(self, logits: torch.Tensor, sampling_info: Any) -> torch.Tensor: ...

    def logprobs(self, logits: torch.Tensor, next_ids: torch.Tensor, sampling_info: Any, top_k: int) -> Any: ...
