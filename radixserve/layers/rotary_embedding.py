"""Rotary position embedding (the Hugging Face "rotate half" layout) with Llama-3 and linear scaling."""

from __future__ import annotations

import math

import torch

from radixserve.configs.model_config import RopeConfig


class RotaryEmbedding:
    """Holds a float32 cos/sin table per device; `cos_sin` is looked up once per forward for all layers."""

    def __init__(self, head_dim: int, rope: RopeConfig, max_position: int) -> None:
        self.head_dim = head_dim
        # NOTE: built on the CPU explicitly; models are constructed under torch.device("meta").
        self.inv_freq = _inv_freq(head_dim, rope)
        self.max_position = max_position
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of shape [num_tokens, 1, head_dim // 2] in `dtype`, ready to broadcast over heads."""
        cos, sin = self._table(positions.device)
        return cos[positions].to(dtype).unsqueeze(1), sin[positions].to(dtype).unsqueeze(1)

    def tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The float32 cos and sin tables [max_position, head_dim // 2] on `device`."""
        return self._table(device)

    def _table(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._tables:
            # NOTE: position * inv_freq in float32, then cos/sin, as transformers does, so bf16 matches it.
            t = torch.arange(self.max_position, dtype=torch.float32, device="cpu")
            freqs = torch.outer(t, self.inv_freq)
            self._tables[device] = (freqs.cos().to(device), freqs.sin().to(device))
        return self._tables[device]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, heads, head_dim] -> rotated copy (same rounding steps as HF's rotate_half form)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, rope)
    if rope.freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(rope.freq_factors, dtype=torch.float32, device="cpu")
    return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    old_len = rope.original_max_position
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)
