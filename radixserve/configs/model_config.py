"""ModelConfig: the shape of a Llama-family, Gemma 2 or Gemma 3 model, read from a Hugging Face `config.json` dict."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class ModelLoadError(ValueError):
    """Bad model input: a missing path, an unsupported architecture, a broken or unsupported file."""


# NOTE: every architecture here but Gemma 2 and 3 runs through the one Llama-family definition in models/llama.py;
# the flags below (QKV bias, per-head q/k RMSNorm) are what tells them apart. Gemma 2 and 3 share their own
# (models/gemma3.py; Gemma 2: no q/k norm, one rotary, attention soft-capping).
SUPPORTED_ARCHITECTURES: dict[str, dict[str, bool]] = {
    "LlamaForCausalLM": {"attention_bias": False, "qk_norm": False},
    "MistralForCausalLM": {"attention_bias": False, "qk_norm": False},
    "Qwen2ForCausalLM": {"attention_bias": True, "qk_norm": False},
    "Qwen3ForCausalLM": {"attention_bias": False, "qk_norm": True},
    "Gemma2ForCausalLM": {"attention_bias": False, "qk_norm": False},
    "Gemma3ForCausalLM": {"attention_bias": False, "qk_norm": True},
}
GEMMA2, GEMMA3 = "Gemma2ForCausalLM", "Gemma3ForCausalLM"


def register_architecture(name: str, attention_bias: bool = False, qk_norm: bool = False) -> None:
    """Accept configs naming `name` (models/registry.register_model calls this with the model's definition)."""
    SUPPORTED_ARCHITECTURES[name] = {"attention_bias": attention_bias, "qk_norm": qk_norm}
GEMMAS = (GEMMA2, GEMMA3)
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
    # Gemma 2 and 3 (models/gemma3.py); the Llama family leaves these at their defaults.
    # NOTE: the one per-layer statement of sliding-window attention: layer i attends to the last
    # layer_windows[i] tokens (itself included), None: to all; empty: every layer full.
    layer_windows: tuple[int | None, ...] = ()
    local_rope: RopeConfig | None = None  # the window layers' rotary (Gemma 3: base 10,000); None: `rope`
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5; None: head_dim ** -0.5
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    # Gemma 2: every layer's attention scores s (scaled) become cap * tanh(s / cap) before the mask and softmax
    attn_logit_softcapping: float | None = None

    def window_of(self, layer_id: int) -> int | None:
        """The sliding window of layer `layer_id`: the number of latest tokens it attends to; None: all."""
        return self.layer_windows[layer_id] if self.layer_windows else None

    @property
    def windows(self) -> tuple[int, ...]:
        """The distinct sliding windows of the model's layers (empty: no window layer)."""
        return tuple(sorted({w for w in self.layer_windows if w is not None}))

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
        fields: dict[str, Any] = dict(
            rope=_rope_config(hf), tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)))
        fields.update(_gemma_fields(hf, arch) if arch in GEMMAS else {"layer_windows": _llama_windows(hf)})
        return cls(
            architecture=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(hf.get("head_dim") or hidden // num_heads),
            context_len=int(hf.get("max_position_embeddings") or 2048),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            attention_bias=bool(hf.get("attention_bias", flags["attention_bias"])) or flags["attention_bias"],
            qk_norm=flags["qk_norm"],
            eos_token_ids=_unique(_as_ids(hf.get("eos_token_id")) + tuple(extra_eos_ids)),
            bos_token_id=hf.get("bos_token_id") if isinstance(hf.get("bos_token_id"), int) else None,
            **fields,
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
                       "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "gemma2": GEMMA2,
                       "gemma3_text": GEMMA3}


def _llama_windows(hf: dict[str, Any]) -> tuple[int | None, ...]:
    """The per-layer windows of a Llama-family config, as transformers reads it: `layer_types` where given;
    else Mistral's `sliding_window` on every layer, and Qwen2/3's (when `use_sliding_window`) on the layers from
    `max_window_layers` on. Empty: no window layer."""
    layers, window = int(hf["num_hidden_layers"]), hf.get("sliding_window")
    if not window or not hf.get("use_sliding_window", True):  # NOTE: Mistral has no flag; Qwen2/3 default to off
        return ()
    types = hf.get("layer_types")
    if types is None:
        first = int(hf.get("max_window_layers") or 0) if "use_sliding_window" in hf else 0
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    if len(types) != layers or set(types) - {"sliding_attention", "full_attention"}:
        raise ModelLoadError(f"layer_types must name {layers} layers as sliding_attention or full_attention")
    windows = tuple(int(window) if t == "sliding_attention" else None for t in types)
    return windows if any(w is not None for w in windows) else ()


def _rope_config(hf: dict[str, Any], params: dict[str, Any] | None = None, default_theta: float = 10000.0
                 ) -> RopeConfig:
    if params is None:
        params = dict(hf.get("rope_scaling") or {})
        params.update(hf.get("rope_parameters") or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", default_theta)))
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


# transformers' default layer patterns: Gemma 3, every sixth layer is full; Gemma 2, every second (even layers slide)
GEMMA3_WINDOW_PATTERN = 6
GEMMA2_WINDOW_PATTERN = 2
# Gemma 2's defaults where its config.json omits them (transformers' Gemma2Config)
GEMMA2_ATTN_SOFTCAP, GEMMA2_FINAL_SOFTCAP = 50.0, 30.0


def _gemma_fields(hf: dict[str, Any], arch: str) -> dict[str, Any]:
    """The Gemma part of a config: per-layer windows, the rotaries, the query scale, soft-capping.
    Gemma 3: two rotaries (full and window layers), no attention soft-capping. Gemma 2: one rotary (base 10,000),
    attention scores and logits soft-capped (50 and 30 unless the config says otherwise; null: off)."""
    gemma2 = arch == GEMMA2
    attn_cap = hf.get("attn_logit_softcapping", GEMMA2_ATTN_SOFTCAP if gemma2 else None)
    if attn_cap and not gemma2:
        raise ModelLoadError("attention logit soft-capping is not part of Gemma 3 (Gemma 2 has it: "
                             "architectures Gemma2ForCausalLM); this config is not supported")
    if hf.get("use_bidirectional_attention"):
        raise ModelLoadError("bidirectional attention (EmbeddingGemma) is not supported")
    layers = int(hf["num_hidden_layers"])
    default_pattern = GEMMA2_WINDOW_PATTERN if gemma2 else GEMMA3_WINDOW_PATTERN
    pattern = int(hf.get("sliding_window_pattern") or default_pattern)
    types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                      for i in range(layers)]
    if len(types) != layers or set(types) - {"sliding_attention", "full_attention"}:
        raise ModelLoadError(f"layer_types must name {layers} layers as sliding_attention or full_attention")
    window = int(hf.get("sliding_window") or 4096)
    params = hf.get("rope_parameters") or {}
    if gemma2:  # NOTE: one rotary for every layer; local_rope None means `rope` for window layers too
        rope, local = _rope_config(hf, None, 10_000.0), None
    elif "full_attention" in params:  # transformers 5: one rope per layer type
        rope = _rope_config(hf, dict(params["full_attention"]), 1_000_000.0)
        local = _rope_config(hf, dict(params.get("sliding_attention") or {}), 10_000.0)
    else:  # the older form: rope_theta (+ rope_scaling) global, rope_local_base_freq local
        rope = _rope_config(hf, {**(hf.get("rope_scaling") or {}), **params}, 1_000_000.0)
        local = RopeConfig(theta=float(hf.get("rope_local_base_freq", 10_000.0)))
    if hf.get("hidden_activation", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ModelLoadError(f"Gemma with activation {hf.get('hidden_activation')!r} is not supported")
    cap = hf.get("final_logit_softcapping", GEMMA2_FINAL_SOFTCAP if gemma2 else None)
    return {"rope": rope, "local_rope": local,
            "layer_windows": tuple(window if t == "sliding_attention" else None for t in types),
            "query_pre_attn_scalar": float(hf.get("query_pre_attn_scalar") or 256),
            "final_logit_softcapping": float(cap) if cap else None,
            "attn_logit_softcapping": float(attn_cap) if attn_cap else None,
            "tie_word_embeddings": bool(hf.get("tie_word_embeddings", True))}


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _unique(ids: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(dict.fromkeys(ids))
