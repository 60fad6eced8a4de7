"""ctypes bindings of the tiled packed-weight kernels (csrc/quant_tiled.c: AVX-512 VNNI, AVX-VNNI, AVX2): product,
transposed expansion and row lookup over a `TiledWeight` (layers/quantization/tiled.py, the layout)."""

from __future__ import annotations

import ctypes
import functools
from typing import TYPE_CHECKING

import torch

from radixserve.kernels.build import CSRC, call_profiled, load_library
from radixserve.platform import QUANT_ISA_FLAGS

if TYPE_CHECKING:
    from radixserve.layers.quantization.tiled import TiledWeight

SOURCE = CSRC / "quant_tiled.c"
HEADERS = (CSRC / "quant_tiled_avx2.h", CSRC / "quant_activations.h")
LEVELS = ("avx512_vnni", "avx_vnni", "avx2")  # the packed-kernel levels with a tiled build (platform.QUANT_ISAS)


class TiledKernel:
    """ctypes bindings of csrc/quant_tiled.c (ctypes releases the GIL; the kernels run on torch's OpenMP pool)."""

    def __init__(self, lib: ctypes.CDLL, level: str) -> None:
        self.level = level
        ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._matmul, self._expand, self._rows = lib.tiled_matmul, lib.tiled_expand_t, lib.tiled_rows
        self._matmul.argtypes = [i32, ptr, ptr, i32, ptr, i32, i64, i64, i64, i32]
        self._expand.argtypes = [i32, ptr, i64, i64, i64, ptr, i32, i32]
        self._rows.argtypes = [i32, ptr, ptr, i64, i64, i64, ptr, i32, i32]
        for fn in (self._matmul, self._expand, self._rows):
            fn.restype = i32
        # NOTE: the decode step's linear signature over a descriptor {bits, data address} (c_descriptor)
        self._linear = {torch.float32: lib.tiled_linear_f32, torch.bfloat16: lib.tiled_linear_bf16}

    def linear_address(self, dtype: torch.dtype) -> int | None:
        """The C function of the product in `dtype` with the decode step's linear signature (for C code that
        calls it itself: models/c_decoder.py), or None for another dtype."""
        fn = self._linear.get(dtype)
        return None if fn is None else ctypes.cast(fn, ctypes.c_void_p).value

    @staticmethod
    def c_descriptor(w: TiledWeight) -> torch.Tensor:
        """{bits, data address} as int64: the `weights` argument `linear_address`'s function reads (valid while
        `w.data` lives)."""
        return torch.tensor([w.bits, w.data.data_ptr()], dtype=torch.int64)

    def matmul(self, w: TiledWeight, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """x [M, K] float32/bfloat16 contiguous -> [M, N] (activations rounded to int8 per block of 32)."""
        m, (n, k) = x.shape[0], w.shape
        y = torch.empty(m, n, dtype=out_dtype)
        args = (w.bits, w.data.data_ptr(), x.data_ptr(), x.dtype == torch.bfloat16, y.data_ptr(),
                out_dtype == torch.bfloat16, m, n, k, torch.get_num_threads())
        _check(call_profiled("radixserve::linear::tiled_matmul", self._matmul, *args), w)
        return y

    def expand_t(self, w: TiledWeight, start: int, stop: int, dtype: torch.dtype,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows [start, stop) of the weight, transposed: [K, stop - start] (start a multiple of 64)."""
        k = w.shape[1]
        out = torch.empty(k, stop - start, dtype=dtype) if out is None else out
        _check(self._expand(w.bits, w.data.data_ptr(), start, stop, k, out.data_ptr(), dtype == torch.bfloat16,
                            torch.get_num_threads()), w)
        return out

    def rows(self, w: TiledWeight, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        ids = rows.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty(ids.numel(), w.shape[1], dtype=dtype)
        status = self._rows(w.bits, w.data.data_ptr(), ids.data_ptr(), ids.numel(), w.shape[0], w.shape[1],
                            out.data_ptr(), dtype == torch.bfloat16, torch.get_num_threads())
        if status == -2:
            raise IndexError(f"row id out of range for a weight of {w.shape[0]} rows")
        _check(status, w)
        return out


def _check(status: int, w: TiledWeight) -> None:
    if status != 0:
        raise ValueError(f"tiled kernel rejected a {w.format_name} weight of shape {w.shape} (status {status})")


def load_tiled_kernel() -> TiledKernel | None:
    """The kernels at the packed-kernel level this process runs (read at each call, so a forced lower
    RADIXSERVE_CPU_ISA gets its own build), or None below AVX2 or without a compiler."""
    from radixserve.kernels.quant import best_quant_isa

    level = best_quant_isa()
    return _built(level) if level in LEVELS else None


@functools.cache
def _built(level: str) -> TiledKernel | None:
    lib = load_library(SOURCE, f"quant-tiled-{level}", QUANT_ISA_FLAGS[level], "tiled quantized kernels",
                       "packed layers keep the row layout", HEADERS)
    if lib is None:
        return None
    lib.tiled_isa.restype = ctypes.c_char_p
    compiled = lib.tiled_isa().decode()
    if compiled != level:
        raise RuntimeError(f"the tiled kernels built for {level} report {compiled} (compiler flags)")
    return TiledKernel(lib, level)
