"""RadixAttention: the attention layer of the model; the per-step work is done by the backend."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from radixserve.forward_batch import ForwardBatch


class RadixAttention(nn.Module):
    """Writes this layer's new K/V into the KV pool and attends over each request's context.

    `sliding_window` W: a query at position p sees keys p - W + 1 .. p only (W tokens, itself included), as in
    transformers; None: every earlier key. The backend reads it per layer (docs/sliding_window.md).
    `logit_cap` c (Gemma 2): the scaled scores s become c * tanh(s / c) before the mask and softmax; None: off.
    Such a layer runs the backend's torch math attention (layers/attention/softcap.py), never a C kernel."""

    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int, scaling: float,
                 sliding_window: int | None = None, logit_cap: float | None = None) -> None:
        super().__init__()
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1, got {sliding_window}")
        if logit_cap is not None and not logit_cap > 0:
            raise ValueError(f"logit_cap must be positive, got {logit_cap}")
        self.sliding_window = sliding_window
        self.logit_cap = logit_cap
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
