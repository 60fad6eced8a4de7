"""The interface every attention backend implements (torch today; a CPU kernel, Triton or FlashInfer later)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from radixserve.layers.radix_attention import RadixAttention
    from radixserve.model_executor.forward_batch import ForwardBatch


def gather_kv(buffer: torch.Tensor, indices: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `indices` of a pool buffer in the compute `dtype` (a bf16 cache under float32 compute is widened here:
    --kv-cache-dtype)."""
    return buffer.index_select(0, indices).to(dtype)


def as_cached(x: torch.Tensor, kv_dtype: torch.dtype) -> torch.Tensor:
    """New K or V as attention reads them back from a `kv_dtype` cache: rounded through it, in x's dtype.
    NOTE: every path attends over the cached values, so a prompt gives the same result whether its prefix was a
    cache hit (read back from the pool) or computed in this forward."""
    return x if x.dtype == kv_dtype else x.to(kv_dtype).to(x.dtype)


@dataclass(frozen=True)
class AttentionPlan:
    """What a backend is told when it is built: its name, whether it may run cascade attention, the model's
    sliding windows, and per dtype the C kernels it uses ("decode", "extend", "prefix", "extend_amx", "prefix_amx"); every other part runs in torch.
    Decided once by `registry.plan_attention` (from the kernels' measured table, the CPU and the switches)."""

    backend: str
    cascade: bool = True
    kernels: Mapping[torch.dtype, frozenset[str]] = field(default_factory=dict)
    level: str | None = None  # the C kernels' ISA level
    kernel_class: str | None = None  # the class the measured table is keyed by (the level, or amx)
    windows: tuple[int, ...] = ()  # the model's distinct sliding windows (window.py builds their tables)

    def uses(self, kernel: str, dtype: torch.dtype) -> bool:
        return kernel in self.kernels.get(dtype, frozenset())

    def used(self, dtype: torch.dtype) -> list[str]:
        return sorted(self.kernels.get(dtype, frozenset()))


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

    def kv_write_loc(self, layer: RadixAttention, forward_batch: ForwardBatch) -> torch.Tensor:
        """The pool slots where `layer` stores this forward's new K/V (a model that writes them itself asks here)."""
        return forward_batch.out_cache_loc

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention,
                forward_batch: ForwardBatch, save_kv_cache: bool = True) -> torch.Tensor:
        if forward_batch.forward_mode.is_decode():
            return self.forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
        return self.forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
