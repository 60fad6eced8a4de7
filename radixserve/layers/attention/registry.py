"""Name -> attention backend, and the plan a backend is built with. Entries are import paths so that choosing
one imports only that one."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

import torch

from radixserve.layers.attention.base import AttentionPlan

if TYPE_CHECKING:
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


def resolve_backend(name: str, device: torch.device) -> str:
    """The backend `name` means on `device` (auto: the C kernels on a CPU, torch elsewhere)."""
    if name == AUTO:
        return "cpu" if device.type == "cpu" else "torch"
    return name


def plan_attention(name: str, device: torch.device, cascade: bool = True, windows: tuple[int, ...] = ()
                   ) -> AttentionPlan:
    """The backend `name` resolves to (auto: the C kernels on a CPU, torch elsewhere) and, for the CPU backend,
    the C kernels it uses per dtype: those the measured table (kernels.attention.SELECTED) chose for this CPU's kernel
    class, less the extend kernels where RADIXSERVE_CPU_PREFILL_KERNEL=0, plus bf16 extend and cascade's part (a) on
    AMX tiles where the CPU has them. `cascade`: may split attention over a prefix the whole batch shares. `windows`: the
    model's distinct sliding windows (ModelConfig.windows)."""
    name = resolve_backend(name, device)
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(attention_backend_names())}")
    if name != "cpu":
        return AttentionPlan(name, cascade, windows=windows)
    from radixserve import envs
    from radixserve.kernels.attention import SELECTED, load_decode_kernel
    from radixserve.kernels.attention_amx import load_amx_extend_kernel

    kernel = load_decode_kernel()
    if kernel is None:
        return AttentionPlan(name, cascade, windows=windows)
    prefill = envs.CPU_PREFILL_KERNEL.get()
    amx = prefill and load_amx_extend_kernel() is not None
    kernels = {}
    for dtype in (torch.float32, torch.bfloat16):
        chosen = set(SELECTED.get((kernel.kernel_class, dtype), ()))
        if not prefill:
            chosen.discard("extend")
        if amx and dtype == torch.bfloat16:  # extend and cascade's part (a) on the tiles
            chosen |= {"extend_amx", "prefix_amx"}
        kernels[dtype] = frozenset(chosen)
    return AttentionPlan(name, cascade, kernels, kernel.isa, kernel.kernel_class, windows)


def create_attention_backend(name: str, device: torch.device, cascade: bool = True,
                             plan: AttentionPlan | None = None, windows: tuple[int, ...] = ()) -> AttentionBackend:
    """Builds a backend from `plan`, or from `plan_attention(name, device, cascade, windows)` without one."""
    plan = plan or plan_attention(name, device, cascade, windows)
    module_name, class_name = _BACKENDS[plan.backend].split(":")
    backend_cls = getattr(importlib.import_module(module_name), class_name)
    return backend_cls(plan=plan)
