"""The memory read bandwidth of this machine, for a decode step's bandwidth bound (bench_ladder.py).

The best of two readers, each over 1 GiB (far beyond any cache), best of five passes: a C loop built at this
CPU's kernel level (read_bandwidth.c: four sequential streams per thread, as our one-row GEMV kernels read) and
torch.mv over a bf16 matrix (how a framework reads weights).

    python benchmarks/read_bandwidth.py            # GB/s with torch's thread count
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from radixserve.bench.roofline import best_seconds

SOURCE = Path(__file__).resolve().parent / "read_bandwidth.c"
GIB = 2**30




def c_reader_gb_s(data: torch.Tensor, threads: int) -> float | None:
    from radixserve import platform
    from radixserve.kernels.build import BUILD_ERRORS, build_library

    level = platform.kernel_isa()
    try:
        lib = ctypes.CDLL(str(build_library(SOURCE, f"read-bandwidth-streams-{level}", platform.ISA_FLAGS[level])))
    except BUILD_ERRORS:
        return None
    lib.read_sum.restype = ctypes.c_double
    lib.read_sum.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    words = data.numel() * data.element_size() // 8
    return GIB / best_seconds(lambda: lib.read_sum(data.data_ptr(), words, threads)) / 1e9


def torch_reader_gb_s(data: torch.Tensor) -> float:
    matrix = data.view(torch.bfloat16).view(2**16, -1)
    vector = torch.ones(matrix.shape[1], dtype=torch.bfloat16)
    return GIB / best_seconds(lambda: torch.mv(matrix, vector)) / 1e9


def read_bandwidth_gb_s(threads: int) -> dict[str, float]:
    """{"c": GB/s or absent without a compiler, "torch": GB/s, "best": the larger}."""
    torch.set_num_threads(threads)
    data = torch.ones(GIB // 4, dtype=torch.float32)
    figures = {"torch": torch_reader_gb_s(data)}
    c = c_reader_gb_s(data, threads)
    if c is not None:
        figures["c"] = c
    figures["best"] = max(figures.values())
    return figures


if __name__ == "__main__":
    print(read_bandwidth_gb_s(torch.get_num_threads()))
