"""The interface every attention backend implements (torch, the CPU's C kernels, Triton), the typed per-forward
metadata it returns, and the hooks the CUDA graph runner calls (model_executor/cuda_graph_runner.py)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from radixserve.configs.row_table import DEFAULT_ROWS, RowTable

if TYPE_CHECKING:
    from radixserve.forward_batch import ForwardBatch
    from radixserve.layers.radix_attention import RadixAttention


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
    reason: str = ""  # why this backend (registry.resolve_with_reason)
    rows: RowTable = DEFAULT_ROWS  # the plan's row table: the extend kernel's limit, the cascade policy

    def uses(self, kernel: str, dtype: torch.dtype) -> bool:
        return kernel in self.kernels.get(dtype, frozenset())

    def used(self, dtype: torch.dtype) -> list[str]:
        return sorted(self.kernels.get(dtype, frozenset()))


@dataclass
class AttentionMetadata:
    """One forward's attention state: what `init_forward_metadata` built from the batch, carried on
    `ForwardBatch.attn_metadata` to every layer. Each backend subclasses it with its own tables.
    `graph`: built over the graph runner's static buffers (refilled in place at each replay)."""

    graph: bool = field(default=False, kw_only=True)


class AttentionBackend(ABC):
    """One instance per ModelRunner; it holds what is decided once (its plan, kernels, counters), never a forward's
    state: that is the `AttentionMetadata` the forward carries.

    `init_forward_metadata` runs once per forward, before the first layer: it turns the batch's
    `req_to_token` rows into whatever index tensors and masks the backend needs (`build_forward_metadata`), so
    that the per-layer `forward` does only tensor work, and puts them on `forward_batch.attn_metadata`.
    `forward` stores the new K/V at `forward_batch.out_cache_loc` (unless `save_kv_cache` is False: the model
    wrote them already) and returns the attention output, [num_tokens, heads * head_dim].

    Graph hooks (decode only; SGLang's init_cuda_graph_state / ..._capture_cuda_graph / ..._replay_cuda_graph):
    `init_graph_state` allocates static tables once for batches up to `max_bs` rows and contexts up to
    `max_context_len`; `init_forward_metadata_capture` builds a bucket's metadata over them (views: the captured
    kernels keep reading these addresses); `init_forward_metadata_replay` refills them in place from the batch
    (the graph runner pads it to the bucket first: padded rows name a dummy row of dummy slots).
    `graph_refusal` says why a backend cannot, or None.
    """

    @abstractmethod
    def build_forward_metadata(self, forward_batch: ForwardBatch) -> AttentionMetadata: ...

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> AttentionMetadata:
        """This forward's metadata, also set on `forward_batch.attn_metadata` (where the layers read it)."""
        meta = self.build_forward_metadata(forward_batch)
        forward_batch.attn_metadata = meta
        return meta

    @classmethod
    def graph_refusal(cls, windows: tuple[int, ...] = (), hybrid: bool = False, context_len: int = 0) -> str | None:
        """None: decode batches of a model with these sliding `windows` (over a `hybrid` pool) and `context_len`
        positions can be captured."""
        return f"the {cls.__name__} backend has no CUDA graph hooks"

    def init_graph_state(self, max_bs: int, max_context_len: int, device: torch.device) -> None:
        raise NotImplementedError(self.graph_refusal())

    def init_forward_metadata_capture(self, forward_batch: ForwardBatch) -> AttentionMetadata:
        """A bucket's metadata over the static tables (forward_batch: the runner's static buffers, cut to the bucket),
        set on `forward_batch.attn_metadata`."""
        raise NotImplementedError(self.graph_refusal())

    def init_forward_metadata_replay(self, forward_batch: ForwardBatch, meta: AttentionMetadata) -> None:
        """Refills `meta` (a capture's) in place for `forward_batch` (already copied into the static buffers)."""
        raise NotImplementedError(self.graph_refusal())

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
