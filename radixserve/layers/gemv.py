"""The decode linear method on CPUs with AVX512-BF16: our kernels for decode batches, oneDNN above.

At decode batch sizes a linear layer's cost is reading its weight once. oneDNN's bf16 product reads it
at about half the memory bandwidth at those sizes; our kernels read a tile-interleaved copy of the
weight as one sequential stream with software prefetch:
* csrc/bf16_amx.c (AMX tiles) for 1 to AMX_MAX_ROWS rows where the CPU has AMX-BF16: 1.3-2.6x faster
  than oneDNN at 8-32 rows, and 1.1-1.3x faster than the GEMV at 1-4 (benchmarks/bench_decode_linear.py);
* csrc/bf16_gemv.c (AVX-512 FMAs) for up to GEMV_MAX_ROWS rows without AMX (or in_features % 32 != 0).
Larger batches and prefill keep oneDNN's prepacked weight, so the layer keeps two copies of its weight:
`--linear-method onednn` keeps one.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from radixserve import platform as rs_platform
from radixserve.kernels.build import CSRC, call_profiled, is_x86, load_amx_library, load_library
from radixserve.layers.linear import LinearBase, OneDNNLinearMethod, register_linear_method
from radixserve.platform import AMX_FLAGS, ISA_FLAGS

SOURCE = CSRC / "bf16_gemv.c"
FLAGS = ISA_FLAGS["avx512_bf16"]
TILE = 64  # output rows per tile of the packed layout (csrc/bf16_gemv.c)
# Rows up to which the kernel beats oneDNN at every shape of the default model (at 8 rows it ties at the
# narrow shapes and loses at the wide ones; benchmarks/bench_decode_linear.py).
GEMV_MAX_ROWS = 4
AMX_MAX_ROWS = 32  # the AMX kernel's two 16-row A tiles
# Row counts (prefill chunks) at which the large AMX product is timed against oneDNN's (linear_tuning.py);
# rows r take the decision of the first point >= r, and oneDNN beyond the last.
LARGE_GRID = (*range(64, 1281, 64), *range(1408, 2049, 128))
AMX_SOURCE = CSRC / "bf16_amx.c"
AMX_HEADERS = (CSRC / "amx_tiles.h",)


class Bf16Gemv:
    """ctypes binding of a kernel over the packed layout: `bf16_gemv`, or `bf16_amx_gemm` (same arguments;
    ctypes releases the GIL; the kernel runs on torch's OpenMP pool)."""

    def __init__(self, fn: ctypes._CFuncPtr, name: str) -> None:
        self._fn, self.name = fn, name
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
        self.profile_name = f"radixserve::linear::{name}"

    @property
    def address(self) -> int:
        """The C function's address (for C code that calls the kernel itself: models/decode_step.py)."""
        return ctypes.cast(self._fn, ctypes.c_void_p).value

    def __call__(self, packed: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
        """x [M, K] bfloat16 contiguous, packed from `pack_gemv_weight` -> y [M, N] bfloat16."""
        m, k = x.shape
        y = torch.empty(m, n, dtype=torch.bfloat16)
        args = (packed.data_ptr(), x.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(), m, n, k,
                torch.get_num_threads())
        status = call_profiled(self.profile_name, self._fn, *args)
        if status != 0:
            raise ValueError(f"{self.name} rejected x {tuple(x.shape)} for a weight with {n} rows (status {status})")
        return y


def pack_gemv_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] bfloat16 -> [ceil(N / TILE), K / 2, TILE, 2]: the kernel's tile-interleaved layout."""
    n, k = weight.shape
    if k % 2:
        raise ValueError(f"the GEMV layout needs an even number of input features, got {k}")
    padded = weight.new_zeros(-(-n // TILE) * TILE, k)
    padded[:n] = weight
    return padded.view(-1, TILE, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def load_amx_kernel() -> Bf16Gemv | None:
    """The AMX kernel where AMX-BF16 is visible (read at each call: a forced lower RADIXSERVE_CPU_ISA hides
    it), the kernel builds and the OS grants this process AMX state; else None."""
    if not is_x86() or rs_platform.kernel_class() != "amx":
        return None
    return _built_amx_kernel()


def load_amx_large_kernel() -> Bf16Gemv | None:
    """The AMX product for any number of rows (same conditions as `load_amx_kernel`), or None."""
    if not is_x86() or rs_platform.kernel_class() != "amx":
        return None
    return _built_amx_kernel("bf16_amx_gemm_large", "bf16_amx_large")


@functools.cache
def _built_amx_kernel(function: str = "bf16_amx_gemm", name: str = "bf16_amx") -> Bf16Gemv | None:
    lib = _amx_library()
    return None if lib is None else Bf16Gemv(getattr(lib, function), name)


@functools.cache
def _amx_library():
    return load_amx_library(AMX_SOURCE, "bf16-amx", AMX_FLAGS, "bf16 AMX kernel", "decode batches use oneDNN",
                            AMX_HEADERS)


def grid_point(rows: int) -> int:
    """The LARGE_GRID point whose decision `rows` takes: the first >= rows (0 beyond the grid: oneDNN)."""
    return next((point for point in LARGE_GRID if point >= rows), 0)


@functools.cache
def load_gemv_kernel() -> Bf16Gemv | None:
    """The kernel, or None (logged once) where the CPU or the kernel level lacks AVX512-BF16 or no compiler."""
    if not is_x86() or rs_platform.kernel_isa() != "avx512_bf16":
        return None
    lib = load_library(SOURCE, "bf16-gemv", FLAGS, "bf16 GEMV kernel", "linear layers use oneDNN alone")
    return None if lib is None else Bf16Gemv(lib.bf16_gemv, "bf16_gemv")


def has_large_product(in_features: int) -> bool:
    """Whether a GEMV-method layer of this width gets the large AMX product (timed against oneDNN above
    decode sizes): AMX-BF16 here and in_features a multiple of 32."""
    return in_features % 32 == 0 and load_amx_kernel() is not None and load_amx_large_kernel() is not None


class GemvLinearMethod(OneDNNLinearMethod):
    """Our AMX kernel up to AMX_MAX_ROWS rows (the GEMV up to GEMV_MAX_ROWS without AMX); above, oneDNN's
    prepacked product, or our large AMX product at the row counts where it measured faster here
    (`large_rows`, LARGE_GRID points planned by linear_tuning.plan_large_rows)."""

    name = "onednn_gemv"

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype) -> bool:
        return (dtype == torch.bfloat16 and super().supports(device, dtype)
                and load_gemv_kernel() is not None)

    def __init__(self) -> None:
        super().__init__()
        self.gemv_weight: torch.Tensor | None = None  # the tile-interleaved copy our kernels read

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        super().process_weights_after_loading(layer)
        self.gemv_weight = pack_gemv_weight(layer.weight.detach())
        self.kernel = load_gemv_kernel()
        amx = load_amx_kernel() if layer.in_features % 32 == 0 else None
        self.amx, self.amx_max_rows = amx, AMX_MAX_ROWS if amx is not None else 0
        self.large = load_amx_large_kernel() if amx is not None else None
        self.large_rows: frozenset[int] = frozenset()

    def decode_kernel(self, rows: int) -> Bf16Gemv | None:
        """The kernel for a decode batch of `rows` rows (the C decode step asks too), None above them."""
        if 0 < rows <= self.amx_max_rows:
            return self.amx
        return self.kernel if 0 < rows <= GEMV_MAX_ROWS else None

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0] if x.dim() == 2 and x.is_contiguous() else 0
        kernel = self.decode_kernel(rows)
        if kernel is not None:
            return kernel(self.gemv_weight, x, layer.bias, layer.out_features)
        if rows and self.large_rows and grid_point(rows) in self.large_rows:
            return self.large(self.gemv_weight, x, layer.bias, layer.out_features)
        return super().apply(layer, x)

    def own_forms(self) -> dict[int, int]:
        gemv = self.gemv_weight
        return {**super().own_forms(), **({} if gemv is None else {id(gemv): gemv.numel() * gemv.element_size()})}


register_linear_method(GemvLinearMethod)
