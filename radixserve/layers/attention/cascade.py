"""Cascade attention: the prefix shared by the whole batch is attended once, not once per request.

The radix cache makes requests with a common prefix point at the same KV slots, so their
`req_to_token` rows are equal over it. When every request of a batch shares the first P slots
(and the batch passes `CascadePolicy`), each request's attention is split in two and merged exactly:

(a) all query tokens of the batch against the shared K/V rows, in one call that reads them once: the C
    kernel `prefix_attention.c` on the CPU (where selected for the kernel level, kernels.attention.SELECTED),
    else one attention over [1, heads, all queries, shared keys]. For a full layer these are the P prefix
    rows, unmasked (every query sits at a position >= P);
(b) each request's own positions P.. (decode: the C decode kernel, or one padded batch; extend:
    the C extend kernel, or causal attention per request, the diagonal shifted by the request's
    cached tokens beyond P);

then out = (e^{lse_a} out_a + e^{lse_b} out_b) / (e^{lse_a} + e^{lse_b}) in float32, i.e. a lerp by
sigmoid(lse_a - lse_b). The C decode and extend kernels do this merge themselves: they start each
row's running softmax from part (a). Part (b) is never empty: a decode request's new token is past
P, and every extend request has at least one new token.

Window layers (window_cascade.py plans them) split the same way, with each side cut to the window: part (a)
covers only the shared positions some query of the batch still sees, and within them each query token has a
lower bound of its own (`prefix_first`: the C prefix kernel's `first`, an additive bias in torch). A query may
see none of the shared keys; its part (a) is then empty (out 0, lse -inf), which the merge and the kernels'
seeding take as "no keys", so its result is exactly part (b).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from radixserve.configs.row_table import CascadePolicy
from radixserve.layers.attention.base import gather_kv

if TYPE_CHECKING:
    from radixserve.forward_batch import ForwardBatch
    from radixserve.kernels.attention import DecodeKernel

_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
MAX_SCORE_ELEMENTS = 1 << 26  # float32 scores the plain-torch path (off the CPU) holds at once: 256 MiB


@dataclass
class CascadeDecodeMetadata:
    prefix_slots: torch.Tensor  # [S] pool slots of the shared keys part (a) reads (full layers: all P)
    suffix_indices: torch.Tensor  # [bs * suffix_max_len] slots of positions P.., row-major, padded
    suffix_lens: torch.Tensor  # int64 [bs], >= 1
    suffix_max_len: int
    suffix_mask: torch.Tensor | None  # bool [bs, suffix_max_len], True beyond a request's end; None: none
    prefix_first: torch.Tensor | None = None  # int32 [bs]: the first prefix_slots index a query sees; None: 0
    _prefix_bias: dict[torch.dtype, torch.Tensor] = field(default_factory=dict, repr=False)


@dataclass
class SuffixSlice:
    q_start: int
    q_len: int
    kv_start: int  # into the gathered suffix contexts
    kv_len: int  # the request's positions P .. seq_len
    visible: torch.Tensor | None  # bool [q_len, kv_len], shifted causal; None: plain causal (q_len == kv_len)
    _bias: dict[torch.dtype, torch.Tensor] = field(default_factory=dict, repr=False)

    def bias(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The mask as an additive bias (0 / -inf) in `dtype`, built once per forward."""
        if self.visible is None:
            return None
        if dtype not in self._bias:
            self._bias[dtype] = _additive(~self.visible, dtype)
        return self._bias[dtype]


@dataclass
class CascadeExtendMetadata:
    prefix_slots: torch.Tensor  # [S] as for decode
    slices: list[SuffixSlice]
    suffix_indices: torch.Tensor  # flat slots of every request's positions P .. seq_len
    suffix_reqs: torch.Tensor  # int64 [bs, 4]: the slices' (q_start, q_len, kv_start, kv_len), for the C kernel
    prefix_first: torch.Tensor | None = None  # int32 [num_tokens], as for decode
    window: int = 0  # a window layer's W, for the C extend kernel's part (b); 0: causal only
    _prefix_bias: dict[torch.dtype, torch.Tensor] = field(default_factory=dict, repr=False)


CascadeMetadata = CascadeDecodeMetadata | CascadeExtendMetadata


def prefix_bias(meta: CascadeMetadata, dtype: torch.dtype) -> torch.Tensor | None:
    """Part (a)'s mask as an additive bias [queries, S] (0 / -inf) in `dtype`, built once per forward; None: none."""
    if meta.prefix_first is None:
        return None
    if dtype not in meta._prefix_bias:
        keys = torch.arange(meta.prefix_slots.shape[0], device=meta.prefix_slots.device)
        meta._prefix_bias[dtype] = _additive(keys.unsqueeze(0) < meta.prefix_first.unsqueeze(1), dtype)
    return meta._prefix_bias[dtype]


def shared_prefix_len(fb: ForwardBatch, limit: int) -> int:
    """The longest P <= limit such that every request's first P slots are the same (one host sync)."""
    rows = fb.req_to_token_pool.req_to_token[fb.req_pool_indices, :limit]
    differs = (rows != rows[:1]).any(dim=0)
    sentinel = torch.ones(1, dtype=torch.bool, device=differs.device)
    return int(torch.cat([differs, sentinel]).to(torch.int8).argmax())  # first differing position, or limit


def batch_prefix_len(fb: ForwardBatch, policy: CascadePolicy) -> int:
    """P, the batch's shared prefix that part (a) may cover (one host sync); 0 where no layer could take cascade.

    The limit is min(seq_len) - 1 for decode (NOTE: the new token stays in every request's suffix) and
    min(cached prefix) for extend (NOTE: every query then sits past all of part (a))."""
    decode = fb.forward_mode.is_decode()
    limit = min(fb.seq_lens_cpu) - 1 if decode else min(fb.extend_prefix_lens_cpu)
    if not policy.takes(decode, fb.batch_size, limit):  # NOTE: no layer reads more than P <= limit shared keys
        return 0
    return shared_prefix_len(fb, limit)


def plan_decode(fb: ForwardBatch, policy: CascadePolicy, prefix_len: int | None = None) -> CascadeDecodeMetadata | None:
    """Full layers' decode plan; `prefix_len`: batch_prefix_len, when the caller has it already."""
    prefix_len = batch_prefix_len(fb, policy) if prefix_len is None else prefix_len
    if prefix_len == 0 or not policy.takes(True, fb.batch_size, prefix_len):
        return None
    table = fb.req_to_token_pool.req_to_token
    lens = fb.seq_lens_cpu
    max_len = max(lens)
    suffix_lens = fb.seq_lens - prefix_len
    mask = None
    if min(lens) != max_len:
        mask = torch.arange(max_len - prefix_len, device=table.device).unsqueeze(0) >= suffix_lens.unsqueeze(1)
    return CascadeDecodeMetadata(prefix_slots(fb, 0, prefix_len),
                                 table[fb.req_pool_indices, prefix_len:max_len].reshape(-1),
                                 suffix_lens, max_len - prefix_len, mask)


def plan_extend(fb: ForwardBatch, policy: CascadePolicy, prefix_len: int | None = None) -> CascadeExtendMetadata | None:
    """Full layers' extend plan; `prefix_len` as for plan_decode."""
    prefix_len = batch_prefix_len(fb, policy) if prefix_len is None else prefix_len
    if prefix_len == 0 or not policy.takes(False, fb.batch_size, prefix_len):
        return None
    prefix_lens, extend_lens = fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu
    table = fb.req_to_token_pool.req_to_token
    device = table.device
    kv_lens = [p - prefix_len + n for p, n in zip(prefix_lens, extend_lens, strict=True)]
    rows = table[fb.req_pool_indices, prefix_len : prefix_len + max(kv_lens)]
    valid = torch.arange(rows.shape[1], device=device).unsqueeze(0) < (fb.seq_lens - prefix_len).unsqueeze(1)
    slices = [
        SuffixSlice(qs, n, ks, m, shifted_causal(m - n, n, device) if m != n else None)
        for qs, ks, n, m in zip(offsets(extend_lens), offsets(kv_lens), extend_lens, kv_lens, strict=True)
    ]
    reqs = torch.tensor([(s.q_start, s.q_len, s.kv_start, s.kv_len) for s in slices], dtype=torch.int64)
    return CascadeExtendMetadata(prefix_slots(fb, 0, prefix_len), slices, rows[valid], reqs)


def prefix_slots(fb: ForwardBatch, start: int, end: int) -> torch.Tensor:
    """The shared slots of positions start .. end (every request's row has them)."""
    # NOTE: a copy, not a view of req_to_token: the table may change once init_forward_metadata returns
    return fb.req_to_token_pool.req_to_token[fb.req_pool_indices[0], start:end].clone()


def cascade_decode(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, meta: CascadeDecodeMetadata,
                   scaling: float, kernel: DecodeKernel | None,
                   prefix_kernel: DecodeKernel | None = None) -> torch.Tensor:
    """q [bs, heads, dim]; k/v_all the layer's pool [slots, kv_heads, dim] -> [bs, heads, dim].

    `kernel`: the C decode kernel for part (b), `prefix_kernel`: the C prefix kernel for part (a); None: torch."""
    part_a = _part_a(q, k_all, v_all, meta, scaling, prefix_kernel)
    if kernel is not None:  # the decode kernel starts each row from part (a): the merge is free
        return kernel(q, k_all, v_all, meta.suffix_indices, meta.suffix_lens, meta.suffix_max_len, scaling, part_a)
    bs, kv_heads, dim = q.shape[0], k_all.shape[1], q.shape[2]
    keys = gather_kv(k_all, meta.suffix_indices, q.dtype).view(bs, meta.suffix_max_len, kv_heads, dim).transpose(1, 2)
    values = gather_kv(v_all, meta.suffix_indices, q.dtype).view(bs, meta.suffix_max_len, kv_heads, dim).transpose(1, 2)
    bias = None if meta.suffix_mask is None else _additive(meta.suffix_mask, q.dtype).view(bs, 1, 1, -1)
    out_b, lse_b = attention_with_lse(q.unsqueeze(2), keys, values, scaling, bias)
    return merge_partials(*part_a, out_b.squeeze(2), lse_b.squeeze(2)).to(q.dtype)


def cascade_extend(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, meta: CascadeExtendMetadata,
                   scaling: float, prefix_kernel: DecodeKernel | None,
                   extend_kernel: DecodeKernel | None = None) -> torch.Tensor:
    """q [num_tokens, heads, dim] (new K/V already in the pool) -> [num_tokens, heads, dim].

    `prefix_kernel` / `extend_kernel`: the C kernels for parts (a) / (b); None: torch."""
    out_a, lse_a = _part_a(q, k_all, v_all, meta, scaling, prefix_kernel)
    if extend_kernel is not None:  # part (b) starts each row from part (a): the merge is free
        return extend_kernel.extend(q, k_all, v_all, meta.suffix_indices, meta.suffix_reqs, scaling,
                                    seed=(out_a, lse_a), window=meta.window)[0]
    keys, values = gather_kv(k_all, meta.suffix_indices, q.dtype), gather_kv(v_all, meta.suffix_indices, q.dtype)
    out_b = torch.empty_like(q)
    lse_b = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    for s in meta.slices:
        qs, ks = slice(s.q_start, s.q_start + s.q_len), slice(s.kv_start, s.kv_start + s.kv_len)
        out, lse = attention_with_lse(_heads_first(q[qs]), _heads_first(keys[ks]), _heads_first(values[ks]),
                                      scaling, s.bias(q.dtype), causal=s.visible is None)
        out_b[qs], lse_b[qs] = out[0].transpose(0, 1), lse[0].transpose(0, 1)
    return merge_partials(out_a, lse_a, out_b, lse_b).to(q.dtype)


def _part_a(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, meta: CascadeMetadata, scaling: float,
            prefix_kernel: DecodeKernel | None) -> tuple[torch.Tensor, torch.Tensor]:
    if prefix_kernel is not None:
        return prefix_kernel.shared_prefix(q, k_all, v_all, meta.prefix_slots, scaling, first=meta.prefix_first)
    out, lse = _prefix_torch(q, k_all, v_all, meta.prefix_slots, scaling, prefix_bias(meta, q.dtype))
    if meta.prefix_first is not None:
        # NOTE: a query that sees no shared key must leave the empty partial (0, -inf): torch's CPU flash op
        # returns lse 0 for such a row, the math path NaN; the merge and the kernels' seeds need exactly (0, -inf)
        empty = (meta.prefix_first >= meta.prefix_slots.shape[0]).to(q.device).unsqueeze(1)
        out, lse = out.masked_fill(empty.unsqueeze(2), 0.0), lse.masked_fill(empty, float("-inf"))
    return out, lse


def merge_partials(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                   lse_b: torch.Tensor) -> torch.Tensor:
    """Exact merge of two softmax partials over disjoint keys; out [..., dim], lse [...] -> float32 [..., dim]."""
    weight_a = torch.sigmoid((lse_a - lse_b).float()).unsqueeze(-1)  # e^{lse_a} / (e^{lse_a} + e^{lse_b})
    return torch.lerp(out_b.float(), out_a.float(), weight_a)


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float,
                       bias: torch.Tensor | None = None, causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, heads, L, dim], k/v [B, kv_heads, S, dim], bias additive (broadcast to [B, heads, L, S]) in q's
    dtype -> (out [B, heads, L, dim] in q's dtype, float32 log-sum-exp [B, heads, L]). `causal`: top-left."""
    if q.device.type == "cpu" and _CPU_FLASH is not None:
        return _CPU_FLASH(q, k, v, is_causal=causal, attn_mask=bias, scale=scaling)
    batch, heads, length, _ = q.shape
    rows = max(1, MAX_SCORE_ELEMENTS // (batch * heads * k.shape[2]))  # query rows per block of float32 scores
    parts = [_math_attention(q[:, :, start : start + rows], k, v, scaling, _rows(bias, start, rows, length),
                             start if causal else None) for start in range(0, length, rows)]
    return torch.cat([o for o, _ in parts], dim=2), torch.cat([lse for _, lse in parts], dim=2)


def _math_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float, bias: torch.Tensor | None,
                    causal_from: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """attention_with_lse in float32 torch ops; query row i sits at key position causal_from + i if causal."""
    batch, heads, length, dim = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    group = heads // kv_heads
    scores = (q.float().reshape(batch, kv_heads, group * length, dim) @ k.float().transpose(-1, -2)).mul_(scaling)
    scores = scores.view(batch, kv_heads, group, length, keys)
    if causal_from is not None:
        q_pos = torch.arange(causal_from, causal_from + length, device=q.device).unsqueeze(1)
        scores = scores.masked_fill(torch.arange(keys, device=q.device).unsqueeze(0) > q_pos, float("-inf"))
    if bias is not None:
        scores = scores + (bias.unsqueeze(2) if bias.dim() == 4 else bias).float()
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1)).view(batch, kv_heads, group * length, keys)
    out = (probs @ v.float()).view(batch, heads, length, dim)
    return out.to(q.dtype), lse.view(batch, heads, length)


def _rows(bias: torch.Tensor | None, start: int, rows: int, length: int) -> torch.Tensor | None:
    """The bias of query rows start .. start + rows (a bias broadcast over the rows stays as is)."""
    if bias is None or bias.dim() < 2 or bias.shape[-2] != length:
        return bias
    return bias[..., start : start + rows, :]


def _prefix_torch(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, slots: torch.Tensor,
                  scaling: float, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Part (a) in torch: q [n, heads, dim] -> (out [n, heads, dim], lse [n, heads]); bias [n, S] or None."""
    keys, values = _heads_first(gather_kv(k_all, slots, q.dtype)), _heads_first(gather_kv(v_all, slots, q.dtype))
    out, lse = attention_with_lse(_heads_first(q), keys, values, scaling, bias)
    return out[0].transpose(0, 1), lse[0].transpose(0, 1)


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[tokens, heads, dim] -> [1, heads, tokens, dim] (a view)."""
    return x.transpose(0, 1).unsqueeze(0)


def _additive(masked: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(masked.shape, dtype=dtype, device=masked.device).masked_fill_(masked, float("-inf"))


def shifted_causal(shift: int, q_len: int, device: torch.device) -> torch.Tensor:
    """Query i (at position shift + i) sees keys 0 .. shift + i."""
    q_pos = torch.arange(q_len, device=device).unsqueeze(1) + shift
    return torch.arange(shift + q_len, device=device).unsqueeze(0) <= q_pos


def offsets(lengths: list[int]) -> list[int]:
    starts, total = [], 0
    for n in lengths:
        starts.append(total)
        total += n
    return starts
