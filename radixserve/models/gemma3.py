"""Gemma 3 (text) on the paged KV pool: sliding-window and full layers, q/k RMSNorm, GeGLU, four norms per layer.
Gemma 2 (models/gemma2.py) runs these same layers, told apart by its config: no q/k RMSNorm
(`ModelConfig.qk_norm`), one rotary for every layer (`local_rope` None) and soft-capped attention scores
(`attn_logit_softcapping`, handed to each layer's `RadixAttention` as `logit_cap`).

What differs from the Llama family (models/llama.py), each where it happens:
- RMSNorm scales by (1 + w) and rounds once, in float32 (`GemmaRMSNorm`); checkpoints store w, and llama.cpp's
  GGUF stores 1 + w (the converter subtracts the 1 back, gguf_loader.gemma3_tensor);
- embeddings are multiplied by sqrt(hidden_size), rounded to the model dtype first, as transformers does;
- each decoder layer normalises the attention and MLP outputs as well as their inputs (pre and post norms);
- the MLP is GeGLU, gelu (tanh approximation) of the gate times up;
- the attention scale is query_pre_attn_scalar ** -0.5; window layers attend to the last W tokens only
  (`ModelConfig.layer_windows`, handed to each layer's `RadixAttention`) and use their own rotary base;
- logits may be soft-capped (cap * tanh(logits / cap)).
Weights load under Hugging Face names with q/k/v and gate/up fused, and the forward is every model's
(causal_lm.py). The layers run eager torch (no fused ops: those are the Llama layers'); decode batches run them in
one C call where the plan allows (`decoder_weights`, csrc/decode_gemma.h), except with soft-capped attention
(Gemma 2).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.configs.model_config import ModelConfig
from radixserve.cpu_memory import in_row_pieces
from radixserve.forward_batch import ForwardBatch
from radixserve.layers.linear import LinearBase
from radixserve.layers.radix_attention import RadixAttention
from radixserve.layers.rotary_embedding import RotaryEmbedding, apply_rotary
from radixserve.models.causal_lm import CausalLM, DecoderLayerWeights, DecoderWeights


class GemmaRMSNorm(nn.Module):
    """norm(x) * (1 + w) in float32, then rounded to x's dtype (transformers' Gemma3RMSNorm)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class Gemma3Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.qkv_proj = LinearBase(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = LinearBase(self.q_size, config.hidden_size, bias=False)
        # NOTE: Gemma 2 has no q/k norm: no parameters either, so its checkpoints load complete
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        scalar = config.query_pre_attn_scalar or config.head_dim
        self.attn = RadixAttention(layer_id, self.num_heads, self.num_kv_heads, self.head_dim, scalar**-0.5,
                                   sliding_window=config.window_of(layer_id),
                                   logit_cap=config.attn_logit_softcapping)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        q = qkv[:, : self.q_size].view(tokens, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        v = qkv[:, self.q_size + self.kv_size :].view(tokens, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return self.o_proj(self.attn(q, k, v.contiguous(), fb))


class Gemma3MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = LinearBase(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = LinearBase(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return in_row_pieces(self._rows, hidden, self.gate_up_proj, self.down_proj)

    def _rows(self, hidden: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(hidden).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.self_attn = Gemma3Attention(config, layer_id)
        self.mlp = Gemma3MLP(config)
        eps = config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.is_sliding = config.window_of(layer_id) is not None

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(hidden), cos, sin, fb)
        hidden = hidden + self.post_attention_layernorm(attended)
        return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))


class Gemma3Model(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # NOTE: an empty weight, not the default init (see LlamaModel)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)


class Gemma3ForCausalLM(CausalLM):
    """Gemma 3's layers (causal_lm.py runs them): the residual stream stays whole through them (residual None)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, Gemma3Model(config))
        # None: one rotary for every layer (Gemma 2)
        self.local_rotary = (None if config.local_rope is None else
                             RotaryEmbedding(config.head_dim, config.local_rope, config.context_len + 1))
        self.embed_scale = config.hidden_size**0.5

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.model.embed_tokens(input_ids)
        # NOTE: the scale is rounded to the model dtype before the product, as transformers does
        return hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)

    def run_layers(self, hidden: torch.Tensor, positions: torch.Tensor,
                   fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        global_rope = self.rotary.cos_sin(positions, hidden.dtype)
        local_rope = global_rope if self.local_rotary is None else self.local_rotary.cos_sin(positions, hidden.dtype)
        for layer in self.model.layers:
            hidden = layer(hidden, *(local_rope if layer.is_sliding else global_rope), fb)
        return hidden, None

    def final_norm(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        return self.model.norm(hidden if residual is None else hidden + residual)

    def cap_logits(self, logits: torch.Tensor) -> torch.Tensor:
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def decoder_weights(self) -> DecoderWeights | None:
        """The weight view the C decoder reads (style "gemma": every norm as the float32 table 1 + w); None
        with soft-capped attention scores (Gemma 2), which its attention kernel does not compute."""
        if self.config.attn_logit_softcapping:
            return None

        def one_plus(norm: GemmaRMSNorm | None) -> torch.Tensor | None:
            return None if norm is None else (1.0 + norm.weight.detach().float()).contiguous()

        layers = tuple(DecoderLayerWeights(
            one_plus(layer.input_layernorm), one_plus(layer.pre_feedforward_layernorm), layer.self_attn.qkv_proj,
            layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj, q_norm=one_plus(layer.self_attn.q_norm),
            k_norm=one_plus(layer.self_attn.k_norm), post_attn_norm=one_plus(layer.post_attention_layernorm),
            post_ff_norm=one_plus(layer.post_feedforward_layernorm)) for layer in self.model.layers)
        return DecoderWeights(self.config, layers, self.rotary, self.model.layers[0].self_attn.attn.scaling,
                              style="gemma", local_rotary=self.local_rotary)
