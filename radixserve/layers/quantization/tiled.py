"""The tiled layout of a packed weight, and its kernels (csrc/quant_tiled.c), on CPUs with AVX2 or newer.

The row layout of formats.py (GGUF's blocks, one output row after another) is what loading fills; its
decode kernel dots one weight row at a time and pays a horizontal sum and the block scales per row,
which at K = 576 costs more than reading the row. `TiledWeight` re-lays the same values once after
loading: tiles of 64 output rows, one record per tile and block of 32 inputs holding the 64 scales, the
64 mins and the weights with 16 rows side by side, so that one vpdpbusd gives 16 rows' partial sums (on
AVX2 / AVX-VNNI one 256-bit step gives 8) and the weight is one sequential stream. It replaces the row layout (no second copy): the embedding
reads its rows from it, and products with many rows expand it (transposed) for torch's dense GEMM.
The values are the same: int4 stays scale * u + min; int8 becomes u = q + 128 with min = -128 * scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.layers.quantization.formats import QK, PackedWeight

TILE = 64  # output rows per tile
SUB = 16  # rows per 64-byte weight vector


@dataclass
class TiledWeight:
    """A packed weight [N, K] in the tiled layout: data uint8 [ceil(N / 64), K / 32, record bytes]."""

    bits: int
    data: torch.Tensor
    shape: tuple[int, int]
    format_name: str  # the format it was tiled from (same values)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def dequantize(self, dtype: torch.dtype = torch.float32, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The float weight, or only `rows` of it (the embedding's lookup)."""
        from radixserve.kernels.quant_tiled import load_tiled_kernel

        kernel = load_tiled_kernel()
        if rows is None:
            return kernel.expand_t(self, 0, self.shape[0], dtype).T
        return kernel.rows(self, rows, dtype)


def tile_weight(packed: PackedWeight) -> TiledWeight:
    """The tiled layout of `packed` (see csrc/quant_tiled.c); raises if an int8 scale is too large for it."""
    n, k = packed.shape
    nb, tiles = k // QK, -(-n // TILE)
    scales = packed.scales.float().expand(n, nb) if packed.scales.shape[1] == 1 else packed.scales.float()
    if packed.bits == 8:
        values = (packed.qweight.to(torch.int16) + 128).to(torch.uint8)
        mins = -128 * scales
    else:
        nibbles = packed.qweight.view(n, nb, QK // 2)
        values = torch.cat((nibbles & 0x0F, nibbles >> 4), dim=-1).view(n, k)
        mins = packed.mins.float()
    scales16, mins16 = scales.to(torch.float16), mins.to(torch.float16)
    if not torch.isfinite(mins16).all():
        raise ValueError("an int8 scale is too large for the tiled layout's float16 min (-128 * scale)")
    pad = tiles * TILE - n
    values = torch.nn.functional.pad(values, (0, 0, 0, pad))
    scales16, mins16 = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (scales16, mins16))
    quads = values.view(tiles, TILE // SUB, SUB, nb, QK // 4, 4)  # [tile, sub-tile, row, block, quad, input]
    if packed.bits == 4:
        quads = quads[:, :, :, :, :4] | (quads[:, :, :, :, 4:] << 4)  # quad j low, quad j + 4 high
    weights = quads.permute(0, 3, 4, 1, 2, 5).reshape(tiles, nb, -1)  # [tile, block, quad, sub-tile, row, input]

    def per_block(t: torch.Tensor) -> torch.Tensor:  # [N, nb] float16 -> [tile, block, 64 * 2 bytes]
        return t.view(tiles, TILE, nb).permute(0, 2, 1).contiguous().view(torch.uint8)

    data = torch.cat((per_block(scales16), per_block(mins16), weights), dim=-1).contiguous()
    return TiledWeight(packed.bits, data, packed.shape, packed.format_name)
