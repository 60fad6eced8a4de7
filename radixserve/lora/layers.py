"""The LoRA products of a mixed batch, added to the base products of the model's fused linear layers.

The model fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj` (models/llama.py). An adapter is
packed per fused layer into one shrink matrix and one expand matrix: A is its targeted modules' A stacked
([sum of ranks, in]); B is block-placed ([out, sum of ranks], each module's B times the scaling in its own
rows and its own rank columns, zeros elsewhere), so `(x @ A.T) @ B.T` is the adapter's whole delta of the
fused output; B is kept transposed (Bt [sum of ranks, out], contiguous), the form both paths read. A
batch's rows are grouped by adapter into segments (a contiguous run is a slice, the rest an index),
Punica's SGMV: per segment, one shrink and one expand, added to the base product that was computed once
for the whole batch. Rows of the base model belong to no segment. On the CPU, where the kernel loads
(kernels/lora.py), one C call per layer does every segment of at most `RowTable.lora_segment_rows` rows
(csrc/lora_sgmv.c), torch matmuls the larger ones; elsewhere torch matmuls, two per segment.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from radixserve.configs.row_table import DEFAULT_ROWS, RowTable
from radixserve.layers.linear import LinearBase
from radixserve.lora.adapter import LoraAdapter

# The C kernel takes a segment of fewer rows than this (decode steps, small prefills); a larger one runs torch
# matmuls (oneDNN's GEMM), which were as fast or faster there for rank 64 (docs/lora.md, bench_lora_kernel.py).
# NOTE: the C decoder takes a batch's LoRA rows only where every segment is below this (it calls the kernel
# for all of them, models/c_decoder_lora.py), so that it and these layers always take the same products.
# fused layer -> its modules in output order (models/llama.py fuses them in this order)
FUSED_MODULES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
                 "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


@dataclass(frozen=True)
class PackedLora:
    """An adapter in the form a forward multiplies with: per (layer, fused layer), (A, Bt) in the model's dtype
    on its device, or nothing where the adapter targets none of the fused layer's modules."""

    adapter: LoraAdapter
    layers: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def pack_adapter(adapter: LoraAdapter, out_sizes: dict[str, tuple[int, ...]], dtype: torch.dtype,
                 device: torch.device) -> PackedLora:
    """`out_sizes`: fused layer -> the output size of each of its modules, in order."""
    layers: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    num_layers = 1 + max(layer for layer, _ in adapter.weights)
    for layer in range(num_layers):
        for fused, modules in FUSED_MODULES.items():
            packed = _pack_fused(adapter, layer, modules, out_sizes[fused])
            if packed is not None:
                a, b = packed
                layers[(layer, fused)] = (a.to(device, dtype), b.T.contiguous().to(device, dtype))
    return PackedLora(adapter, layers)


def _pack_fused(adapter: LoraAdapter, layer: int, modules: tuple[str, ...],
                sizes: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor] | None:
    present = [(i, adapter.weights[(layer, m)]) for i, m in enumerate(modules) if (layer, m) in adapter.weights]
    if not present:
        return None
    rank = adapter.rank
    a = torch.cat([pair[0] for _, pair in present])
    b = torch.zeros(sum(sizes), rank * len(present))
    for block, (i, (_, b_module)) in enumerate(present):
        start = sum(sizes[:i])
        b[start:start + sizes[i], block * rank:(block + 1) * rank] = b_module * adapter.scaling
    return a.contiguous(), b.contiguous()


@dataclass
class LoraSegments:
    """This forward's rows grouped by adapter: (rows, packed adapter), rows a slice or an int64 index.
    Empty: no row has an adapter (the base model alone). `kernel`: the C kernel (kernels/lora.LoraKernel)
    where the manager runs on the CPU and it loads; None: torch matmuls. `rows`: the largest segment the kernel
    takes per dtype (the plan's table)."""

    segments: list[tuple[slice | torch.Tensor, PackedLora]] = field(default_factory=list)
    kernel: Any = None
    rows: RowTable = DEFAULT_ROWS
    _plan: tuple[list, torch.dtype, CPlan] | None = field(default=None, repr=False)

    def c_plan(self, dtype: torch.dtype) -> CPlan:
        """Which segments the kernel takes in `dtype` (at most `rows.lora_segment_rows(dtype)`) and its view of them;
        made once per forward and dtype (the same for every layer)."""
        if self._plan is None or self._plan[0] is not self.segments or self._plan[1] != dtype:
            limit = self.rows.lora_segment_rows(dtype) or 0
            small = [seg for seg in self.segments if _row_count(seg[0]) <= limit]
            large = [seg for seg in self.segments if _row_count(seg[0]) > limit]
            parts = [torch.arange(r.start, r.stop) if isinstance(r, slice) else r.cpu() for r, _ in small]
            sizes = torch.tensor([0] + [len(p) for p in parts], dtype=torch.int64)
            index = torch.cat(parts).to(torch.int64).contiguous() if parts else torch.zeros(0, dtype=torch.int64)
            self._plan = (self.segments, dtype, CPlan(small, index, sizes.cumsum(0), large))
        return self._plan[2]


@dataclass(frozen=True)
class CPlan:
    """`c_segments` for the kernel (their rows in one int64 index, segment s at positions offsets[s] ..
    offsets[s + 1]); `torch_segments` for torch matmuls."""

    c_segments: list[tuple[slice | torch.Tensor, PackedLora]]
    index: torch.Tensor
    offsets: torch.Tensor
    torch_segments: list[tuple[slice | torch.Tensor, PackedLora]]


def _row_count(rows: slice | torch.Tensor) -> int:
    return rows.stop - rows.start if isinstance(rows, slice) else rows.numel()


class LoraLinear:
    """What one fused linear layer adds for the adapters of the current forward (`LinearBase.lora`)."""

    def __init__(self, layer_id: int, fused: str, batch: LoraSegments) -> None:
        self.key = (layer_id, fused)
        self.batch = batch  # NOTE: shared by every layer of the model; the LoRA manager fills it per forward

    def add_to(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base product of x, freshly made by the layer's method) plus each segment's delta, in place."""
        segments = self.batch.segments
        if not segments:
            return y
        kernel = self.batch.kernel
        if kernel is not None and x.dim() == 2 and x.dtype == y.dtype and y.is_contiguous() \
                and self.batch.rows.lora_segment_rows(x.dtype) is not None:
            plan = self.batch.c_plan(x.dtype)
            pairs = [packed.layers.get(self.key) for _, packed in plan.c_segments]
            if any(pair is not None for pair in pairs):
                kernel(x.contiguous(), y, plan.index, plan.offsets, pairs)
            segments = plan.torch_segments
        for rows, packed in segments:
            pair = packed.layers.get(self.key)
            if pair is None:
                continue
            a, bt = pair
            if isinstance(rows, slice):
                y[rows] += (x[rows] @ a.T) @ bt
            else:
                y.index_add_(0, rows, (x.index_select(0, rows) @ a.T) @ bt)
        return y


def attach_lora(model: nn.Module, batch: LoraSegments) -> int:
    """Gives every fused linear layer of a Llama-family model its `LoraLinear`; returns how many."""
    count = 0
    for layer_id, layer in enumerate(model.model.layers):
        for fused, linear in (("qkv_proj", layer.self_attn.qkv_proj), ("o_proj", layer.self_attn.o_proj),
                              ("gate_up_proj", layer.mlp.gate_up_proj), ("down_proj", layer.mlp.down_proj)):
            assert isinstance(linear, LinearBase)
            linear.lora = LoraLinear(layer_id, fused, batch)
            count += 1
    return count


def group_rows(row_adapters: list[str | None], row_counts: list[int],
               packed: dict[str, PackedLora], device: torch.device) -> list[tuple[slice | torch.Tensor, PackedLora]]:
    """Segments of a forward whose request i has `row_counts[i]` rows and adapter `row_adapters[i]` (None: base)."""
    rows_of: dict[str, list[tuple[int, int]]] = {}
    start = 0
    for name, count in zip(row_adapters, row_counts, strict=True):
        if name is not None and count:
            runs = rows_of.setdefault(name, [])
            if runs and runs[-1][1] == start:
                runs[-1] = (runs[-1][0], start + count)  # NOTE: merge with the adapter's previous run
            else:
                runs.append((start, start + count))
        start += count
    segments: list[tuple[slice | torch.Tensor, PackedLora]] = []
    for name, runs in rows_of.items():
        if len(runs) == 1:
            segments.append((slice(*runs[0]), packed[name]))
        else:
            index = [i for lo, hi in runs for i in range(lo, hi)]
            segments.append((torch.tensor(index, dtype=torch.int64, device=device), packed[name]))
    return segments
