"""Attention backends: the interface, the registry, and the torch implementation (CPU and CUDA)."""

from radixserve.layers.attention.base import AttentionBackend
from radixserve.layers.attention.registry import (
    attention_backend_names,
    create_attention_backend,
    register_attention_backend,
)

__all__ = ["AttentionBackend", "attention_backend_names", "create_attention_backend", "register_attention_backend"]
