"""Fused passes between the matrix products of a decoder layer, compiled ahead of time on the CPU.

Three ops, each the eager layers' own torch function (`rms_norm`, `apply_rotary`, `silu_and_mul`: one
definition, compiled here or run eagerly there, so the results follow the same rounding steps):

- `add_rmsnorm`: x + residual, then RMSNorm of the sum; returns (normed, sum).
- `rotary_kv`: splits a fused qkv row into q, k, v, rotates q and k, and writes k and v into this
  layer's KV buffers at the forward's slots (rounded to the cache's dtype: --kv-cache-dtype); returns (q, k, v).
- `silu_and_mul`: SiLU(gate) * up of a fused [gate | up] row.

Each is exported with a dynamic token count and compiled by inductor's C++ backend into a shared
library (AOTInductor, aot_cache.py), once per machine, torch version, dtype and shape; later starts load
it in milliseconds. A call goes straight to the compiled code (about 2 us of overhead, against 15-25 us
for a torch.compile'd function), so the fused ops also pay at batch 1. CPU only: elsewhere, with
--disable-fused-ops, or when compiling fails, the layers run their eager code.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from radixserve.layers.activation import silu_and_mul
from radixserve.layers.aot_cache import AotOp, compile_aot_op
from radixserve.layers.layernorm import rms_norm
from radixserve.layers.rotary_embedding import apply_rotary
from radixserve.mem_cache.memory_pool import SLOT_DTYPE

logger = logging.getLogger(__name__)


class AddRMSNorm(nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor):
        x = x + residual
        return rms_norm(x, weight, self.eps), x


class RotaryKV(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim

    def forward(self, qkv: torch.Tensor, positions: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, loc: torch.Tensor):
        tokens, dtype = qkv.shape[0], qkv.dtype
        qk_heads = self.num_heads + self.num_kv_heads
        cos = cos_table[positions].to(dtype).unsqueeze(1)
        sin = sin_table[positions].to(dtype).unsqueeze(1)
        # NOTE: q and k heads side by side in qkv: one rotary pass covers both
        qk = apply_rotary(qkv[:, : qk_heads * self.head_dim].view(tokens, qk_heads, self.head_dim), cos, sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, qk_heads * self.head_dim :].view(tokens, self.num_kv_heads, self.head_dim)
        k_cache.index_put_((loc,), k.to(k_cache.dtype))
        v_cache.index_put_((loc,), v.to(v_cache.dtype))
        return q.contiguous(), k.contiguous(), v.contiguous()


class SiluAndMul(nn.Module):
    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(gate_up)


@dataclass
class FusedOps:
    """The compiled ops of one model shape and dtype; `rotary_kv` is None where the layer needs more
    than plain rotary (q/k norms), and that layer keeps its eager code for that part."""

    dtype: torch.dtype
    add_rmsnorm: AotOp
    silu_and_mul: AotOp
    rotary_kv: AotOp | None


def load_fused_ops(config, dtype: torch.dtype, device: torch.device,
                   kv_dtype: torch.dtype | None = None) -> FusedOps | None:
    """The model's fused ops (`rotary_kv` writing a `kv_dtype` cache, default `dtype`), compiled on first use and
    cached; None off the CPU or if compiling fails."""
    if device.type != "cpu":
        return None
    try:
        return _load(config, dtype, kv_dtype or dtype)
    except Exception as e:  # a missing compiler, an inductor error: the eager layers still work
        logger.warning("fused CPU ops unavailable (%s: %s); the layers run their eager code",
                       type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return None


def _load(config, dtype: torch.dtype, kv_dtype: torch.dtype) -> FusedOps:
    tokens = 5  # NOTE: example inputs only; the token count is exported as dynamic (at least 1)
    hidden, heads, kv_heads, dim = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape).to(dtype)

    x = rand(tokens, hidden)
    add_rmsnorm = compile_aot_op(
        f"add_rmsnorm-eps{config.rms_norm_eps:g}", AddRMSNorm(config.rms_norm_eps), (x, rand(tokens, hidden), rand(hidden)),
        dynamic={0: ("tokens", 0), 1: ("tokens", 0)})
    silu_and_mul = compile_aot_op(
        "silu_and_mul", SiluAndMul(), (rand(tokens, 2 * config.intermediate_size),), dynamic={0: ("tokens", 0)})
    rotary_kv = None
    if not config.qk_norm:
        slots, positions = 16, 32
        table = torch.rand(positions, dim // 2)
        rotary_kv = compile_aot_op(
            f"rotary_kv-h{heads}-kv{kv_heads}-d{dim}", RotaryKV(heads, kv_heads, dim),
            (rand(tokens, (heads + 2 * kv_heads) * dim), torch.arange(tokens), table, table.clone(),
             rand(slots, kv_heads, dim).to(kv_dtype), rand(slots, kv_heads, dim).to(kv_dtype),
             torch.arange(1, tokens + 1, dtype=SLOT_DTYPE)),
            dynamic={0: ("tokens", 0), 1: ("tokens", 0), 2: ("positions", 0), 3: ("positions", 0),
                     4: ("slots", 0), 5: ("slots", 0), 6: ("tokens", 0)})
    return FusedOps(dtype, add_rmsnorm, silu_and_mul, rotary_kv)
