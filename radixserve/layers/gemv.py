"""The decode linear method on CPUs with AVX512-BF16: our kernels for decode batches, oneDNN above.

At decode batch sizes a linear layer's cost is reading its weight once. oneDNN's bf16 product reads it
at about half the memory bandwidth at those sizes; our kernels read a tile-interleaved copy of the
weight as one sequential stream with software prefetch:
* csrc/bf16_amx.c (AMX tiles) for 1 to `RowTable.amx_rows` rows where the CPU has AMX-BF16: 1.3-2.6x faster
  than oneDNN at 8-32 rows, and 1.1-1.3x faster than the GEMV at 1-4 (benchmarks/bench_decode_linear.py);
* csrc/bf16_gemv.c (register-blocked vdpbf16ps) for up to `RowTable.bf16_gemv_rows` (32, RADIXSERVE_GEMV_MAX_ROWS)
  without AMX (or in_features % 32 != 0): 0.66-0.90x oneDNN's time at 8-32 rows on a Zen 4 EPYC, where it beat
  oneDNN at every decoder shape of the shape ladder from 1 to 32 rows (benchmarks/bench_decode_linear.py); up to
  that size a decode batch (or a speculative verify step: requests + drafts) runs the C decoder.
Larger batches and prefill keep oneDNN's prepacked weight, so the layer keeps two copies of its weight:
`--linear-method onednn` keeps one.
"""

from __future__ import annotations

import torch

from radixserve.kernels.gemv import (
    Bf16Gemv,
    load_amx_kernel,
    load_amx_large_kernel,
    load_gemv_kernel,
    onednn_alias,
    pack_gemv_weight,
)
from radixserve.layers.linear import LinearBase, OneDNNLinearMethod, register_linear_method

# Row counts (prefill chunks) at which the large AMX product is timed against oneDNN's (linear_tuning.py);
# rows r take the decision of the first point >= r, and oneDNN beyond the last.
LARGE_GRID = (*range(64, 1281, 64), *range(1408, 2049, 128))


def grid_point(rows: int) -> int:
    """The LARGE_GRID point whose decision `rows` takes: the first >= rows (0 beyond the grid: oneDNN)."""
    return next((point for point in LARGE_GRID if point >= rows), 0)


def has_large_product(in_features: int) -> bool:
    """Whether a GEMV-method layer of this width gets the large AMX product (timed against oneDNN above
    decode sizes): AMX-BF16 here and in_features a multiple of 32."""
    return in_features % 32 == 0 and load_amx_kernel() is not None and load_amx_large_kernel() is not None


class GemvLinearMethod(OneDNNLinearMethod):
    """Our AMX kernel up to `rows.amx_rows` rows (the GEMV up to `rows.bf16_gemv_rows` without AMX); above, oneDNN's
    prepacked product, or our large AMX product at the row counts where it measured faster here
    (`large_rows`, LARGE_GRID points planned by linear_tuning.plan_large_rows)."""

    name = "onednn_gemv"
    preference = 1  # NOTE: oneDNN's own product above the decode rows, and the one the C decoder needs

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype) -> bool:
        return (dtype == torch.bfloat16 and super().supports(device, dtype)
                and load_gemv_kernel() is not None)

    def __init__(self) -> None:
        super().__init__()
        self.gemv_weight: torch.Tensor | None = None  # the tile-interleaved copy our kernels read
        self.shares_onednn_buffer = False  # True: `gemv_weight` is a view of oneDNN's packed buffer, not a copy
        self.amx: Bf16Gemv | None = None

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        super().process_weights_after_loading(layer)
        gemv = pack_gemv_weight(layer.weight.detach())
        # NOTE: where oneDNN's blocked layout is byte for byte our tile layout (on AVX512-BF16 without AMX it picks
        # AB16b64a2b, which is [N/64][K/2][64][2]), the GEMV reads oneDNN's buffer and the model keeps one copy of
        # its weights instead of two; elsewhere (another layout, another ISA) it keeps its own
        self.gemv_weight = onednn_alias(self.packed_weight, gemv)
        self.shares_onednn_buffer = self.gemv_weight is not gemv
        self.kernel = load_gemv_kernel()
        amx = load_amx_kernel() if layer.in_features % 32 == 0 else None
        self.amx = amx
        self.large = load_amx_large_kernel() if amx is not None else None
        self.large_rows: frozenset[int] = frozenset()

    def decode_kernel(self, rows: int) -> Bf16Gemv | None:
        """The kernel for a decode batch of `rows` rows (the C decoder asks too), None above them."""
        if self.amx is not None and 0 < rows <= self.rows.amx_rows:
            return self.amx
        return self.kernel if 0 < rows <= self.rows.bf16_gemv_rows else None

    def c_linear(self, rows: int, dtype: torch.dtype) -> int | None:
        kernel = self.decode_kernel(rows) if dtype == torch.bfloat16 else None
        return None if kernel is None else kernel.address

    @property
    def c_weight(self) -> torch.Tensor | None:
        return self.gemv_weight

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0] if x.dim() == 2 and x.is_contiguous() else 0
        kernel = self.decode_kernel(rows)
        if kernel is not None:
            return kernel(self.gemv_weight, x, layer.bias, layer.out_features)
        if rows and self.large_rows and grid_point(rows) in self.large_rows:
            return self.large(self.gemv_weight, x, layer.bias, layer.out_features)
        return super().apply(layer, x)

    def row_kernels(self, in_features: int, large_rows: frozenset[int] = frozenset()) -> str:
        amx = in_features % 32 == 0 and load_amx_kernel() is not None
        small = f"1-{self.rows.amx_rows} rows AMX" if amx else f"1-{self.rows.bf16_gemv_rows} rows GEMV"
        large = f", the large AMX product at {len(large_rows)} of {len(LARGE_GRID)} prefill row counts" if large_rows else ""
        return f"{small}, oneDNN above{large}"

    def own_forms(self) -> dict[int, int]:
        gemv = self.gemv_weight
        if gemv is None or self.shares_onednn_buffer:
            return super().own_forms()
        return {**super().own_forms(), id(gemv): gemv.numel() * gemv.element_size()}


register_linear_method(GemvLinearMethod)
