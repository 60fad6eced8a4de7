"""ctypes bindings of the bf16 GEMV (csrc/bf16_gemv.c, AVX512-BF16) and AMX (csrc/bf16_amx.c) kernels over a
tile-interleaved copy of the weight (`pack_gemv_weight`). When each runs is the linear method's
(layers/gemv.py)."""

from __future__ import annotations

import ctypes
import functools

import torch

from radixserve import platform as rs_platform
from radixserve.kernels.build import CSRC, call_profiled, is_x86, load_amx_library, load_library
from radixserve.platform import AMX_FLAGS, ISA_FLAGS

SOURCE = CSRC / "bf16_gemv.c"
FLAGS = ISA_FLAGS["avx512_bf16"]
TILE = 64  # output rows per tile of the packed layout (csrc/bf16_gemv.c)
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


@functools.cache
def load_gemv_kernel() -> Bf16Gemv | None:
    """The kernel, or None (logged once) where the CPU or the kernel level lacks AVX512-BF16 or no compiler."""
    if not is_x86() or rs_platform.kernel_isa() != "avx512_bf16":
        return None
    lib = load_library(SOURCE, "bf16-gemv", FLAGS, "bf16 GEMV kernel", "linear layers use oneDNN alone")
    return None if lib is None else Bf16Gemv(lib.bf16_gemv, "bf16_gemv")
