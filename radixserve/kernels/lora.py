"""ctypes binding of the segment-grouped LoRA shrink/expand kernel (csrc/lora_sgmv.c), the CPU form of the
LoRA products of a mixed batch (lora/layers.py uses it on the CPU when it loads; torch matmuls otherwise). The
one-call C decoder calls the same function from C (`LoraKernel.address`, csrc/decode_lora.h)."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence

import torch

from radixserve import platform as rs_platform
from radixserve.kernels.build import CSRC, call_profiled, is_x86, load_library

SOURCE = CSRC / "lora_sgmv.c"
HEADERS = (CSRC / "simd.h", CSRC / "attention_common.h")
DTYPES = (torch.float32, torch.bfloat16)


class LoraKernel:
    """`lora_sgmv` built at one kernel level (`level`). ctypes releases the GIL; the kernel runs on OpenMP
    threads (torch's count)."""

    def __init__(self, lib: ctypes.CDLL, level: str) -> None:
        self._fn, self.level = lib.lora_sgmv, level
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
                             ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                             ctypes.c_void_p, ctypes.c_int]

    @property
    def address(self) -> int:
        """The C function's address, for callers in C (the decode step's LoRA rows, csrc/decode_lora.h)."""
        return ctypes.cast(self._fn, ctypes.c_void_p).value

    def __call__(self, x: torch.Tensor, y: torch.Tensor, index: torch.Tensor, offsets: torch.Tensor,
                 pairs: Sequence[tuple[torch.Tensor, torch.Tensor] | None]) -> torch.Tensor:
        """y [M, N] += each segment's delta, in place; returns y.

        x [M, K] and y contiguous, both float32 or both bfloat16; index int64: the rows of every segment, segment
        s at positions offsets[s] .. offsets[s + 1] (offsets int64, len(pairs) + 1); pairs[s]: (A [R, K],
        Bt [R, N]) contiguous in x's dtype, the scaling in Bt, or None (the segment's adapter skips this layer).
        """
        m, k = x.shape
        n = y.shape[1]
        if x.dtype not in DTYPES or y.dtype != x.dtype or y.shape[0] != m:
            raise ValueError(f"lora_sgmv takes x and y of one dtype of {DTYPES}, got {x.dtype} {tuple(x.shape)} "
                             f"and {y.dtype} {tuple(y.shape)}")
        if not (x.is_contiguous() and y.is_contiguous() and index.dtype == offsets.dtype == torch.int64):
            raise ValueError("lora_sgmv needs contiguous x and y and int64 index and offsets")
        count = len(pairs)
        a_ptrs, bt_ptrs, ranks = (ctypes.c_void_p * count)(), (ctypes.c_void_p * count)(), (ctypes.c_int64 * count)()
        for s, pair in enumerate(pairs):
            if pair is None:
                continue
            a, bt = pair
            if a.dtype != x.dtype or bt.dtype != x.dtype or a.shape[1] != k or bt.shape != (a.shape[0], n):
                raise ValueError(f"lora_sgmv segment {s}: A {tuple(a.shape)} {a.dtype} and Bt {tuple(bt.shape)} "
                                 f"{bt.dtype} do not fit x {tuple(x.shape)} and y {tuple(y.shape)}")
            a_ptrs[s], bt_ptrs[s], ranks[s] = a.data_ptr(), bt.data_ptr(), a.shape[0]
        status = call_profiled("radixserve::lora::sgmv", self._fn, x.data_ptr(), y.data_ptr(), k, n,
                               int(x.dtype == torch.bfloat16), index.data_ptr(), offsets.data_ptr(), count,
                               a_ptrs, bt_ptrs, ranks, torch.get_num_threads())
        if status != 0:
            raise ValueError(f"lora_sgmv rejected x {tuple(x.shape)}, y {tuple(y.shape)} (status {status})")
        return y


def load_lora_kernel() -> LoraKernel | None:
    """The kernel at this process's kernel level (read at each call, so a forced lower RADIXSERVE_CPU_ISA gets
    its own build), or None without a compiler."""
    return _built(rs_platform.kernel_isa() if is_x86() else "portable")


@functools.cache
def _built(level: str) -> LoraKernel | None:
    lib = load_library(SOURCE, f"lora-sgmv-{level}", rs_platform.ISA_FLAGS[level], "LoRA SGMV kernel",
                       "LoRA products use torch matmuls", HEADERS)
    return None if lib is None else LoraKernel(lib, level)
