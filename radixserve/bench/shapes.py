"""The shape ladder: Hugging Face folders with seeded random weights in the shapes of the models people serve
on CPUs, loadable by radixserve, vLLM and transformers alike.

A 135M model's decode step is mostly overhead; a 0.5B-8B model's is bound by reading its weights. These
folders give the real shapes (widths, heads, KV heads, head dim, vocabulary, tied embeddings, QKV bias, rope)
without downloading anything: the config is built with transformers, the model initialised from a seed and
saved as safetensors. The tokenizer is the embedded SmolLM2's; the embedding rows past its vocabulary are
zeroed, so a greedy argmax (over tied embeddings) never lands on an id the tokenizer cannot decode, while every
step still reads the whole matrix as the real model would.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class Shape:
    name: str
    architecture: str  # "qwen2" or "llama"
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    rope_theta: float
    rms_norm_eps: float
    max_position: int
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    tie_embeddings: bool = True

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.heads // self.kv_heads

    def params(self) -> int:
        """Parameters, counting tied embeddings once."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = self.hidden * (q + 2 * kv) + q * self.hidden + (q + 2 * kv) * (self.architecture == "qwen2")
        layer = attention + 3 * self.hidden * self.intermediate + 2 * self.hidden
        embeddings = self.vocab * self.hidden * (1 if self.tie_embeddings else 2)
        return self.layers * layer + embeddings + self.hidden

    def bytes_per_decode_step(self, bytes_per_weight: float) -> float:
        """Weight bytes one decode step reads: every layer's matrices and the LM head (the whole vocabulary);
        of the input embedding only a row, so an untied embedding matrix is not counted."""
        untied_input = 0 if self.tie_embeddings else self.vocab * self.hidden
        return (self.params() - untied_input) * bytes_per_weight

    def scaled(self, **changes: int) -> Shape:
        """The same head geometry with fewer layers, a smaller vocabulary or MLP (for tests)."""
        return replace(self, name=f"{self.name}-scaled", **changes)


_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

SHAPES: dict[str, Shape] = {s.name: s for s in (
    Shape("qwen2.5-0.5b", "qwen2", hidden=896, intermediate=4864, layers=24, heads=14, kv_heads=2, head_dim=64,
          vocab=151936, rope_theta=1e6, rms_norm_eps=1e-6, max_position=32768),
    Shape("llama-3.2-1b", "llama", hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8, head_dim=64,
          vocab=128256, rope_theta=5e5, rms_norm_eps=1e-5, max_position=131072, rope_scaling=_LLAMA3_ROPE),
    Shape("qwen2.5-1.5b", "qwen2", hidden=1536, intermediate=8960, layers=28, heads=12, kv_heads=2, head_dim=128,
          vocab=151936, rope_theta=1e6, rms_norm_eps=1e-6, max_position=32768),
)}


def hf_config(shape: Shape, eos_token_id: int, bos_token_id: int | None):
    """The transformers config of `shape`."""
    from transformers import LlamaConfig, Qwen2Config

    common = dict(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                  num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                  num_key_value_heads=shape.kv_heads, max_position_embeddings=shape.max_position,
                  rms_norm_eps=shape.rms_norm_eps, tie_word_embeddings=shape.tie_embeddings,
                  eos_token_id=eos_token_id, bos_token_id=bos_token_id, initializer_range=0.02)
    rope = {"rope_type": "default", **(shape.rope_scaling or {}), "rope_theta": shape.rope_theta}
    if shape.architecture == "qwen2":
        return Qwen2Config(**common, rope_parameters=rope, use_sliding_window=False)
    if shape.architecture == "llama":
        return LlamaConfig(**common, rope_parameters=rope, head_dim=shape.head_dim)
    raise ValueError(f"unknown architecture {shape.architecture!r}")


def write_folder(shape: Shape, out: Path, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                 tokenizer_folder: Path | None = None) -> Path:
    """Writes `shape` with seeded random weights to `out` (config.json last, the folder renamed into place, so a
    folder with a config.json is complete); a folder already written for the same shape, seed and dtype is kept.
    The tokenizer comes from `tokenizer_folder`, by default the embedded SmolLM2's."""
    from transformers import AutoModelForCausalLM

    stamp = {"shape": shape.name, "seed": seed, "dtype": str(dtype), "params": shape.params()}
    if (out / "config.json").exists() and read_stamp(out) == stamp:
        return out
    tokenizer_folder = tokenizer_folder or _embedded_tokenizer_folder()
    special = json.loads((tokenizer_folder / "config.json").read_text()) if (
        tokenizer_folder / "config.json").exists() else {}
    config = hf_config(shape, special.get("eos_token_id", 0), special.get("bos_token_id"))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    _zero_rows_past_tokenizer(model, _tokenizer_size(tokenizer_folder))

    def fill(tmp: Path) -> None:
        model.to(dtype).save_pretrained(str(tmp))
        copy_tokenizer(tokenizer_folder, tmp)
        (tmp / "shape_ladder.json").write_text(json.dumps(stamp))

    return publish_folder(out, fill)


def publish_folder(out: Path, fill: Callable[[Path], None]) -> Path:
    """Writes a model folder whole: `fill(tmp)` writes every file (config.json included) into a fresh folder beside
    `out`, which then replaces `out`; config.json goes in last, so a folder with a config.json is complete."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the folder is for every engine and user
    try:
        fill(tmp)
        if out.exists():
            shutil.rmtree(out)
        config_text = (tmp / "config.json").read_text()
        (tmp / "config.json").unlink()
        tmp.rename(out)
        (out / "config.json").write_text(config_text)  # NOTE: last, so a folder with a config is whole
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def copy_tokenizer(source: Path, dest: Path) -> None:
    """The tokenizer's files (and chat template) of a Hugging Face folder, copied to another."""
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (source / name).exists():
            shutil.copy(source / name, dest / name)


def read_stamp(folder: Path, name: str = "shape_ladder.json") -> dict | None:
    """What a folder written here records of how it was made (None when it has no readable record)."""
    try:
        return json.loads((folder / name).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _embedded_tokenizer_folder() -> Path:
    from radixserve.model_loader.gguf_loader import gguf_to_hf_folder
    from radixserve.models.loader import embedded_model_path

    return gguf_to_hf_folder(embedded_model_path(), None)


def _tokenizer_size(folder: Path) -> int:
    from radixserve.model_loader.model_folder import load_tokenizer

    return len(load_tokenizer(folder))


@torch.no_grad()
def _zero_rows_past_tokenizer(model, tokenizer_size: int) -> None:
    for matrix in {model.get_input_embeddings().weight, model.get_output_embeddings().weight}:
        matrix[tokenizer_size:] = 0
