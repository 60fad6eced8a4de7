"""Vectorised dequantisation of GGUF tensor data to float32 torch tensors.

Natively: F32, F16, BF16, F64, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K (the types of the common Q4_0/Q4_1/Q8_0
and Q4_K_M files). Other float formats that the `gguf` package can decode (Q5_0, Q5_1, Q2_K,
Q3_K, Q5_K, IQ*) go through `gguf.quants.dequantize`; integer tensors are refused.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from radixserve.configs.model_config import ModelLoadError

Q = GGMLQuantizationType
NATIVE_TYPES = ("F32", "F16", "BF16", "F64", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")
INTEGER_TYPES = ("I8", "I16", "I32", "I64")


def supported_type_names() -> list[str]:
    return list(NATIVE_TYPES) + [t.name for t in Q if t.name not in NATIVE_TYPES and _gguf_can_dequantize(t)]


def dequantize(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...], name: str) -> torch.Tensor:
    """raw: the tensor's bytes as GGUFReader returns them; shape: torch order (rows last-dim last)."""
    if qtype.name in INTEGER_TYPES or (qtype.name not in NATIVE_TYPES and not _gguf_can_dequantize(qtype)):
        raise ModelLoadError(f"tensor {name!r} has type {qtype.name}, which radixserve does not dequantize; "
                             f"supported: {', '.join(supported_type_names())}")
    # NOTE: a copy: GGUFReader hands out read-only memory-mapped arrays, which torch must not wrap.
    data = torch.from_numpy(np.array(raw, copy=True).view(np.uint8).reshape(-1))
    decoder = _DECODERS.get(qtype.name)
    if decoder is None:
        values = _via_gguf(raw, qtype)
    else:
        block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
        if data.numel() % block_bytes:
            raise ModelLoadError(f"tensor {name!r}: {data.numel()} bytes is not a whole number of {qtype.name} blocks")
        values = decoder(data.view(-1, block_bytes))
    numel = int(np.prod(shape))
    if values.numel() != numel:
        raise ModelLoadError(f"tensor {name!r}: {values.numel()} values decoded, shape {shape} needs {numel}")
    return values.reshape(shape)


@functools.cache
def _gguf_can_dequantize(qtype: GGMLQuantizationType) -> bool:
    from gguf import quants

    if qtype not in GGML_QUANT_SIZES:
        return False
    try:
        quants.dequantize(np.zeros((1, GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8), qtype)
    except (NotImplementedError, ValueError, TypeError):
        return False
    return True


def _via_gguf(raw: np.ndarray, qtype: GGMLQuantizationType) -> torch.Tensor:
    from gguf import quants

    return torch.from_numpy(np.ascontiguousarray(quants.dequantize(raw, qtype), dtype=np.float32))


def _f16(data: torch.Tensor) -> torch.Tensor:
    """[n, 2] uint8 -> float32 [n, 1]."""
    return data.contiguous().view(torch.float16).float()


def _f32(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.float32).reshape(-1)


def _f16_plain(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.float16).float().reshape(-1)


def _bf16(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.bfloat16).float().reshape(-1)


def _f64(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.float64).float().reshape(-1)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """34 bytes: f16 scale d, 32 x int8 q; x = d * q."""
    d = _f16(blocks[:, :2])
    q = blocks[:, 2:].contiguous().view(torch.int8).float()
    return (d * q).reshape(-1)


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[n, 16] bytes -> [n, 32] values: low nibbles are elements 0-15, high nibbles 16-31."""
    return torch.cat((packed & 0x0F, packed >> 4), dim=-1).float()


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    """18 bytes: f16 d, 16 bytes of 4-bit q; x = d * (q - 8)."""
    d = _f16(blocks[:, :2])
    return (d * (_nibbles(blocks[:, 2:]) - 8)).reshape(-1)


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    """20 bytes: f16 d, f16 m, 16 bytes of 4-bit q; x = d * q + m."""
    d, m = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    return (d * _nibbles(blocks[:, 4:]) + m).reshape(-1)


def _q4_k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """12 bytes -> eight 6-bit scales and eight 6-bit mins per super-block."""
    a, b, c = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat((a & 63, (c & 0x0F) | ((a >> 6) << 4)), dim=-1)
    mins = torch.cat((b & 63, (c >> 4) | ((b >> 6) << 4)), dim=-1)
    return scales.float(), mins.float()


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    """144 bytes per 256 values: f16 d, f16 dmin, 12 scale bytes, 128 bytes of 4-bit q.

    Eight sub-blocks of 32; 32-byte chunk c holds sub-block 2c in its low and 2c+1 in its high nibbles.
    x = d * scale[s] * q - dmin * min[s].
    """
    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    scales, mins = _q4_k_scales(blocks[:, 4:16])
    qs = blocks[:, 16:].reshape(n, 4, 1, 32)
    q = torch.cat((qs & 0x0F, qs >> 4), dim=2).reshape(n, 8, 32).float()
    x = (d * scales).unsqueeze(-1) * q - (dmin * mins).unsqueeze(-1)
    return x.reshape(-1)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """210 bytes per 256 values: 128 bytes low 4 bits, 64 bytes high 2 bits, 16 int8 scales, f16 d.

    Each half of 128 values: element 32*g + l (g = 0..3) takes its low bits from ql[l] (g even) or
    ql[l + 32] (g odd), low nibble for g < 2 and high nibble otherwise, its high bits from bits
    2g..2g+1 of qh[l], and scale index 2g + l // 16. x = d * scale * (q - 32).
    """
    n = blocks.shape[0]
    ql = blocks[:, :128].reshape(n, 2, 1, 64)
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32)
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float().reshape(n, 2, 4, 2, 1)
    d = _f16(blocks[:, 208:210]).reshape(n, 1, 1, 1, 1)
    low = torch.cat((ql & 0x0F, ql >> 4), dim=2).reshape(n, 2, 4, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)
    high = (qh >> shifts) & 0x03
    q = (low | (high << 4)).float() - 32
    return (d * scales * q.reshape(n, 2, 4, 2, 16)).reshape(-1)


_DECODERS = {
    "F32": _f32, "F16": _f16_plain, "BF16": _bf16, "F64": _f64,
    "Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q4_K": _q4_k, "Q6_K": _q6_k,
}
