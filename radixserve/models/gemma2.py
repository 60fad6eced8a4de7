"""Gemma 2 (text): Gemma 3's layers (models/gemma3.py) as its config describes them.

What Gemma 2 changes, all read from the config (`config._gemma_fields`), none a code path of its own:
- no q/k RMSNorm (`ModelConfig.qk_norm` False: the attention has no norm parameters);
- one rotary (rope_theta, 10,000 by default) for window and full layers alike (`local_rope` None);
- layers alternate window (even indices, transformers' default) and full, unless `layer_types` says otherwise;
- attention scores are soft-capped, s = cap * tanh(s / cap) (`attn_logit_softcapping`, 50): every layer's
  `RadixAttention` carries the cap, and the backend runs such layers in torch math (layers/attention/softcap.py),
  without the C kernels or cascade; the final logits are capped too (`final_logit_softcapping`, 30).
The rest is Gemma 3's: GemmaRMSNorm (1 + w), four norms per layer, GeGLU (tanh), embeddings times
sqrt(hidden) rounded to the dtype, query_pre_attn_scalar ** -0.5, tied embeddings, the Llama family's loader.
"""

from __future__ import annotations

from radixserve.configs.model_config import GEMMA2, ModelConfig
from radixserve.models.gemma3 import Gemma3ForCausalLM


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    """forward(input_ids, positions, forward_batch) -> float32 logits of each request's last token."""

    def __init__(self, config: ModelConfig) -> None:
        if config.architecture != GEMMA2 or config.qk_norm or config.local_rope is not None:
            raise ValueError(f"not a Gemma 2 config: {config.architecture}, qk_norm={config.qk_norm}, "
                             f"local_rope={config.local_rope}")
        super().__init__(config)
