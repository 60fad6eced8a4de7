"""What a model folder says besides its weights: its config (with generation_config's extra EOS ids) and its
tokenizer (a fast one, with a chat template)."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

from radixserve.configs.model_config import ModelConfig, ModelLoadError

logger = logging.getLogger(__name__)

# Used only when a model ships no chat template (base models, test models).
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] + ': ' + message['content'] + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)


# Gemma's turn format, for a Gemma 3 file that carries no template of its own (llama.cpp's GGUF files may not):
# turns open with <start_of_turn> and a role (the assistant's is "model"), close with <end_of_turn>; a system
# message is folded into the first user turn. Written for radixserve from the format's description.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(system='') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{% set ns.system = message['content'] + '\n\n' %}"
    "{% else %}{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' }}{% if role == 'user' %}{{ ns.system }}{% set ns.system = '' %}{% endif %}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


def read_config_and_tokenizer(folder: Path) -> tuple[ModelConfig, object]:
    config = read_config(folder)
    tokenizer = load_tokenizer(folder)
    if not config.eos_token_ids and tokenizer.eos_token_id is not None:
        config = dataclasses.replace(config, eos_token_ids=(tokenizer.eos_token_id,))
    return config, tokenizer


# tokenizer_config.json's `tokenizer_class` values that name transformers' generic fast tokenizer itself (ours,
# written by gguf_loader, among them): loaded by that class directly, not through AutoTokenizer.
GENERIC_FAST_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(folder: Path):
    try:
        tokenizer = _tokenizer_class(folder).from_pretrained(str(folder))
    except Exception as e:  # transformers raises many kinds for missing or broken tokenizer files
        raise ModelLoadError(f"{folder}: no usable tokenizer ({type(e).__name__}: {e})") from e
    if not getattr(tokenizer, "is_fast", False):
        raise ModelLoadError(f"{folder}: radixserve needs a fast (tokenizer.json) tokenizer")
    if not tokenizer.chat_template:
        logger.warning("%s has no chat template; using a plain 'role: content' template", folder)
        tokenizer.chat_template = FALLBACK_CHAT_TEMPLATE
    return tokenizer


def _tokenizer_class(folder: Path):
    """The generic fast class where the folder names it, else AutoTokenizer. NOTE: the same class either way
    there, but AutoTokenizer's first use builds transformers' whole model mapping (~2.5 s of a warm start on
    two cores); a model-specific class still goes through AutoTokenizer."""
    try:
        named = json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, json.JSONDecodeError, AttributeError):
        named = None
    if named in GENERIC_FAST_CLASSES:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast
    from transformers import AutoTokenizer

    return AutoTokenizer


def read_config(folder: Path) -> ModelConfig:
    try:
        hf = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{folder}/config.json cannot be read: {e}") from e
    extra_eos: tuple[int, ...] = ()
    generation = folder / "generation_config.json"
    if generation.exists():
        eos = json.loads(generation.read_text()).get("eos_token_id")
        extra_eos = (eos,) if isinstance(eos, int) else tuple(eos or ())
    return ModelConfig.from_hf_dict(hf, extra_eos)
