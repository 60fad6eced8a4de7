"""Helpers for the model tests (no tests here): tiny random Hugging Face models saved to a folder."""

from __future__ import annotations

from pathlib import Path

import torch

TINY_VOCAB = 256


def tiny_hf_config(arch: str):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  initializer_range=0.2, rms_norm_eps=1e-6, eos_token_id=1, bos_token_id=2)
    if arch == "llama":
        return LlamaConfig(**common, rope_theta=10000.0)
    if arch == "llama3":
        scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 64, "rope_theta": 500000.0}
        return LlamaConfig(**common, rope_scaling=scaling)
    if arch == "mistral":
        return MistralConfig(**common, sliding_window=None)
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "qwen3":
        return Qwen3Config(**{**common, "num_attention_heads": 4}, head_dim=32)
    raise ValueError(arch)


def assert_engine_conserved(engine) -> None:
    """After an Engine's requests: the conservation identity holds and nothing holds KV."""
    state = engine.get_internal_state()
    assert state["kv_conservation"] is not None and "error" not in state["kv_conservation"], state
    assert state["protected_tokens"] == 0 and state["num_running_reqs"] == 0


def save_tiny_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(TINY_VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t1", bos_token="t2")
    fast.save_pretrained(str(folder))


def make_tiny_model(folder: Path, arch: str, seed: int = 0):
    """Saves a random tiny model of `arch` (+ tokenizer) to `folder`; returns the float32 HF model."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_hf_config(arch), dtype=torch.float32).eval()
    model.save_pretrained(str(folder))
    save_tiny_tokenizer(folder)
    return model


@torch.inference_mode()
def hf_last_logits(model, token_ids: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([token_ids])).logits[0, -1].float()


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.float() - ref.float()).abs().max() / ref.float().abs().max())


def one_torch_thread():
    """Module fixture body: one torch thread while the module runs, then the previous count.

    On a shared 2-core machine two OpenMP threads spin-wait on each other whenever another process
    holds a core, which makes the small ops of tiny models 10-20x slower.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
