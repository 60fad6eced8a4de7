"""Which model definition serves a checkpoint: one place, read by both loaders (loader.py for HF folders and
dequantized GGUF files, gguf_packed.py for packed GGUF weights)."""

from __future__ import annotations

from torch import nn

from radixserve.models.config import GEMMA3, ModelConfig


def model_class(config: ModelConfig) -> type[nn.Module]:
    """The model definition of `config.architecture`: Gemma 3's own, else the one Llama-family definition."""
    if config.architecture == GEMMA3:
        from radixserve.models.gemma3 import Gemma3ForCausalLM

        return Gemma3ForCausalLM
    from radixserve.models.llama import LlamaForCausalLM

    return LlamaForCausalLM
