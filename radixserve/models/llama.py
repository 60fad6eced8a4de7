"""The Llama family (Llama, Mistral, Qwen2 with QKV bias, Qwen3 with q/k RMSNorm) on the paged KV pool.

Parameter names follow Hugging Face, except that q/k/v are fused into `qkv_proj` and gate/up into
`gate_up_proj` (fewer, larger matrix products; see `load_weights`). Linear layers run the method the
runner chose for their shape (layers/linear.py). With fused ops (`set_fused_ops`, CPU), the passes
between the matrix products run as compiled ops (layers/fused_ops.py): residual add + RMSNorm,
rotary + KV write, SiLU-and-mul; without them, the same steps run as eager torch. The forward (embed, decoder,
logits) and checkpoint loading are every model's (causal_lm.py); a decode batch may run all decoder layers in one
C call instead, over `decoder_weights` (c_decoder.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from radixserve.configs.model_config import ModelConfig
from radixserve.cpu_memory import in_row_pieces
from radixserve.forward_batch import ForwardBatch
from radixserve.layers.activation import silu_and_mul
from radixserve.layers.fused_ops import FusedOps
from radixserve.layers.layernorm import RMSNorm
from radixserve.layers.linear import LinearBase
from radixserve.layers.radix_attention import RadixAttention
from radixserve.layers.rotary_embedding import apply_rotary
from radixserve.models.causal_lm import CausalLM, DecoderLayerWeights, DecoderWeights

if TYPE_CHECKING:
    from radixserve.models.prefill_passes import PrefillPasses


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.qkv_proj = LinearBase(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = LinearBase(self.q_size, config.hidden_size, bias=False)
        self.qk_norm = config.qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.attn = RadixAttention(layer_id, self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5,
                                   sliding_window=config.window_of(layer_id))
        self.rotary_kv = None  # the fused rotary + KV write (set_fused_ops), or None: eager

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        if self.rotary_kv is not None:
            # NOTE: with the fused op, cos and sin are the float32 tables, indexed by position inside the op.
            k_cache, v_cache = fb.token_to_kv_pool.get_kv_buffer(self.attn.layer_id)
            # NOTE: a window layer of a hybrid pool writes at its window slots: the backend says where
            loc = fb.attn_backend.kv_write_loc(self.attn, fb)
            q, k, v = self.rotary_kv(qkv, fb.positions, cos, sin, k_cache, v_cache, loc)
            return self.o_proj(self.attn(q, k, v, fb, save_kv_cache=False))
        v = qkv[:, self.q_size + self.kv_size :].view(tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q = self.q_norm(qkv[:, : self.q_size].view(tokens, self.num_heads, self.head_dim))
            k = self.k_norm(qkv[:, self.q_size : self.q_size + self.kv_size].view(tokens, self.num_kv_heads, self.head_dim))
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        else:
            # NOTE: q and k heads sit side by side in qkv, so one rotary pass covers both.
            qk = qkv[:, : self.q_size + self.kv_size].view(tokens, self.num_heads + self.num_kv_heads, self.head_dim)
            qk = apply_rotary(qk, cos, sin)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        return self.o_proj(self.attn(q, k, v, fb))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = LinearBase(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = LinearBase(config.intermediate_size, config.hidden_size, bias=False)
        self.act = silu_and_mul  # or the fused op (set_fused_ops)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return in_row_pieces(self._rows, hidden, self.gate_up_proj, self.down_proj)

    def _rows(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(hidden)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, cos, sin, fb)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # NOTE: an empty weight, not the default init: the loader fills it, and Embedding's own init on the meta
        # device runs a Python decomposition that imports torch._dynamo (~1.2 s of every start)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(CausalLM):
    """The Llama family's layers (causal_lm.py runs them): pre-norm layers with a fused residual add + RMSNorm,
    and the compiled passes between the matrix products where the plan attaches them."""

    uses_fused_ops = True

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, LlamaModel(config))
        self.fused_ops: FusedOps | None = None

    def run_layers(self, hidden: torch.Tensor, positions: torch.Tensor,
                   fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.fused_ops is not None and self.fused_ops.rotary_kv is not None:
            cos, sin = self.rotary.tables(hidden.device)  # the rotary op looks positions up itself
        else:
            cos, sin = self.rotary.cos_sin(positions, hidden.dtype)
        residual = None
        for layer in self.model.layers:
            hidden, residual = layer(hidden, residual, cos, sin, fb)
        return hidden, residual

    def final_norm(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        return self.model.norm(hidden, residual)[0] if residual is not None else self.model.norm(hidden)

    def decoder_weights(self) -> DecoderWeights | None:
        """The weight view a decoder outside the Python layers reads; None where the layers are not plain
        pre-norm rotary layers (q/k norms)."""
        if self.config.qk_norm:
            return None
        layers = tuple(DecoderLayerWeights(layer.input_layernorm.weight.detach(),
                                           layer.post_attention_layernorm.weight.detach(),
                                           layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                           layer.mlp.gate_up_proj, layer.mlp.down_proj)
                       for layer in self.model.layers)
        return DecoderWeights(self.config, layers, self.rotary, self.model.layers[0].self_attn.attn.scaling)

    def set_fused_ops(self, ops: FusedOps | None, passes: PrefillPasses | None = None) -> None:
        """Runs the passes between matrix products as these compiled ops (None: eager torch); `passes`, if given, in
        place of the compiled SiLU-and-mul and add + RMSNorm (the C decoder's, models/prefill_passes.py)."""
        dtype = self.model.norm.weight.dtype  # NOTE: norms stay float in every format, embeddings may be packed
        if ops is not None and ops.dtype != dtype:
            raise ValueError(f"fused ops built for {ops.dtype}, model in {dtype}")
        self.fused_ops = ops
        add_rmsnorm = passes.add_rmsnorm if passes else ops.add_rmsnorm if ops else None
        for layer in self.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.fused_add = add_rmsnorm
            layer.self_attn.rotary_kv = ops.rotary_kv if ops else None
            layer.mlp.act = passes.silu_and_mul if passes else ops.silu_and_mul if ops else silu_and_mul
        self.model.norm.fused_add = add_rmsnorm
