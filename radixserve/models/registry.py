"""Which model definition serves a checkpoint: one place, read by both loaders (loader.py for HF folders and
dequantized GGUF files, gguf_packed.py for packed GGUF weights)."""

from __future__ import annotations

from torch import nn

from radixserve.configs.model_config import GEMMA2, GEMMA3, ModelConfig


def model_class(config: ModelConfig) -> type[nn.Module]:
    """The model definition of `config.architecture`: Gemma 2's or 3's own, else the one Llama-family definition."""
    if config.architecture == GEMMA3:
        from radixserve.models.gemma3 import Gemma3ForCausalLM

        return Gemma3ForCausalLM
    if config.architecture == GEMMA2:
        from radixserve.models.gemma2 import Gemma2ForCausalLM

        return Gemma2ForCausalLM
    from radixserve.models.llama import LlamaForCausalLM

    return LlamaForCausalLM
