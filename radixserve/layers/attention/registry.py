"""Name -> attention backend, and the plan a backend is built with. Entries are import paths so that choosing
one imports only that one."""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING

import torch

from radixserve.configs.row_table import DEFAULT_ROWS, RowTable
from radixserve.layers.attention.base import AttentionPlan

if TYPE_CHECKING:
    from radixserve.layers.attention.base import AttentionBackend

_BACKENDS: dict[str, str] = {
    "torch": "radixserve.layers.attention.torch_backend:TorchAttnBackend",
    "cpu": "radixserve.layers.attention.torch_backend:CpuAttnBackend",
    "triton": "radixserve.layers.attention.triton_backend:TritonAttnBackend",
}
AUTO = "auto"  # "cpu" on CPU devices, "triton" on CUDA where triton is installed, else "torch"


def register_attention_backend(name: str, import_path: str) -> None:
    """Adds a backend, e.g. register_attention_backend("triton", "pkg.module:TritonAttnBackend")."""
    _BACKENDS[name] = import_path


def attention_backend_names() -> list[str]:
    return [AUTO, *sorted(_BACKENDS)]


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def resolve_backend(name: str, device: torch.device) -> str:
    """The backend `name` means on `device` (auto: the C kernels on a CPU, triton on CUDA where triton is
    installed, torch elsewhere)."""
    return resolve_with_reason(name, device)[0]


def resolve_with_reason(name: str, device: torch.device) -> tuple[str, str]:
    """`resolve_backend`'s answer and why (the execution plan's "attention backend" entry)."""
    if name != AUTO:
        return name, f"--attention-backend {name}"
    if device.type == "cpu":
        return "cpu", "auto on a CPU: the C kernels where measured faster, torch for the rest"
    if device.type == "cuda" and triton_available():
        return "triton", "auto on CUDA: paged split-K decode and prefix + causal extend kernels, CUDA-graph ready"
    if device.type == "cuda":
        return "torch", "auto on CUDA without triton installed: gathered K/V and torch's SDPA"
    return "torch", f"auto on {device.type}: torch's ops"


def plan_attention(name: str, device: torch.device, cascade: bool = True, windows: tuple[int, ...] = (),
                   rows: RowTable = DEFAULT_ROWS) -> AttentionPlan:
    """The backend `name` resolves to (auto: the C kernels on a CPU, torch elsewhere) and, for the CPU backend,
    the C kernels it uses per dtype: those the measured table (kernels.attention.SELECTED) chose for this CPU's kernel
    class, less the extend kernels where RADIXSERVE_CPU_PREFILL_KERNEL=0, plus bf16 extend and cascade's part (a) on
    AMX tiles where the CPU has them. `cascade`: may split attention over a prefix the whole batch shares. `windows`: the
    model's distinct sliding windows (ModelConfig.windows). `rows`: the plan's row table (the extend kernel's limit,
    the cascade policy)."""
    name, reason = resolve_with_reason(name, device)
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(attention_backend_names())}")
    if name == "triton":  # NOTE: no cascade path: every request attends over its whole context
        return AttentionPlan(name, False, windows=windows, reason=reason, rows=rows)
    if name != "cpu":
        return AttentionPlan(name, cascade, windows=windows, reason=reason, rows=rows)
    from radixserve import envs
    from radixserve.kernels.attention import SELECTED, load_decode_kernel
    from radixserve.kernels.attention_amx import load_amx_extend_kernel

    kernel = load_decode_kernel()
    if kernel is None:
        return AttentionPlan(name, cascade, windows=windows, reason=reason, rows=rows)
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
    return AttentionPlan(name, cascade, kernels, kernel.isa, kernel.kernel_class, windows, reason, rows)


def backend_class(name: str) -> type[AttentionBackend]:
    """The class a registered backend name builds (imported on first use)."""
    module_name, class_name = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)


def create_attention_backend(name: str, device: torch.device, cascade: bool = True,
                             plan: AttentionPlan | None = None, windows: tuple[int, ...] = ()) -> AttentionBackend:
    """Builds a backend from `plan`, or from `plan_attention(name, device, cascade, windows)` without one."""
    plan = plan or plan_attention(name, device, cascade, windows)
    return backend_class(plan.backend)(plan=plan)
