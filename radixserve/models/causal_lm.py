"""The causal LM every model is: embed -> decoder -> logits, and the contract the runner holds it to.

`CausalLM.forward` is written once: the embeddings (`embed`), then the decoder layers, either the model's own Python
layers (`run_layers`) or the one-call C decoder over the model's weight view (`decoder_weights`; set by the
runner with `set_decoder` where the execution plan chose it), then the logits (`logits`: each request's sampling
rows, the final norm, pooling for embedding requests, the LM head, an optional soft cap).

An architecture supplies only what is its own:
- `self.model`: a module with `embed_tokens`, `layers` and `norm` (Hugging Face's names, so checkpoints load);
- `run_layers(hidden, positions, fb) -> (hidden, residual)`: its layers in Python (residual None where the layers
  keep the residual stream whole, as Gemma's do);
- `final_norm(hidden, residual)`: its last norm;
- optionally `decoder_weights()` (the view the C decoder reads; None: no C decoder), `embed` (a scale),
  `cap_logits`, `set_fused_ops` (compiled passes between the matrix products, `uses_fused_ops`), and
  `stacked_params` (how checkpoint tensors fuse into its parameters; Hugging Face's q/k/v and gate/up by default).
Checkpoint loading (`load_weights`) is this class's, for every architecture.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from radixserve.configs.model_config import ModelConfig, ModelLoadError
from radixserve.forward_batch import ForwardBatch
from radixserve.layers.linear import LinearBase
from radixserve.layers.pooler import pool_hidden
from radixserve.layers.rotary_embedding import RotaryEmbedding


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
    """The exported weight view of the decoder (`CausalLM.decoder_weights`): what the C decoder reads, so that it
    never walks the model's attributes. "llama" style: pre-norm layers, fused qkv (bias allowed) and gate|up,
    rotary on q and k (no q/k norms), SiLU-and-mul; "gemma": models/gemma3.py's (four (1 + w) norms, GeGLU)."""

    config: ModelConfig
    layers: tuple[DecoderLayerWeights, ...]
    rotary: RotaryEmbedding
    attention_scale: float
    style: str = "llama"
    local_rotary: RotaryEmbedding | None = None  # the window layers' rotary where it differs (Gemma 3)


class CausalLM(nn.Module):
    """forward(input_ids, positions, forward_batch) -> float32 logits of each request's sampling rows."""

    # (fused parameter, checkpoint name, shard index): Hugging Face's q/k/v and gate/up, fused
    stacked_params: tuple[tuple[str, str, int], ...] = (
        ("qkv_proj", "q_proj", 0), ("qkv_proj", "k_proj", 1), ("qkv_proj", "v_proj", 2),
        ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1),
    )
    uses_fused_ops = False  # NOTE: whether its layers take the compiled passes (execution_plan reads this)

    def __init__(self, config: ModelConfig, model: nn.Module) -> None:
        super().__init__()
        self.config = config
        self.model = model
        self.lm_head = LinearBase(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope, config.context_len + 1)
        self.c_decoder: Any = None  # the decoder layers in one C call (models/c_decoder.py), set by the runner
        self.tie_weights()

    # ---- what an architecture supplies -------------------------------------------------------------
    def run_layers(self, hidden: torch.Tensor, positions: torch.Tensor,
                   fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Its decoder layers in Python: (hidden, residual), residual None where `hidden` is the whole stream."""
        raise NotImplementedError

    def final_norm(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """Its last norm, of the residual stream (hidden + residual, or hidden alone when residual is None)."""
        raise NotImplementedError

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def cap_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def decoder_weights(self) -> DecoderWeights | None:
        """The weight view a decoder outside the Python layers reads; None: its layers run in Python only."""
        return None

    # ---- the seams the runner sets -------------------------------------------------------------------
    def set_decoder(self, c_decoder: Any) -> None:
        """The decoder of the forwards it `takes`: None, the Python layers; else the C decoder over
        `decoder_weights()` (models/c_decoder.py)."""
        self.c_decoder = c_decoder

    def set_fused_ops(self, ops: Any, passes: Any = None) -> None:
        """Compiled passes between the matrix products; an architecture without `uses_fused_ops` takes none."""
        if ops is not None:
            raise ValueError(f"{type(self).__name__} layers take no fused ops")

    # ---- the forward -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        hidden = self.embed(input_ids)
        # NOTE: LoRA rows run in the C decoder too (the SGMV kernel after each linear layer), unless it declines them;
        # deterministic inference runs extend forwards there too, a row per token (`takes`)
        if self.c_decoder is not None and self.c_decoder.takes(fb):
            hidden, residual = self.c_decoder(hidden, fb)
        else:
            hidden, residual = self.run_layers(hidden, positions, fb)
        return self.logits(hidden, residual, fb)

    def logits(self, hidden: torch.Tensor, residual: torch.Tensor | None, fb: ForwardBatch) -> torch.Tensor:
        """The float32 logits of the sampling rows: each request's last token in an extend (then the extra rows
        `fb.extra_logits_indices` asks for), every row in a decode."""
        every = hidden, residual
        if fb.forward_mode.is_extend():
            rows = last_token_index(fb, hidden.device)
            if fb.extra_logits_indices is not None:
                rows = torch.cat([rows, fb.extra_logits_indices])  # NOTE: after the bs sampling rows
            hidden, residual = hidden[rows], None if residual is None else residual[rows]
        normed = self.final_norm(hidden, residual)
        if fb.pooling is not None:  # embedding requests: the final norm's output (layers/pooler.py)
            pool_hidden(fb, normed, lambda a, b: self.final_norm(every[0][a:b],
                                                                 None if every[1] is None else every[1][a:b]))
        return self.cap_logits(self.lm_head(normed).float())

    # ---- checkpoint loading -------------------------------------------------------------------------
    def tie_weights(self) -> None:
        # NOTE: a packed (quantized) head shares its embedding's table instead (layers/quantization/model_quant.py).
        if self.config.tie_word_embeddings and not self.lm_head.method.chosen_by_format:
            self.lm_head.weight = self.model.embed_tokens.weight

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies Hugging Face-named tensors in, fusing them as `stacked_params` says; raises on missing or unknown
        ones."""
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


def last_token_index(fb: ForwardBatch, device: torch.device) -> torch.Tensor:
    """The row of each request's last token in an extend forward's flat rows."""
    ends, total = [], 0
    for n in fb.extend_seq_lens_cpu:
        total += n
        ends.append(total - 1)
    return torch.tensor(ends, dtype=torch.int64, device=device)
