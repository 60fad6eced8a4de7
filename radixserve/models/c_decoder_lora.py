"""The LoRA rows of a decode batch inside the one-call C decoder (models/c_decoder.py, csrc/decode_lora.h).

The LoRA manager fills one `LoraSegments` per forward, shared by every fused linear layer of the model
(lora/layers.py); the step finds it through its weight view (`linear.lora.batch`), so it reads the same
segments the Python layers would. After each linear layer the C loop calls the SGMV kernel those layers call
(`LoraSegments.kernel`, csrc/lora_sgmv.c) with the same segments (`LoraSegments.c_plan`: one int64 row index
and offsets) on the same input and output, so the deltas are the Python path's, bit for bit.

Per step this module hands C a `LoraDescriptor`: the kernel's address, the plan's index and offsets, and the
table [layers][4 linear layers][A, Bt, rank][segments] stacked from one small table per packed adapter (made
once per packed adapter, kept while the adapter stays packed). The step declines a LoRA batch where the
Python layers would not run every segment on the C kernel (no kernel here, or a segment over `RowTable.lora_segment_rows`
rows, which torch multiplies), so that both paths always take the same products.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

from radixserve.kernels.c_decoder import LoraDescriptor
from radixserve.lora.layers import LoraSegments, PackedLora

if TYPE_CHECKING:
    from radixserve.models.causal_lm import DecoderWeights

# NOTE: the order of csrc/decode_lora.h's LORA_QKV, LORA_O, LORA_GATE_UP, LORA_DOWN and of
# DecoderLayerWeights.linears
FUSED_ORDER = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class CDecoderLora:
    """What the decode step needs of the current forward's LoRA rows: whether it can take them (`refusal`) and the
    C descriptor of them (`descriptor`)."""

    def __init__(self, weights: DecoderWeights, dtype: torch.dtype) -> None:
        self._weights, self._dtype = weights, dtype
        # id(packed adapter) -> (a weak reference to it, its table [layers, 4, 3] int64, or None: does not fit)
        self._tables: dict[int, tuple[weakref.ref, torch.Tensor | None]] = {}

    def _batch(self) -> LoraSegments | None:
        """The forward's segments, or None where the model serves no LoRA (read at each step: the manager attaches
        its layers after the step is made)."""
        lora = self._weights.layers[0].qkv.lora if self._weights.layers else None
        return None if lora is None else lora.batch

    def refusal(self) -> str | None:
        """Why the step cannot run this forward's LoRA rows; None if it can (or the batch has none)."""
        batch = self._batch()
        if batch is None or not batch.segments:
            return None
        if batch.kernel is None:
            return "the LoRA products run torch matmuls here (no C SGMV kernel)"
        limit = batch.rows.lora_segment_rows(self._dtype)
        if limit is None:
            return f"no C LoRA kernel for {self._dtype}"
        plan = batch.c_plan(self._dtype)
        if plan.torch_segments:
            return f"an adapter has more than {limit} rows, where the Python layers multiply them with torch"
        if any(self._table(packed) is None for _, packed in plan.c_segments):
            return "a packed adapter does not fit the step's dtype or shapes"
        return None

    def descriptor(self) -> tuple[LoraDescriptor | None, list[torch.Tensor]]:
        """The step's LoRA descriptor (None: no LoRA rows) and the tensors its addresses name (the caller keeps them
        alive until the C call returns). Only after `refusal` said None."""
        batch = self._batch()
        if batch is None or not batch.segments:
            return None, []
        plan = batch.c_plan(self._dtype)
        tables = [self._table(packed) for _, packed in plan.c_segments]
        if any(t is None for t in tables):
            raise ValueError("the decode step does not take this forward's LoRA rows (check `takes` first)")
        table = torch.stack(tables, dim=-1).contiguous()  # [layers, 4, 3, segments]
        descriptor = LoraDescriptor(batch.kernel.address, plan.index.data_ptr(), plan.offsets.data_ptr(),
                                    len(tables), table.data_ptr())
        return descriptor, [table, plan.index, plan.offsets]

    def _table(self, packed: PackedLora) -> torch.Tensor | None:
        entry = self._tables.get(id(packed))
        if entry is not None and entry[0]() is packed:
            return entry[1]
        # NOTE: an entry whose adapter was evicted (its weak reference is dead) goes; its id may be reused
        self._tables = {key: e for key, e in self._tables.items() if e[0]() is not None}
        table = self._make_table(packed)
        self._tables[id(packed)] = (weakref.ref(packed), table)
        return table

    def _make_table(self, packed: PackedLora) -> torch.Tensor | None:
        """[layers, 4, 3]: per (layer, linear layer) the packed A's and Bt's addresses and the rank (0, 0, 0 where
        the adapter does not target it); None where a pair does not fit the linear layer or the dtype."""
        rows = []
        for i, layer in enumerate(self._weights.layers):
            for fused, linear in zip(FUSED_ORDER, layer.linears, strict=True):
                pair = packed.layers.get((i, fused))
                if pair is None:
                    rows.append((0, 0, 0))
                    continue
                a, bt = pair
                rank = a.shape[0]
                if (a.dtype != self._dtype or bt.dtype != self._dtype or not (a.is_contiguous() and bt.is_contiguous())
                        or tuple(a.shape) != (rank, linear.in_features)
                        or tuple(bt.shape) != (rank, linear.out_features)):
                    return None
                rows.append((a.data_ptr(), bt.data_ptr(), rank))
        return torch.tensor(rows, dtype=torch.int64).view(len(self._weights.layers), len(FUSED_ORDER), 3)
