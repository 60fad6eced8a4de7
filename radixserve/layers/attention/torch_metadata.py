"""The torch / CPU backend's per-forward metadata (`TorchAttnMetadata`, on `ForwardBatch.attn_metadata`), the
tables it is built from, and the static decode tables its CUDA graph hooks refill in place."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from radixserve.layers.attention import cascade, window
from radixserve.layers.attention.base import AttentionMetadata

if TYPE_CHECKING:
    from radixserve.forward_batch import ForwardBatch


@dataclass
class DecodeMetadata:
    kv_indices: torch.Tensor  # [bs * max_len] pool slots, row-major over (request, position)
    max_len: int
    mask: torch.Tensor | None  # additive float32 [bs, max_len]; None when all lengths are equal


@dataclass
class ExtendSlice:
    q_start: int
    q_len: int
    kv_start: int  # into the gathered context (or into the new tokens when nothing is gathered)
    kv_len: int  # q_len + the request's cached prefix
    _mask: torch.Tensor | None = field(default=None, repr=False)

    def mask(self, device: torch.device) -> torch.Tensor | None:
        """bool [q_len, kv_len], causal with the diagonal shifted by the prefix (built once); None: plain causal."""
        if self.kv_len == self.q_len:
            return None
        if self._mask is None:
            self._mask = cascade.shifted_causal(self.kv_len - self.q_len, self.q_len, device)
        return self._mask


@dataclass
class ExtendMetadata:
    slices: list[ExtendSlice]
    kv_indices: torch.Tensor | None  # flat context slots of all requests; None: attend to new K/V only
    # for the C extend kernel: int32 context slots of every request (the new tokens' when nothing is
    # cached) and int64 [bs, 4] rows (q_start, q_len, kv_start, kv_len); None without the kernel
    kernel_indices: torch.Tensor | None = None
    kernel_reqs: torch.Tensor | None = None


WindowDecode = window.WindowDecodeMetadata | cascade.CascadeDecodeMetadata
WindowExtend = window.WindowExtendMetadata | cascade.CascadeExtendMetadata


@dataclass
class TorchAttnMetadata(AttentionMetadata):
    """What TorchAttnBackend (and CpuAttnBackend) built for one forward. Decode sets `decode` or `cascade_decode`,
    extend `extend` or `cascade_extend` (exactly one of each pair: cascade where the policy took the batch)."""

    decode: DecodeMetadata | None = None
    cascade_decode: cascade.CascadeDecodeMetadata | None = None
    extend: ExtendMetadata | None = None
    cascade_extend: cascade.CascadeExtendMetadata | None = None
    extend_kernel_fits: bool = False  # this extend batch is short enough for the C extend kernel
    # per window size of the model (plan.windows), this forward's tables, or its cascade plan cut to the window;
    # absent: the window hides nothing (a window layer runs what full layers run)
    window_decode: dict[int, WindowDecode] = field(default_factory=dict)
    window_extend: dict[int, WindowExtend] = field(default_factory=dict)
    window_out_loc: torch.Tensor | None = None  # hybrid KV: this forward's new tokens' window slots


def decode_metadata(fb: ForwardBatch) -> DecodeMetadata:
    lens = fb.seq_lens_cpu
    max_len = max(lens)
    table = fb.req_to_token_pool.req_to_token
    kv_indices = table[fb.req_pool_indices, :max_len].reshape(-1)
    mask = None
    if min(lens) != max_len:
        positions = torch.arange(max_len, device=table.device)
        beyond = positions.unsqueeze(0) >= fb.seq_lens.unsqueeze(1)
        mask = torch.zeros(beyond.shape, dtype=torch.float32, device=table.device).masked_fill_(beyond, float("-inf"))
    return DecodeMetadata(kv_indices, max_len, mask)


def extend_metadata(fb: ForwardBatch, with_kernel: bool) -> ExtendMetadata:
    meta = extend_slices(fb)
    if with_kernel:
        # NOTE: with nothing cached, a request's context is its new tokens, stored in the pool before attention
        meta.kernel_indices = meta.kv_indices if meta.kv_indices is not None else fb.out_cache_loc.to(torch.int32)
        meta.kernel_reqs = torch.tensor([(s.q_start, s.q_len, s.kv_start, s.kv_len) for s in meta.slices],
                                        dtype=torch.int64)
    return meta


def extend_slices(fb: ForwardBatch) -> ExtendMetadata:
    prefix_lens, extend_lens = fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu
    if not any(prefix_lens):
        starts = cascade.offsets(extend_lens)
        return ExtendMetadata([ExtendSlice(s, n, s, n) for s, n in zip(starts, extend_lens, strict=True)], None)
    table = fb.req_to_token_pool.req_to_token
    seq_lens = [p + n for p, n in zip(prefix_lens, extend_lens, strict=True)]
    rows = table[fb.req_pool_indices, : max(seq_lens)]
    valid = torch.arange(rows.shape[1], device=fb.input_ids.device).unsqueeze(0) < fb.seq_lens.unsqueeze(1)
    starts = zip(cascade.offsets(extend_lens), cascade.offsets(seq_lens), strict=True)
    slices = [ExtendSlice(qs, n, ks, m) for (qs, ks), n, m in zip(starts, extend_lens, seq_lens, strict=True)]
    return ExtendMetadata(slices, rows[valid])


def metadata_of(fb: ForwardBatch) -> TorchAttnMetadata:
    """The forward's metadata, which this backend's `init_forward_metadata` put on the batch."""
    meta = fb.attn_metadata
    if not isinstance(meta, TorchAttnMetadata):
        # NOTE: a batch's tables are built once per forward, before the first layer; never guessed here
        raise RuntimeError(f"the batch carries {type(meta).__name__}, not this forward's TorchAttnMetadata "
                           "(init_forward_metadata was not called for it)")
    return meta


class GraphDecodeTables:
    """Static decode tables for CUDA graphs: every row is `max_context_len` wide and always masked, so a bucket's
    shapes never depend on the batch. Capture hands out views of the first `bs` rows; replay refills them in place.
    NOTE: a padded row (the graph runner's: request row 0, length 1) reads row 0 of req_to_token, all slot 0."""

    def __init__(self, max_bs: int, max_context_len: int, device: torch.device) -> None:
        self.max_context_len = max_context_len
        self.kv_indices = torch.zeros(max_bs, max_context_len, dtype=torch.int32, device=device)
        self.mask = torch.zeros(max_bs, max_context_len, dtype=torch.float32, device=device)
        self.positions = torch.arange(max_context_len, device=device)

    def capture(self, bs: int) -> DecodeMetadata:
        return DecodeMetadata(self.kv_indices[:bs].view(-1), self.max_context_len, self.mask[:bs])

    def refill(self, fb: ForwardBatch, bs: int) -> None:
        """Rows 0..bs-1 from the batch's req_to_token rows and lengths (no host sync: shapes are fixed)."""
        table = fb.req_to_token_pool.req_to_token
        rows = fb.req_pool_indices[:bs]
        self.kv_indices[:bs].copy_(table[rows, : self.max_context_len])
        beyond = self.positions.unsqueeze(0) >= fb.seq_lens[:bs].unsqueeze(1)
        self.mask[:bs].zero_().masked_fill_(beyond, float("-inf"))
