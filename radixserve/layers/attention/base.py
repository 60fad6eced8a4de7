"""The interface every attention backend implements (torch today; a CPU kernel, Triton or FlashInfer later)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from radixserve.layers.radix_attention import RadixAttention
    from radixserve.model_executor.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    """One instance per ModelRunner.

    `init_forward_metadata` runs once per forward, before the first layer: it turns the batch's
    `req_to_token` rows into whatever index tensors and masks the backend needs, so that the
    per-layer `forward` does only tensor work. `forward` stores the new K/V at
    `forward_batch.out_cache_loc` (unless `save_kv_cache` is False: the model wrote them already) and
    returns the attention output, [num_tokens, heads * head_dim].
    """

    @abstractmethod
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None: ...

    @abstractmethod
    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention,
                       forward_batch: ForwardBatch, save_kv_cache: bool = True) -> torch.Tensor: ...

    @abstractmethod
    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention,
                       forward_batch: ForwardBatch, save_kv_cache: bool = True) -> torch.Tensor: ...

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention,
                forward_batch: ForwardBatch, save_kv_cache: bool = True) -> torch.Tensor:
        if forward_batch.forward_mode.is_decode():
            return self.forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
        return self.forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
