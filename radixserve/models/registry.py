"""Which model definition serves a checkpoint: one place, read by both loaders (loader.py for HF folders and
dequantized GGUF files, gguf_packed.py for packed GGUF weights).

Every definition is a `CausalLM` (causal_lm.py): the forward and checkpoint loading are the base's, a definition
brings its layers and, for the C decoder, its weight view. `register_model` adds one under a Hugging Face
architecture name (a config's `architectures`); the built-in ones are below.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixserve.configs.model_config import GEMMA2, GEMMA3, ModelConfig, register_architecture

if TYPE_CHECKING:
    from radixserve.models.causal_lm import CausalLM

_REGISTERED: dict[str, type[CausalLM]] = {}


def register_model(architecture: str, cls: type[CausalLM], attention_bias: bool = False,
                   qk_norm: bool = False) -> None:
    """Serve configs whose `architectures` names `architecture` with `cls`, a CausalLM subclass; the flags are the
    config's defaults for a QKV bias and per-head q/k norms."""
    from radixserve.models.causal_lm import CausalLM

    if not (isinstance(cls, type) and issubclass(cls, CausalLM)):
        raise TypeError(f"{cls!r} is not a CausalLM: a model supplies its layers to causal_lm.CausalLM")
    register_architecture(architecture, attention_bias=attention_bias, qk_norm=qk_norm)
    _REGISTERED[architecture] = cls


def model_class(config: ModelConfig) -> type[CausalLM]:
    """The model definition of `config.architecture`: a registered one, Gemma 2's or 3's own, else the one
    Llama-family definition."""
    if config.architecture in _REGISTERED:
        return _REGISTERED[config.architecture]
    if config.architecture == GEMMA3:
        from radixserve.models.gemma3 import Gemma3ForCausalLM

        return Gemma3ForCausalLM
    if config.architecture == GEMMA2:
        from radixserve.models.gemma2 import Gemma2ForCausalLM

        return Gemma2ForCausalLM
    from radixserve.models.llama import LlamaForCausalLM

    return LlamaForCausalLM
