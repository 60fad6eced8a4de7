"""ModelConfig: the shape of a Llama-family model, read from a Hugging Face `config.json` dict."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class ModelLoadError(ValueError):
    """Bad model input: a missing path, an unsupported architecture, a broken or unsupported file."""


# NOTE: every architecture here runs through the one Llama-family definition in models/llama.py;
# the flags below (QKV bias, per-head q/k RMSNorm) are what tells them apart.
SUPPORTED_ARCHITECTURES: dict[str, dict[str, bool]] = {
    "LlamaForCausalLM": {"attention_bias": False, "qk_norm": False},
    "MistralForCausalLM": {"attention_bias": False, "qk_norm": False},
    "Qwen2ForCausalLM": {"attention_bias": True, "qk_norm": False},
    "Qwen3ForCausalLM": {"attention_bias": False, "qk_norm": True},
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    freq_factors: tuple[float, ...] | None = None  # llama.cpp's rope_freqs tensor, divides inv_freq


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    context_len: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], extra_eos_ids: tuple[int, ...] = ()) -> ModelConfig:
        arch = _architecture(hf)
        flags = SUPPORTED_ARCHITECTURES[arch]
        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        return cls(
            architecture=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(hf.get("head_dim") or hidden // num_heads),
            context_len=_context_len(hf),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope=_rope_config(hf),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", flags["attention_bias"])) or flags["attention_bias"],
            qk_norm=flags["qk_norm"],
            eos_token_ids=_unique(_as_ids(hf.get("eos_token_id")) + tuple(extra_eos_ids)),
            bos_token_id=hf.get("bos_token_id") if isinstance(hf.get("bos_token_id"), int) else None,
        )


def _architecture(hf: dict[str, Any]) -> str:
    names = list(hf.get("architectures") or [])
    if not names and hf.get("model_type"):
        names = [_ARCH_BY_MODEL_TYPE.get(hf["model_type"], str(hf["model_type"]))]
    for name in names:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    found = ", ".join(names) or "none given"
    raise ModelLoadError(f"unsupported model architecture ({found}); supported: {', '.join(SUPPORTED_ARCHITECTURES)}")


_ARCH_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                       "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def _context_len(hf: dict[str, Any]) -> int:
    context = int(hf.get("max_position_embeddings") or 2048)
    window = hf.get("sliding_window")
    uses_window = hf.get("use_sliding_window", True)  # Mistral has no flag; Qwen2/3 default to False
    # NOTE: we attend over the whole context, so a sliding-window model is capped at its window.
    if window and uses_window and int(window) < context:
        context = int(window)
    return context


def _rope_config(hf: dict[str, Any]) -> RopeConfig:
    params = dict(hf.get("rope_scaling") or {})
    params.update(hf.get("rope_parameters") or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(f"unsupported rope scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position=int(params.get("original_max_position_embeddings", 8192)),
        freq_factors=tuple(hf["rope_freq_factors"]) if hf.get("rope_freq_factors") else None,
    )


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _unique(ids: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(dict.fromkeys(ids))
