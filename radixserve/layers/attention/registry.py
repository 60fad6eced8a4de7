"""Name -> attention backend. Entries are import paths so that choosing one imports only that one."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from radixserve.layers.attention.base import AttentionBackend

_BACKENDS: dict[str, str] = {
    "torch": "radixserve.layers.attention.torch_backend:TorchAttnBackend",
    "cpu": "radixserve.layers.attention.torch_backend:CpuAttnBackend",
}
AUTO = "auto"  # "cpu" on CPU devices, "torch" elsewhere


def register_attention_backend(name: str, import_path: str) -> None:
    """Adds a backend, e.g. register_attention_backend("triton", "pkg.module:TritonAttnBackend")."""
    _BACKENDS[name] = import_path


def attention_backend_names() -> list[str]:
    return [AUTO, *sorted(_BACKENDS)]


def create_attention_backend(name: str, device: torch.device, cascade: bool = True) -> AttentionBackend:
    """Builds the named backend (auto: the C kernels on a CPU, torch elsewhere); `cascade`: may split attention
    over a prefix the whole batch shares (off with --disable-cascade-attention)."""
    if name == AUTO:
        name = "cpu" if device.type == "cpu" else "torch"
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(attention_backend_names())}")
    module_name, class_name = _BACKENDS[name].split(":")
    backend_cls = getattr(importlib.import_module(module_name), class_name)
    return backend_cls(use_cascade=cascade)
