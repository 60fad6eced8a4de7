"""RMSNorm with an optional fused residual add (the residual stream stays in the model dtype)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.fused_add = None  # a compiled add + norm (layers/fused_ops.py), or None: eager

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Returns norm(x), or (norm(x + residual), x + residual) when a residual is given."""
        if residual is not None:
            if self.fused_add is not None:
                return self.fused_add(x.contiguous(), residual.contiguous(), self.weight)
            x = x + residual
            return self._norm(x), x
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The one torch definition of RMSNorm, run eagerly here and compiled by the fused ops (fused_ops.py).

    NOTE: same rounding steps as Hugging Face's LlamaRMSNorm (normalise in float32, round to the model dtype,
    then scale), so bf16 outputs stay as close to transformers as possible."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)
