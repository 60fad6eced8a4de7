"""RadixAttention: the attention layer of the model; the per-step work is done by the backend."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from radixserve.model_executor.forward_batch import ForwardBatch


class RadixAttention(nn.Module):
    """Writes this layer's new K/V into the KV pool and attends over each request's context."""

    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int, scaling: float) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, forward_batch: ForwardBatch,
                save_kv_cache: bool = True) -> torch.Tensor:
        """q: [T, heads, dim], k/v: [T, kv_heads, dim] -> [T, heads * dim]; `save_kv_cache=False` when
        the caller already wrote k/v into the pool at `forward_batch.out_cache_loc`."""
        return forward_batch.attn_backend.forward(q, k, v, self, forward_batch, save_kv_cache)
