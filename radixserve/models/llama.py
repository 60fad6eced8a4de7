"""The Llama family (Llama, Mistral, Qwen2 with QKV bias, Qwen3 with q/k RMSNorm) on the paged KV pool.

Parameter names follow Hugging Face, except that q/k/v are fused into `qkv_proj` and gate/up into
`gate_up_proj` (fewer, larger matrix products; see `load_weights`). Linear layers run the method the
runner chose for their shape (layers/linear.py). With fused ops (`set_fused_ops`, CPU), the passes
between the matrix products run as compiled ops (layers/fused_ops.py): residual add + RMSNorm,
rotary + KV write, SiLU-and-mul; without them, the same steps run as eager torch. On CPUs with
AVX512-BF16 a decode batch may run all decoder layers in one C call instead (decode_step.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from radixserve.configs.model_config import ModelConfig, ModelLoadError
from radixserve.cpu_memory import in_row_pieces
from radixserve.forward_batch import ForwardBatch
from radixserve.layers.activation import silu_and_mul
from radixserve.layers.fused_ops import FusedOps
from radixserve.layers.layernorm import RMSNorm
from radixserve.layers.linear import LinearBase
from radixserve.layers.pooler import pool_hidden
from radixserve.layers.radix_attention import RadixAttention
from radixserve.layers.rotary_embedding import RotaryEmbedding, apply_rotary

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


@dataclass(frozen=True)
class DecoderLayerWeights:
    """One decoder layer as a decoder outside the Python layers reads it: the norms' weights and the linear
    layers, whose methods hold each weight in the form they multiply with (layers/linear.py)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor  # the norm before the MLP
    qkv: LinearBase
    o: LinearBase
    gate_up: LinearBase
    down: LinearBase
    # Gemma's (style "gemma"), each the float32 table 1 + w: the per-head q/k norms (None: none, Gemma 2) and
    # the norms of the attention's and the MLP's outputs
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = None
    post_ff_norm: torch.Tensor | None = None

    @property
    def linears(self) -> tuple[LinearBase, ...]:
        return self.qkv, self.o, self.gate_up, self.down


@dataclass(frozen=True)
class DecoderWeights:
    """The exported weight view of the decoder (`LlamaForCausalLM.decoder_weights`): what the C decode step
    reads, so that it never walks the model's attributes. Its structure is this file's: pre-norm layers,
    fused qkv (bias allowed) and gate|up, rotary on q and k (no q/k norms), SiLU-and-mul."""

    config: ModelConfig
    layers: tuple[DecoderLayerWeights, ...]
    rotary: RotaryEmbedding
    attention_scale: float
    # "llama": this file's layers; "gemma": models/gemma3.py's (four (1 + w) norms, GeGLU; csrc/decode_gemma.h)
    style: str = "llama"
    local_rotary: RotaryEmbedding | None = None  # the window layers' rotary where it differs (Gemma 3)


class LlamaForCausalLM(nn.Module):
    """forward(input_ids, positions, forward_batch) -> float32 logits of each request's last token."""

    # (fused parameter, checkpoint name, shard index)
    stacked_params = (
        ("qkv_proj", "q_proj", 0), ("qkv_proj", "k_proj", 1), ("qkv_proj", "v_proj", 2),
        ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1),
    )

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = LinearBase(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope, config.context_len + 1)
        self.fused_ops: FusedOps | None = None
        self.decode_step = None  # the decoder layers of a decode batch in one C call (decode_step.py)
        self.tie_weights()

    def tie_weights(self) -> None:
        # NOTE: a packed (quantized) head shares its embedding's table instead (layers/quantization/model_quant.py).
        if self.config.tie_word_embeddings and not self.lm_head.method.chosen_by_format:
            self.lm_head.weight = self.model.embed_tokens.weight

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

    def set_decoder(self, decode_step: Any) -> None:
        """The decoder of decode batches: None, the Python layers; else a C decoder over the layers' weights
        (decode_step.DecodeStep), which runs a decode forward when it `takes` it."""
        self.decode_step = decode_step

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

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        hidden = self.model.embed_tokens(input_ids)
        if self.fused_ops is not None and self.fused_ops.rotary_kv is not None:
            cos, sin = self.rotary.tables(hidden.device)  # the rotary op looks positions up itself
        else:
            cos, sin = self.rotary.cos_sin(positions, hidden.dtype)
        # NOTE: LoRA rows run in the C decoder too (the SGMV kernel after each linear layer), unless it declines them
        # NOTE: deterministic inference runs extend forwards in the C decoder too, a row per token (`takes`)
        if self.decode_step is not None and self.decode_step.takes(fb):
            hidden, residual = self.decode_step(hidden, fb)
        else:
            residual = None
            for layer in self.model.layers:
                hidden, residual = layer(hidden, residual, cos, sin, fb)
        every = hidden, residual
        if fb.forward_mode.is_extend():
            rows = _last_token_index(fb, hidden.device)
            if fb.extra_logits_indices is not None:
                rows = torch.cat([rows, fb.extra_logits_indices])  # NOTE: after the bs sampling rows
            hidden, residual = hidden[rows], residual[rows]
        hidden, _ = self.model.norm(hidden, residual)
        if fb.pooling is not None:  # embedding requests: the final norm's output (layers/pooler.py)
            pool_hidden(fb, hidden, lambda a, b: self.model.norm(every[0][a:b], every[1][a:b])[0])
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies Hugging Face-named tensors in, fusing q/k/v and gate/up; raises on missing or unknown ones."""
        from radixserve.layers.quantization.model_quant import packed_weight_slots

        params: dict = {**dict(self.named_parameters()), **packed_weight_slots(self)}
        loaded: set[tuple[str, int]] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and self.config.tie_word_embeddings):
                continue
            target, shard = self._target_of(name)
            if target not in params:
                raise ModelLoadError(f"checkpoint tensor {name!r} has no place in {self.config.architecture}")
            _copy_shard(params[target], tensor, *self._shard_range(target, shard))
            loaded.add((target, shard))
        self._check_complete(params, loaded)

    def _target_of(self, name: str) -> tuple[str, int]:
        for fused, part, shard in self.stacked_params:
            if f".{part}." in name:
                return name.replace(f".{part}.", f".{fused}."), shard
        return name, -1

    def _shard_range(self, target: str, shard: int) -> tuple[int, int]:
        c = self.config
        if shard < 0:
            return 0, -1
        if "qkv_proj" in target:
            return ((0, c.q_size), (c.q_size, c.kv_size), (c.q_size + c.kv_size, c.kv_size))[shard]
        return shard * c.intermediate_size, c.intermediate_size

    def _check_complete(self, params: dict, loaded: set[tuple[str, int]]) -> None:
        missing = []
        for name in params:
            shards = [s for f, _, s in self.stacked_params if f".{f}." in name] or [-1]
            missing += [name for s in shards if (name, s) not in loaded]
        if missing:
            shown = ", ".join(sorted(set(missing))[:8])
            raise ModelLoadError(f"checkpoint is missing {len(set(missing))} tensor(s), e.g. {shown}")


def _copy_shard(param: nn.Parameter, tensor: torch.Tensor, start: int, length: int) -> None:
    if hasattr(param, "load_rows"):  # a packed (quantized) layer quantizes its rows as they arrive
        try:
            param.load_rows(tensor, max(start, 0), length)
        except ValueError as e:
            raise ModelLoadError(str(e)) from e
        return
    target = param.data if length < 0 else param.data.narrow(0, start, length)
    if tuple(target.shape) != tuple(tensor.shape):
        raise ModelLoadError(f"tensor shape {tuple(tensor.shape)} does not fit parameter slice {tuple(target.shape)}")
    target.copy_(tensor)


def _last_token_index(fb: ForwardBatch, device: torch.device) -> torch.Tensor:
    ends, total = [], 0
    for n in fb.extend_seq_lens_cpu:
        total += n
        ends.append(total - 1)
    return torch.tensor(ends, dtype=torch.int64, device=device)
