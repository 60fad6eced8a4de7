"""The decode linear method on CPUs with AVX512-BF16: our GEMV kernel for a few rows, oneDNN above.

At a few rows a linear layer's cost is reading its weight once. oneDNN's bf16 product reads it at
about half the memory bandwidth at those sizes; csrc/bf16_gemv.c reads a tile-interleaved copy of the
weight as one sequential stream with software prefetch (measured ~2x faster per call on the model's
shapes, weights from memory). Larger batches and prefill keep oneDNN's prepacked weight, so the layer
keeps two copies of its weight: `--linear-method onednn` keeps one.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from radixserve import platform as rs_platform
from radixserve.layers.linear import LinearBase, OneDNNLinearMethod, register_linear_method
from radixserve.layers.native_build import call_profiled, is_x86, load_library

SOURCE = Path(__file__).parent / "csrc" / "bf16_gemv.c"
FLAGS = ("-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16")
TILE = 64  # output rows per tile of the packed layout (csrc/bf16_gemv.c)
# Rows up to which the kernel beats oneDNN at every shape of the default model (at 8 rows it ties at the
# narrow shapes and loses at the wide ones; benchmarks/bench_decode_linear.py).
GEMV_MAX_ROWS = 4


class Bf16Gemv:
    """ctypes binding of `bf16_gemv` (ctypes releases the GIL; the kernel runs on torch's OpenMP pool)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.bf16_gemv
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]

    def __call__(self, packed: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
        """x [M, K] bfloat16 contiguous, packed from `pack_gemv_weight` -> y [M, N] bfloat16."""
        m, k = x.shape
        y = torch.empty(m, n, dtype=torch.bfloat16)
        args = (packed.data_ptr(), x.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(), m, n, k,
                torch.get_num_threads())
        status = call_profiled("radixserve::linear::bf16_gemv", self._fn, *args)
        if status != 0:
            raise ValueError(f"bf16 GEMV rejected x {tuple(x.shape)} for a weight with {n} rows (status {status})")
        return y


def pack_gemv_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] bfloat16 -> [ceil(N / TILE), K / 2, TILE, 2]: the kernel's tile-interleaved layout."""
    n, k = weight.shape
    if k % 2:
        raise ValueError(f"the GEMV layout needs an even number of input features, got {k}")
    padded = weight.new_zeros(-(-n // TILE) * TILE, k)
    padded[:n] = weight
    return padded.view(-1, TILE, k // 2, 2).permute(0, 2, 1, 3).contiguous()


@functools.cache
def load_gemv_kernel() -> Bf16Gemv | None:
    """The kernel, or None (logged once) where the CPU or the kernel level lacks AVX512-BF16 or no compiler."""
    if not is_x86() or rs_platform.kernel_isa() != "avx512_bf16":
        return None
    lib = load_library(SOURCE, "bf16-gemv", FLAGS, "bf16 GEMV kernel", "linear layers use oneDNN alone")
    return None if lib is None else Bf16Gemv(lib)


class GemvLinearMethod(OneDNNLinearMethod):
    """Our bf16 GEMV kernel up to GEMV_MAX_ROWS rows, oneDNN's prepacked product above."""

    name = "onednn_gemv"

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype) -> bool:
        return (dtype == torch.bfloat16 and super().supports(device, dtype)
                and load_gemv_kernel() is not None)

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        super().process_weights_after_loading(layer)
        layer.gemv_weight = pack_gemv_weight(layer.dense_weight())
        self.kernel = load_gemv_kernel()

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= GEMV_MAX_ROWS and x.is_contiguous():
            return self.kernel(layer.gemv_weight, x, layer.bias, layer.out_features)
        return super().apply(layer, x)


register_linear_method(GemvLinearMethod)
