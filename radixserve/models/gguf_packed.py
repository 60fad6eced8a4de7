"""GGUF tensors straight into packed layers: each quantized tensor keeps its nearest packed format.

Q8_0 -> int8 (per-block scales) and Q4_0 / Q4_1 / Q4_K -> int4 are exact: the blocks are re-laid,
never rounded again (Q4_K's 6-bit sub-block scales become float16 products). Q5_0 / Q5_1 / Q5_K /
Q6_K / Q8_K hold more than 4 bits, so they become int8 with per-block scales; the 2- and 3-bit types
become int4; both after dequantizing that one tensor. Float tensors of layers that are packed take
the --quantization format. A fused layer (q/k/v, gate/up) whose shards differ takes the widest.
Only one tensor at a time is ever expanded to float32, never the whole model.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from radixserve.configs.model_config import ModelLoadError
from radixserve.layers.quantization.formats import QK, PackedWeight, pack_nibbles, quantize
from radixserve.layers.quantization.model_quant import EMBEDDING, LM_HEAD, PackSpec, default_plan
from radixserve.model_loader.gguf_dequant import _q4_k_scales, dequantize
from radixserve.model_loader.gguf_loader import (
    _PERMUTED_ARCHITECTURES,
    gguf_architecture_of,
    gguf_tensor,
    hf_tensor_name,
    unpermute_rows,
)

EXACT_INT8 = ("Q8_0",)
EXACT_INT4 = ("Q4_0", "Q4_1", "Q4_K")
WIDE_TYPES = ("Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_1", "Q8_K")  # more than 4 bits: int8 per block
FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


def nearest_spec(type_name: str) -> PackSpec | None:
    """The packed format that holds a GGUF type without losing it; None for float types."""
    if type_name in FLOAT_TYPES:
        return None
    if type_name in EXACT_INT8 or type_name in WIDE_TYPES:
        return PackSpec(8)
    return PackSpec(4)


def gguf_plan(reader, model: nn.Module, method: str, arch: str = "llama") -> dict[str, PackSpec]:
    """Module name -> format: the widest nearest format over the module's GGUF tensors, else the method's."""
    plan = default_plan(model, method)
    found: dict[str, list[PackSpec | None]] = {}
    for t in reader.tensors:
        name = hf_tensor_name(t.name, arch)
        if name is None or not name.endswith(".weight"):
            continue
        target, _ = model._target_of(name)
        module = target.removesuffix(".weight")
        if module in plan:
            found.setdefault(module, []).append(nearest_spec(t.tensor_type.name))
    for module, specs in found.items():
        packed = [s for s in specs if s is not None]
        if not packed:
            continue  # float in the file: the method's format
        if len(packed) < len(specs) or len({s.bits for s in packed}) > 1:
            plan[module] = PackSpec(8)  # mixed shards: the widest format holds them all
        else:
            plan[module] = PackSpec(packed[0].bits)
    if EMBEDDING in plan and LM_HEAD in plan and LM_HEAD not in found:
        plan[LM_HEAD] = plan[EMBEDDING]
    return plan


def iter_gguf_weights(reader, config: dict, plan: dict[str, PackSpec], dtype: torch.dtype, model: nn.Module
                      ) -> Iterator[tuple[str, torch.Tensor | PackedWeight]]:
    """(Hugging Face name, float tensor or PackedWeight) per GGUF tensor, in file order."""
    permuted = config["model_type"] in _PERMUTED_ARCHITECTURES
    arch = gguf_architecture_of(config)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    for t in reader.tensors:
        name = hf_tensor_name(t.name, arch)
        if name is None:
            continue
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        target, _ = model._target_of(name)
        spec = plan.get(target.removesuffix(".weight")) if name.endswith(".weight") else None
        rows = heads if ".q_proj." in name else kv_heads
        unpermute = permuted and (".q_proj." in name or ".k_proj." in name)
        if spec is None:
            tensor = gguf_tensor(arch, name, dequantize(t.data, t.tensor_type, shape, t.name))
            yield name, (unpermute_rows(tensor, rows) if unpermute else tensor).to(dtype)
            continue
        packed = to_packed(t.data, t.tensor_type, shape, spec, t.name)
        if unpermute:
            packed = packed.permute_rows(unpermute_rows(torch.arange(shape[0]), rows))
        yield name, packed


def to_packed(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...], spec: PackSpec,
              name: str) -> PackedWeight:
    """One GGUF tensor [N, K] in `spec`'s format: re-laid blocks when exact, else dequantized and quantized."""
    if len(shape) != 2 or shape[1] % QK:
        raise ModelLoadError(f"tensor {name!r} of shape {shape} cannot be packed (needs 2 dims, K divisible by {QK})")
    kind = qtype.name
    exact = (spec.bits == 8 and not spec.per_channel and kind in EXACT_INT8) or (spec.bits == 4 and kind in EXACT_INT4)
    if not exact:
        return quantize(dequantize(raw, qtype, shape, name), spec.bits, spec.per_channel)
    n, k = shape
    block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
    data = np.array(raw, copy=True).view(np.uint8).reshape(-1)
    if data.size != n * k // block_elems * block_bytes:
        raise ModelLoadError(f"tensor {name!r}: {data.size} bytes do not hold {kind} blocks of shape {shape}")
    blocks = torch.from_numpy(data).view(n, k // block_elems, block_bytes)
    return _RELAYOUT[kind](blocks, n, k)


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """[..., 2] bytes -> float16 [...]."""
    return raw.contiguous().view(torch.float16).squeeze(-1)


def _q8_0(blocks: torch.Tensor, n: int, k: int) -> PackedWeight:
    out = PackedWeight.empty(8, n, k)
    # NOTE: -128 is clamped to -127: the int8 format's range (a Q8_0 quantizer never writes -128).
    out.qweight.copy_(blocks[..., 2:].contiguous().view(torch.int8).clamp(-127, 127).view(n, k))
    out.scales.copy_(_f16(blocks[..., 0:2]))
    return out


def _q4_0(blocks: torch.Tensor, n: int, k: int) -> PackedWeight:
    out = PackedWeight.empty(4, n, k)
    d = _f16(blocks[..., 0:2])
    out.qweight.copy_(blocks[..., 2:].reshape(n, k // 2))
    out.scales.copy_(d)
    out.mins.copy_(-8 * d)
    return out


def _q4_1(blocks: torch.Tensor, n: int, k: int) -> PackedWeight:
    out = PackedWeight.empty(4, n, k)
    out.qweight.copy_(blocks[..., 4:].reshape(n, k // 2))
    out.scales.copy_(_f16(blocks[..., 0:2]))
    out.mins.copy_(_f16(blocks[..., 2:4]))
    return out


def _q4_k(blocks: torch.Tensor, n: int, k: int) -> PackedWeight:
    """256-value super-blocks of eight 32-value sub-blocks; see gguf_dequant._q4_k for the layout."""
    out = PackedWeight.empty(4, n, k)
    flat = blocks.reshape(-1, blocks.shape[-1])
    d, dmin = _f16(flat[:, 0:2]).float().unsqueeze(-1), _f16(flat[:, 2:4]).float().unsqueeze(-1)
    scales, mins = _q4_k_scales(flat[:, 4:16])
    qs = flat[:, 16:].reshape(-1, 4, 1, 32)
    values = torch.cat((qs & 0x0F, qs >> 4), dim=2).reshape(-1, 8, 32)  # sub-block 2c low, 2c + 1 high
    out.qweight.copy_(pack_nibbles(values).reshape(n, k // 2))
    out.scales.copy_((d * scales).reshape(n, k // QK).to(torch.float16))
    out.mins.copy_((-dmin * mins).reshape(n, k // QK).to(torch.float16))
    return out


_RELAYOUT = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q4_K": _q4_k}


def load_gguf_packed(path: Path, dtype: torch.dtype, device: torch.device, method: str
                     ) -> tuple[nn.Module, object, object]:
    """(model with packed layers, ModelConfig, tokenizer) read straight from the GGUF file."""
    import json

    from radixserve.layers.quantization.model_quant import quantize_model
    from radixserve.model_loader.gguf_loader import gguf_to_hf_folder, open_gguf
    from radixserve.model_loader.model_folder import read_config_and_tokenizer
    from radixserve.models.registry import model_class

    if device.type != "cpu":
        raise ModelLoadError(f"packed (quantized) weights run on the CPU only, not on {device.type}")
    folder = gguf_to_hf_folder(path, None)
    config, tokenizer = read_config_and_tokenizer(folder)
    reader = open_gguf(path)
    with torch.device("meta"):
        model = model_class(config)(config).to(dtype)
    hf_config = json.loads((folder / "config.json").read_text())
    plan = gguf_plan(reader, model, method, gguf_architecture_of(hf_config))
    quantize_model(model, plan, dtype)
    model = model.to_empty(device=device)
    model.tie_weights()
    model.load_weights(iter_gguf_weights(reader, hf_config, plan, dtype, model))
    return model.eval(), config, tokenizer
