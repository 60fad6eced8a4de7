"""The LoRA products of a mixed batch, added to the base products of the model's fused linear layers.

The model fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj` (models/llama.py). An adapter is
packed per fused layer into one shrink matrix and one expand matrix: A is its targeted modules' A stacked
([sum of ranks, in]); B is block-placed ([out, sum of ranks], each module's B times the scaling in its own
rows and its own rank columns, zeros elsewhere), so `(x @ A.T) @ B.T` is the adapter's whole delta of the
fused output. A batch's rows are grouped by adapter into segments (a contiguous run is a slice, the rest
an index), Punica's SGMV in torch: per segment, one shrink and one expand, added to the base product
that was computed once for the whole batch. Rows of the base model belong to no segment.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from radixserve.layers.linear import LinearBase
from radixserve.lora.adapter import LoraAdapter

# fused layer -> its modules in output order (models/llama.py fuses them in this order)
FUSED_MODULES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
                 "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


@dataclass(frozen=True)
class PackedLora:
    """An adapter in the form a forward multiplies with: per (layer, fused layer), (A, B) in the model's dtype
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
                layers[(layer, fused)] = (packed[0].to(device, dtype), packed[1].to(device, dtype))
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
    Empty: no row has an adapter (the base model alone)."""

    segments: list[tuple[slice | torch.Tensor, PackedLora]] = field(default_factory=list)


class LoraLinear:
    """What one fused linear layer adds for the adapters of the current forward (`LinearBase.lora`)."""

    def __init__(self, layer_id: int, fused: str, batch: LoraSegments) -> None:
        self.key = (layer_id, fused)
        self.batch = batch  # NOTE: shared by every layer of the model; the LoRA manager fills it per forward

    def add_to(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base product of x, freshly made by the layer's method) plus each segment's delta, in place."""
        for rows, packed in self.batch.segments:
            pair = packed.layers.get(self.key)
            if pair is None:
                continue
            a, b = pair
            if isinstance(rows, slice):
                y[rows] += (x[rows] @ a.T) @ b.T
            else:
                y.index_add_(0, rows, (x.index_select(0, rows) @ a.T) @ b.T)
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
