"""The C kernels of the packed formats (csrc/quant_matmul.c), one library per ISA level.

Levels, best first: `avx512_vnni` (vpdpbusd on 512 bits), `avx_vnni` (vpdpbusd on 256 bits),
`avx2` (maddubs/madd), `portable` (plain C; what any other CPU gets). Each level is compiled with
its own target flags (not -march=native), so a machine can build and test the lower levels too; the
library lands in $RADIXSERVE_CACHE_DIR/kernels keyed by the source, the level and the compiler, and
is called through ctypes (which releases the GIL) on torch's OpenMP pool.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from radixserve.kernels.build import CSRC, call_profiled, is_x86, load_library
from radixserve.platform import QUANT_ISA_FLAGS, QUANT_ISA_REQUIRES, QUANT_ISAS

SOURCE = CSRC / "quant_matmul.c"
HEADERS = (CSRC / "quant_activations.h",)
# NOTE: the levels, their flags and the features they need are platform.py's (QUANT_ISA_*)


def cpu_flags() -> frozenset[str]:
    """The CPU's ISA features as radixserve decides by them (Linux's flag names; a forced RADIXSERVE_CPU_ISA
    hides those above its level, so the packed kernels run as on such a CPU too)."""
    from radixserve import platform as rs_platform

    return rs_platform.visible_features()


def best_quant_isa(flags: frozenset[str] | None = None) -> str:
    """The best level this CPU runs (x86 levels only on x86)."""
    flags = cpu_flags() if flags is None else flags
    if not is_x86():
        return "portable"
    return next(isa for isa in QUANT_ISAS if QUANT_ISA_REQUIRES[isa] <= flags)


def runnable_isas() -> list[str]:
    """Every level this CPU can run, best first (tests cover each). NOTE: not every level below the best: an AMD
    Zen 4 has AVX512-VNNI but not AVX-VNNI (the VEX form), so `avx_vnni` is not among its levels."""
    flags = cpu_flags()
    if not is_x86():
        return ["portable"]
    return [isa for isa in QUANT_ISAS if QUANT_ISA_REQUIRES[isa] <= flags]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class QuantKernel:
    """`matmul` (small M: int8-quantized activations, integer dot products) and `dequant` of packed rows."""

    def __init__(self, lib: ctypes.CDLL, isa: str) -> None:
        self.isa = isa
        lib.quant_isa.restype = ctypes.c_char_p
        self.compiled_isa = lib.quant_isa().decode()
        ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._matmul = lib.quant_matmul
        self._matmul.restype = i32
        self._matmul.argtypes = [i32, ptr, ptr, ptr, i64, ptr, i32, ptr, i32, i64, i64, i64, i32]
        self._dequant = lib.dequant_rows
        self._dequant.restype = i32
        self._dequant.argtypes = [i32, ptr, ptr, ptr, i64, i64, i64, i64, ptr, i32, i32]

    def matmul(self, packed, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """x [M, K] float32/bfloat16, contiguous -> [M, N] in out_dtype (float32 or bfloat16)."""
        m, (n, k) = x.shape[0], packed.shape
        y = torch.empty(m, n, dtype=out_dtype)
        status = self._matmul(packed.bits, packed.qweight.data_ptr(), packed.scales.data_ptr(), _ptr(packed.mins),
                              packed.scales.shape[1], x.data_ptr(), int(x.dtype == torch.bfloat16), y.data_ptr(),
                              int(out_dtype == torch.bfloat16), m, n, k, torch.get_num_threads())
        _check(status, packed)
        return y

    def bind(self, packed) -> BoundMatmul:
        """`matmul` with the weight's arguments converted once (decode calls it per layer per step)."""
        return BoundMatmul(self, packed)

    def dequant(self, packed, start: int, stop: int, out: torch.Tensor) -> torch.Tensor:
        """Rows [start, stop) of the weight into out [stop - start, K] (float32 or bfloat16, contiguous)."""
        status = self._dequant(packed.bits, packed.qweight.data_ptr(), packed.scales.data_ptr(), _ptr(packed.mins),
                               packed.scales.shape[1], start, stop, packed.shape[1], out.data_ptr(),
                               int(out.dtype == torch.bfloat16), torch.get_num_threads())
        _check(status, packed)
        return out


class BoundMatmul:
    """kernel.matmul(packed, x, dtype) for one packed weight, as `bound(x, dtype)`."""

    def __init__(self, kernel: QuantKernel, packed) -> None:
        self.packed, self._fn = packed, kernel._matmul
        self.n, self.k = packed.shape
        # NOTE: holds raw pointers; valid while `packed` keeps these tensors (the owner rebinds on a new weight)
        self._weight_args = (packed.bits, packed.qweight.data_ptr(), packed.scales.data_ptr(), _ptr(packed.mins),
                             packed.scales.shape[1])

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        m = x.shape[0]
        y = torch.empty(m, self.n, dtype=out_dtype)
        status = call_profiled("radixserve::linear::quant_matmul", self._fn, *self._weight_args, x.data_ptr(),
                               x.dtype == torch.bfloat16, y.data_ptr(), out_dtype == torch.bfloat16, m, self.n, self.k,
                               torch.get_num_threads())
        _check(status, self.packed)
        return y


def _check(status: int, packed) -> None:
    if status != 0:
        raise ValueError(f"quantized kernel rejected a {packed.bits}-bit weight of shape {packed.shape} "
                         f"with {packed.scales.shape[1]} scale groups per row (status {status})")


def load_quant_kernel(isa: str | None = None) -> QuantKernel | None:
    """The kernel library of `isa` (default: the best here, read at each call), or None (logged once) without a
    C compiler."""
    return _built_quant_kernel(best_quant_isa() if isa is None else isa)


@functools.cache
def _built_quant_kernel(isa: str) -> QuantKernel | None:
    if isa not in QUANT_ISAS:
        raise ValueError(f"unknown quantized-kernel level {isa!r}; known: {', '.join(QUANT_ISAS)}")
    lib = load_library(SOURCE, f"quant-{isa}", QUANT_ISA_FLAGS[isa] if is_x86() else (),
                       f"quantized matmul kernel ({isa})", "packed layers use torch", HEADERS)
    return None if lib is None else QuantKernel(lib, isa)
