"""Which layers of a model get which packed format, the swap of their modules, and the start-up summary.

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

from radixserve.layers.quantization.formats import PackedWeight
from radixserve.layers.quantization.linear import QuantizedEmbedding, QuantizedLinear

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
    """Swaps the planned modules (on the meta device, before weights exist) for packed ones with empty weights.

    A tied LM head shares its embedding's packed table."""
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    for name, spec in plan.items():
        if name == LM_HEAD and tied:
            continue
        old = model.get_submodule(name)
        if isinstance(old, nn.Embedding):
            new = QuantizedEmbedding(old.num_embeddings, old.embedding_dim, dtype)
            new.packed = PackedWeight.empty(spec.bits, old.num_embeddings, old.embedding_dim, spec.per_channel)
        else:
            new = QuantizedLinear(old.in_features, old.out_features, spec.bits, old.bias is not None,
                                  spec.per_channel, dtype)
            new.packed = PackedWeight.empty(spec.bits, old.out_features, old.in_features, spec.per_channel)
        _set_submodule(model, name, new)
    if tied and EMBEDDING in plan:
        embed = model.get_submodule(EMBEDDING)
        head = QuantizedLinear(embed.embedding_dim, embed.num_embeddings, embed.packed.bits)
        head.packed = embed.packed
        _set_submodule(model, LM_HEAD, head)
    return model


def tile_packed_weights(model: nn.Module) -> int:
    """Re-lays every packed weight in the tiled layout where its kernels run here (tiled.py); a table
    shared by a tied embedding and LM head is tiled once. Returns how many weights were tiled."""
    from radixserve.layers.quantization.tiled import TiledWeight, load_tiled_kernel, tile_weight

    if load_tiled_kernel() is None:
        return 0
    tiled: dict[int, TiledWeight] = {}
    for module in model.modules():
        packed = getattr(module, "packed", None) if isinstance(module, (QuantizedLinear, QuantizedEmbedding)) else None
        if isinstance(packed, PackedWeight):
            if id(packed) not in tiled:
                try:
                    tiled[id(packed)] = tile_weight(packed)
                except ValueError:  # NOTE: a scale float16 cannot hold in the tiled form keeps the row layout
                    continue
            module.packed = tiled[id(packed)]
    return len(tiled)


def packed_weight_slots(model: nn.Module) -> dict[str, QuantizedLinear | QuantizedEmbedding]:
    """'<module>.weight' -> the packed module that loads it (`load_rows`), for `load_weights`."""
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    return {f"{name}.weight": m for name, m in model.named_modules()
            if isinstance(m, (QuantizedLinear, QuantizedEmbedding)) and not (tied and name == LM_HEAD)}


def weight_summary(model: nn.Module) -> str:
    """'qkv_proj int4 g32 x30, ...; weights 81.3 MiB' for the start-up line."""
    formats: Counter[str] = Counter()
    seen: set[int] = set()
    total = 0
    for name, m in model.named_modules():
        kind = name.rpartition(".")[2] or name
        if isinstance(m, (QuantizedLinear, QuantizedEmbedding)) and m.packed is not None:
            formats[f"{kind} {m.packed.format_name}"] += 1
            if id(m.packed) not in seen:
                seen.add(id(m.packed))
                total += m.packed.nbytes
        elif isinstance(m, (nn.Linear, nn.Embedding)):
            formats[f"{kind} {str(m.weight.dtype).removeprefix('torch.')}"] += 1
    total += sum(p.numel() * p.element_size() for p in _unique_params(model)) + _prepacked_bytes(model)
    parts = [f"{fmt} x{count}" if count > 1 else fmt for fmt, count in formats.items()]
    return f"{', '.join(parts)}; weights {total / 2**20:.1f} MiB"


def weight_bytes(model: nn.Module) -> int:
    packed = {id(m.packed): m.packed.nbytes for m in model.modules()
              if isinstance(m, (QuantizedLinear, QuantizedEmbedding)) and m.packed is not None}
    return (sum(packed.values()) + sum(p.numel() * p.element_size() for p in _unique_params(model))
            + _prepacked_bytes(model))


def _prepacked_bytes(model: nn.Module) -> int:
    """Weights a float linear method keeps in its own layout (layers/linear.py), beside the parameters."""
    from radixserve.layers.linear import LinearBase

    return sum(m.weight_nbytes() for m in model.modules() if isinstance(m, LinearBase) and m.packed_weight is not None)


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
