"""Packed weight formats: int8 (per-output-channel or per-32-block scales) and int4 (per-32-block scale and min).

Both keep GGUF's block of 32 values along the input dimension, so Q8_0, Q4_0, Q4_1 and Q4_K tensors
load without requantizing: an int4 block is GGUF's Q4_0/Q4_1 nibble layout (byte j holds element j
low and element j + 16 high) with w = scale * q + min; an int8 block is w = scale * q. Scales and
mins are float16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

QK = 32  # values per block along K
INT8_MAX = 127  # NOTE: int8 values lie in [-127, 127]; the AVX2 kernel's sign trick needs it


@dataclass
class PackedWeight:
    """One linear weight [N, K] in a packed format; rows may be filled in pieces (`rows_loaded`)."""

    bits: int  # 8 or 4
    qweight: torch.Tensor  # int8 [N, K], or uint8 [N, K // 2]
    scales: torch.Tensor  # float16 [N, G]: G = K // 32, or 1 (int8 per output channel)
    mins: torch.Tensor | None  # float16 [N, K // 32] (int4 only)
    shape: tuple[int, int]

    @classmethod
    def empty(cls, bits: int, n: int, k: int, per_channel: bool = False) -> PackedWeight:
        if k % QK:
            raise ValueError(f"packed weights need K divisible by {QK}, got {k}")
        if bits == 8:
            groups = 1 if per_channel else k // QK
            return cls(8, torch.zeros(n, k, dtype=torch.int8), torch.zeros(n, groups, dtype=torch.float16), None,
                       (n, k))
        if bits == 4:
            return cls(4, torch.zeros(n, k // 2, dtype=torch.uint8), torch.zeros(n, k // QK, dtype=torch.float16),
                       torch.zeros(n, k // QK, dtype=torch.float16), (n, k))
        raise ValueError(f"bits must be 8 or 4, got {bits}")

    @property
    def format_name(self) -> str:
        if self.bits == 4:
            return "int4 g32"
        return "int8 per-channel" if self.scales.shape[1] == 1 else "int8 g32"

    @property
    def nbytes(self) -> int:
        tensors = (self.qweight, self.scales, self.mins)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def set_rows(self, start: int, part: PackedWeight) -> None:
        """Copies `part` (same format, same K) into rows [start, start + part rows)."""
        if part.bits != self.bits or part.shape[1] != self.shape[1] or part.scales.shape[1] != self.scales.shape[1]:
            raise ValueError(f"cannot place a {part.format_name} {part.shape} part into a {self.format_name} "
                             f"{self.shape} weight")
        rows = part.shape[0]
        if start < 0 or start + rows > self.shape[0]:
            raise ValueError(f"rows [{start}, {start + rows}) lie outside a weight of {self.shape[0]} rows")
        self.qweight[start:start + rows] = part.qweight
        self.scales[start:start + rows] = part.scales
        if self.mins is not None:
            self.mins[start:start + rows] = part.mins

    def load_float_rows(self, tensor: torch.Tensor, start: int) -> None:
        """Quantizes float rows into rows [start, start + len) (a fused layer's shard, or all of it)."""
        if tensor.dim() != 2 or tensor.shape[1] != self.shape[1]:
            raise ValueError(f"tensor shape {tuple(tensor.shape)} does not fit a packed weight of shape {self.shape}")
        self.set_rows(start, quantize(tensor, self.bits, per_channel=self.scales.shape[1] == 1))

    def permute_rows(self, order: torch.Tensor) -> PackedWeight:
        return PackedWeight(self.bits, self.qweight[order].contiguous(), self.scales[order].contiguous(),
                            None if self.mins is None else self.mins[order].contiguous(), self.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The float weight (or only `rows` of it) in plain torch: the reference and the portable path."""
        q = self.qweight if rows is None else self.qweight[rows]
        scales = self.scales if rows is None else self.scales[rows]
        n, k = q.shape[0], self.shape[1]
        if self.bits == 8:
            blocks = q.float().view(n, scales.shape[1], -1)
            return (blocks * scales.float().unsqueeze(-1)).view(n, k).to(dtype)
        mins = self.mins if rows is None else self.mins[rows]
        packed = q.view(n, k // QK, QK // 2)
        values = torch.cat((packed & 0x0F, packed >> 4), dim=-1).float()  # [n, blocks, 32]
        return (values * scales.float().unsqueeze(-1) + mins.float().unsqueeze(-1)).view(n, k).to(dtype)


def quantize_int8(w: torch.Tensor, per_channel: bool = True) -> PackedWeight:
    """Symmetric int8: scale = max |w| / 127 per output row (or per block of 32)."""
    n, k = w.shape
    packed = PackedWeight.empty(8, n, k, per_channel)
    w = w.float().view(n, packed.scales.shape[1], -1)
    scale = (w.abs().amax(dim=-1) / INT8_MAX).to(torch.float16)
    inv = torch.where(scale > 0, 1.0 / scale.float(), torch.zeros_like(scale, dtype=torch.float32))
    packed.qweight.copy_(torch.round(w * inv.unsqueeze(-1)).clamp_(-INT8_MAX, INT8_MAX).view(n, k))
    packed.scales.copy_(scale)
    return packed


def quantize_int4(w: torch.Tensor) -> PackedWeight:
    """Asymmetric 4-bit per block of 32: min and (max - min) / 15, as GGUF's Q4_1."""
    n, k = w.shape
    packed = PackedWeight.empty(4, n, k)
    blocks = w.float().view(n, k // QK, QK)
    lo, hi = blocks.amin(dim=-1), blocks.amax(dim=-1)
    scale = ((hi - lo) / 15).to(torch.float16)
    mins = lo.to(torch.float16)
    inv = torch.where(scale > 0, 1.0 / scale.float(), torch.zeros_like(scale, dtype=torch.float32))
    q = torch.round((blocks - mins.float().unsqueeze(-1)) * inv.unsqueeze(-1)).clamp_(0, 15).to(torch.uint8)
    packed.qweight.copy_(pack_nibbles(q).view(n, k // 2))
    packed.scales.copy_(scale)
    packed.mins.copy_(mins)
    return packed


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """[..., 32] uint8 values 0-15 -> [..., 16] bytes: element j low, element j + 16 high."""
    return q[..., : QK // 2] | (q[..., QK // 2 :] << 4)


def quantize(w: torch.Tensor, bits: int, per_channel: bool = True) -> PackedWeight:
    return quantize_int8(w, per_channel) if bits == 8 else quantize_int4(w)
