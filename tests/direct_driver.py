"""Drive a ModelRunner directly, without a scheduler: for model tests and forward benchmarks.

It does the bookkeeping the scheduler does for real (a request row, KV slots from the allocator,
`req_to_token` entries) and nothing else: no radix cache, no admission control.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from radixserve.forward_batch import ForwardBatch
from radixserve.model_executor.model_runner import ModelRunner


@dataclass
class DirectRequest:
    row: int
    token_ids: list[int] = field(default_factory=list)  # tokens whose K/V are in the pool
    owned: list[torch.Tensor] = field(default_factory=list)  # slots this request frees on release


class DirectDriver:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.device = runner.device
        self.live: list[DirectRequest] = []

    def new_request(self, share_prefix_of: DirectRequest | None = None, prefix_len: int = 0) -> DirectRequest:
        """A request row; optionally starting with the first `prefix_len` cached tokens of another request."""
        rows = self.runner.req_to_token_pool.alloc(1)
        if rows is None:
            raise RuntimeError("no free request row")
        req = DirectRequest(rows[0])
        self.live.append(req)
        if share_prefix_of is not None and prefix_len:
            table = self.runner.req_to_token_pool.req_to_token
            table[req.row, :prefix_len] = table[share_prefix_of.row, :prefix_len]
            req.token_ids = list(share_prefix_of.token_ids[:prefix_len])
        return req

    def extend(self, reqs: list[DirectRequest], new_tokens: list[list[int]], lora_adapters: list | None = None,
               ) -> torch.Tensor:
        """Computes the new tokens of each request over its cached prefix; logits [bs, vocab]. `lora_adapters`:
        each request's LoRA adapter (lora/adapter.LoraAdapter or None), or None for the base model alone."""
        prefix_lens = [len(r.token_ids) for r in reqs]
        extend_lens = [len(t) for t in new_tokens]
        seq_lens = [p + n for p, n in zip(prefix_lens, extend_lens, strict=True)]
        slots = self._alloc(self.runner.token_to_kv_pool_allocator.alloc_extend(
            prefix_lens, seq_lens, self._last_locs(reqs), sum(extend_lens)))
        offset = 0
        for req, tokens, prefix in zip(reqs, new_tokens, prefix_lens, strict=True):
            self._assign(req, prefix, tokens, slots[offset : offset + len(tokens)])
            offset += len(tokens)
        input_ids = [t for tokens in new_tokens for t in tokens]
        fb = ForwardBatch.for_extend(input_ids, [r.row for r in reqs], prefix_lens, extend_lens, slots, self.device)
        fb.lora_adapters = lora_adapters
        return self.runner.forward(fb)

    def decode(self, reqs: list[DirectRequest], tokens: list[int], lora_adapters: list | None = None) -> torch.Tensor:
        """One new token per request; logits [bs, vocab]."""
        seq_lens = [len(r.token_ids) + 1 for r in reqs]
        slots = self._alloc(self.runner.token_to_kv_pool_allocator.alloc_decode(seq_lens, self._last_locs(reqs)))
        for i, (req, token) in enumerate(zip(reqs, tokens, strict=True)):
            self._assign(req, seq_lens[i] - 1, [token], slots[i : i + 1])
        fb = ForwardBatch.for_decode(tokens, [r.row for r in reqs], seq_lens, slots, self.device)
        fb.lora_adapters = lora_adapters
        return self.runner.forward(fb)

    def release(self, reqs: list[DirectRequest]) -> None:
        allocator = self.runner.token_to_kv_pool_allocator
        for req in reqs:
            if req.owned:
                allocator.free(torch.cat(req.owned))
            self.runner.req_to_token_pool.free(req.row)
            req.owned = []
            self.live.remove(req)

    def release_all(self) -> None:
        self.release(list(self.live))

    def _assign(self, req: DirectRequest, start: int, tokens: list[int], slots: torch.Tensor) -> None:
        self.runner.req_to_token_pool.req_to_token[req.row, start : start + len(tokens)] = slots
        req.token_ids.extend(tokens)
        req.owned.append(slots)

    def _last_locs(self, reqs: list[DirectRequest]) -> list[int]:
        table = self.runner.req_to_token_pool.req_to_token
        return [int(table[r.row, len(r.token_ids) - 1]) if r.token_ids else -1 for r in reqs]

    @staticmethod
    def _alloc(slots: torch.Tensor | None) -> torch.Tensor:
        if slots is None:
            raise RuntimeError("KV pool is full")
        return slots
