"""ForwardBatch: everything one model forward needs, as tensors on the device."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum, auto

import torch


class ForwardMode(IntEnum):
    EXTEND = auto()  # prefill, possibly over a cached prefix (extend_prefix_lens > 0)
    DECODE = auto()  # one new token per request
    IDLE = auto()

    def is_extend(self) -> bool:
        return self == ForwardMode.EXTEND

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE


@dataclass
class ForwardBatch:
    """One forward. `out_cache_loc` holds the KV slots this forward writes, one per input token.

    The model writes new K/V into `out_cache_loc`, then each request attends over
    `req_to_token[req_pool_indices[i], :seq_lens[i]]`: cached prefix slots and new ones alike.
    Token-level tensors are flat over the batch, requests in order.
    """

    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # int64 [num_tokens]; decode: filled on the device (FutureMap) unless given
    positions: torch.Tensor  # int64 [num_tokens]
    req_pool_indices: torch.Tensor  # int64 [bs]
    seq_lens: torch.Tensor  # int64 [bs], prefix + new tokens
    out_cache_loc: torch.Tensor  # SLOT_DTYPE (int32) [num_tokens], as the allocator handed them out
    seq_lens_cpu: list[int]
    extend_prefix_lens: torch.Tensor | None = None  # int64 [bs], extend only
    extend_seq_lens: torch.Tensor | None = None  # int64 [bs], extend only
    extend_prefix_lens_cpu: list[int] | None = None
    extend_seq_lens_cpu: list[int] | None = None
    # Input logprobs (extend only): logits are also wanted at these flat token indices, scoring the
    # next prompt token of each (extra_target_ids), with extra_top_k alternatives; the runner sets
    # input_logprobs (a TokenLogprobs, one row per index) after the forward.
    extra_logits_indices: torch.Tensor | None = None
    extra_target_ids: torch.Tensor | None = None
    extra_top_k: int = 0
    input_logprob_counts: list[int] | None = None  # per request: how many of the extra rows are its
    input_logprobs: object | None = None
    # Decode only: (batch indices, token ids) of rows whose input token the host knows and the previous
    # sample is not (a jump-forward's forced tokens fed one per step); they replace the resolved ids.
    host_input_ids: tuple[torch.Tensor, torch.Tensor] | None = None
    # Speculative decoding: a decode-shaped forward whose requests run one row per draft token too
    # (speculative/verify.py); rows, positions and seq_lens are per row, input ids all known on the host.
    verify: object | None = None
    # Multi-LoRA: each request's adapter (lora/adapter.LoraAdapter, None: the base model), or None when no request
    # of the batch has one; the runner groups the rows by adapter (lora/manager.py).
    lora_adapters: list | None = None
    # Embeddings (extend only): each request's pooling ("last", "mean"; None: it generates), or None when no request
    # of the batch embeds; the model then sets `pooled_hidden`, float32 [bs, hidden] of the final norm's output: the
    # request's last row ("last"), or the sum over this forward's rows ("mean"; layers/pooler.py).
    pooling: list[str | None] | None = None
    pooled_hidden: torch.Tensor | None = None
    # Set by the model runner before the forward: the pools and backend the layers use.
    req_to_token_pool: object | None = None
    token_to_kv_pool: object | None = None
    attn_backend: object | None = None
    # Set by the backend's init_forward_metadata (once per forward, before the first layer): its typed
    # AttentionMetadata (layers/attention/base.py), which every layer reads; graph replays reuse a captured one.
    attn_metadata: object | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def for_extend(cls, input_ids: list[int], req_pool_indices: list[int], prefix_lens: list[int],
                   extend_lens: list[int], out_cache_loc: torch.Tensor, device: torch.device | str) -> ForwardBatch:
        positions = [p for pre, ext in zip(prefix_lens, extend_lens, strict=True) for p in range(pre, pre + ext)]
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
        as_long = lambda xs: torch.tensor(xs, dtype=torch.int64, device=device)  # noqa: E731
        return cls(ForwardMode.EXTEND, len(req_pool_indices), as_long(input_ids), as_long(positions),
                   as_long(req_pool_indices), as_long(seq_lens), out_cache_loc.to(device), seq_lens,
                   as_long(prefix_lens), as_long(extend_lens), list(prefix_lens), list(extend_lens))

    @classmethod
    def for_decode(cls, input_ids: list[int] | torch.Tensor | None, req_pool_indices: list[int], seq_lens: list[int],
                   out_cache_loc: torch.Tensor, device: torch.device | str) -> ForwardBatch:
        """`input_ids` None: the scheduler's forward resolves them on the device (the previous samples)."""
        as_long = lambda xs: torch.as_tensor(xs, dtype=torch.int64).to(device)  # noqa: E731
        positions = [s - 1 for s in seq_lens]
        ids = as_long(input_ids) if input_ids is not None else torch.full((len(seq_lens),), -1, device=device)
        return cls(ForwardMode.DECODE, len(req_pool_indices), ids, as_long(positions), as_long(req_pool_indices),
                   as_long(seq_lens), out_cache_loc.to(device), list(seq_lens))
