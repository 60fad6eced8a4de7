"""Which layers of a model get which packed format, their packed methods, and the start-up summary.

Policy (`--quantization int8|int4`): the decoder's linear layers take the asked format (int8 with one
scale per output channel, or int4 with a scale and min per block of 32); the token embedding and
the LM head (one table when tied) take int8 with per-block scales, because a 4-bit LM head costs
clearly more quality than it saves (llama.cpp's Q4 mixes also keep the output in 6 or 8 bits); norms
and biases stay float. A GGUF file's own types override this per tensor (`gguf_packed.py`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

from radixserve.layers.linear import LinearBase
from radixserve.layers.quantization.formats import PackedWeight
from radixserve.layers.quantization.linear import PackedLinearMethod, QuantizedEmbedding

QUANTIZATION_METHODS = {"none": None, "int8": 8, "int4": 4}
DECODER_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
EMBEDDING, LM_HEAD = "model.embed_tokens", "lm_head"


@dataclass(frozen=True)
class PackSpec:
    bits: int
    per_channel: bool = False  # int8 only: one scale per output row instead of per block of 32


def method_bits(method: str) -> int | None:
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization={method!r} is not one of {', '.join(QUANTIZATION_METHODS)}")
    return QUANTIZATION_METHODS[method]


def default_plan(model: nn.Module, method: str) -> dict[str, PackSpec]:
    """Module name -> format, for a checkpoint of float weights."""
    bits = method_bits(method)
    if bits is None:
        return {}
    plan = {name: PackSpec(bits, per_channel=bits == 8) for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and name.rpartition(".")[2] in DECODER_LINEARS}
    plan[EMBEDDING] = plan[LM_HEAD] = PackSpec(8)
    return plan


def quantize_model(model: nn.Module, plan: dict[str, PackSpec], dtype: torch.dtype) -> nn.Module:
    """Gives the planned linear layers a packed method and swaps the planned embedding for a packed one, on the
    meta device before weights exist. A tied LM head's method shares its embedding's packed table."""
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    for name, spec in plan.items():
        if name == LM_HEAD and tied:
            continue
        old = model.get_submodule(name)
        if isinstance(old, nn.Embedding):
            new = QuantizedEmbedding(old.num_embeddings, old.embedding_dim, dtype)
            new.packed = PackedWeight.empty(spec.bits, old.num_embeddings, old.embedding_dim, spec.per_channel)
            _set_submodule(model, name, new)
        else:
            _packed_method(old, PackedWeight.empty(spec.bits, old.out_features, old.in_features, spec.per_channel))
    if tied and EMBEDDING in plan:
        _packed_method(model.get_submodule(LM_HEAD), model.get_submodule(EMBEDDING).packed)
    return model


def _packed_method(layer: nn.Module, packed: PackedWeight) -> None:
    if not isinstance(layer, LinearBase):
        raise TypeError(f"{type(layer).__name__} has no linear method to give a packed weight")
    layer.set_method(PackedLinearMethod(packed))


def packed_holders(model: nn.Module) -> list[PackedLinearMethod | QuantizedEmbedding]:
    """Every object that holds a packed table (`.packed`): packed linear methods and packed embeddings."""
    holders: list[PackedLinearMethod | QuantizedEmbedding] = []
    for module in model.modules():
        if isinstance(module, QuantizedEmbedding):
            holders.append(module)
        elif isinstance(module, LinearBase) and isinstance(module.method, PackedLinearMethod):
            holders.append(module.method)
    return holders


def tile_packed_weights(model: nn.Module) -> int:
    """Re-lays every packed weight in the tiled layout where its kernels run here (tiled.py); a table
    shared by a tied embedding and LM head is tiled once. Returns how many weights were tiled."""
    from radixserve.kernels.quant_tiled import load_tiled_kernel
    from radixserve.layers.quantization.tiled import TiledWeight, tile_weight

    holders = packed_holders(model)
    # NOTE: a float model never builds the tiled kernels (a first start waited ~4 s for them)
    if not holders or load_tiled_kernel() is None:
        return 0
    tiled: dict[int, TiledWeight] = {}
    for holder in holders:
        packed = holder.packed
        if isinstance(packed, PackedWeight):
            if id(packed) not in tiled:
                try:
                    tiled[id(packed)] = tile_weight(packed)
                except ValueError:  # NOTE: a scale float16 cannot hold in the tiled form keeps the row layout
                    continue
            holder.packed = tiled[id(packed)]
    return len(tiled)


def packed_weight_slots(model: nn.Module) -> dict[str, PackedLinearMethod | QuantizedEmbedding]:
    """'<module>.weight' -> what loads it (`load_rows`): a packed linear method or a packed embedding."""
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    slots: dict[str, PackedLinearMethod | QuantizedEmbedding] = {}
    for name, m in model.named_modules():
        if isinstance(m, QuantizedEmbedding):
            slots[f"{name}.weight"] = m
        elif isinstance(m, LinearBase) and isinstance(m.method, PackedLinearMethod) and not (tied and name == LM_HEAD):
            slots[f"{name}.weight"] = m.method
    return slots


def weight_summary(model: nn.Module) -> str:
    """'qkv_proj int4 g32 x30, ...; weights 81.3 MiB' for the start-up line."""
    formats: Counter[str] = Counter()
    for name, m in model.named_modules():
        kind = name.rpartition(".")[2] or name
        if isinstance(m, QuantizedEmbedding) and m.packed is not None:
            formats[f"{kind} {m.packed.format_name}"] += 1
        elif isinstance(m, LinearBase) and isinstance(m.method, PackedLinearMethod):
            formats[f"{kind} {m.method.packed.format_name}"] += 1
        elif isinstance(m, (nn.Linear, nn.Embedding)):
            formats[f"{kind} {str(m.weight.dtype).removeprefix('torch.')}"] += 1
    parts = [f"{fmt} x{count}" if count > 1 else fmt for fmt, count in formats.items()]
    return f"{', '.join(parts)}; weights {weight_bytes(model) / 2**20:.1f} MiB"


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every weight as kept: parameters, packed tables and the linear methods' own forms, each once."""
    forms: dict[int, int] = {}
    for module in model.modules():
        if isinstance(module, QuantizedEmbedding) and module.packed is not None:
            forms[id(module.packed)] = module.packed.nbytes
        elif isinstance(module, LinearBase):
            forms.update(module.method.own_forms())
    return sum(forms.values()) + sum(p.numel() * p.element_size() for p in _unique_params(model))


def _unique_params(model: nn.Module) -> list[torch.Tensor]:
    seen, out = set(), []
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)
