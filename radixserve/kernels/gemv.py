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
AMX_HEADERS = (CSRC / "amx_tiles.h", CSRC / "gemv_one_row.h")
HEADERS = (CSRC / "gemv_one_row.h",)


class LinearKernel:
    """ctypes binding of a C product with the linear signature (weight, x, bias, y, m, n, k, threads), the one
    the C decoder calls through its layer table. ctypes releases the GIL; the kernel runs on torch's OpenMP
    pool."""

    def __init__(self, fn: ctypes._CFuncPtr, name: str) -> None:
        self._fn, self.name = fn, name
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
        self.profile_name = f"radixserve::linear::{name}"

    @property
    def address(self) -> int:
        """The C function's address (for C code that calls the kernel itself: models/c_decoder.py)."""
        return ctypes.cast(self._fn, ctypes.c_void_p).value

    def _product(self, weight: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, n: int,
                 dtype: torch.dtype) -> torch.Tensor:
        """y [M, n] of `dtype` for x [M, K] contiguous, `weight` in the kernel's own form."""
        m, k = x.shape
        y = torch.empty(m, n, dtype=dtype)
        status = call_profiled(self.profile_name, self._fn, weight.data_ptr(), x.data_ptr(),
                               None if bias is None else bias.data_ptr(), y.data_ptr(), m, n, k,
                               torch.get_num_threads())
        if status != 0:
            raise ValueError(f"{self.name} rejected x {tuple(x.shape)} for a weight with {n} rows (status {status})")
        return y


class Bf16Gemv(LinearKernel):
    """A kernel over the packed layout: `bf16_gemv`, or `bf16_amx_gemm` (same arguments)."""

    def __call__(self, packed: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
        """x [M, K] bfloat16 contiguous, packed from `pack_gemv_weight` -> y [M, N] bfloat16."""
        return self._product(packed, x, bias, n, torch.bfloat16)


def pack_gemv_weight(weight: torch.Tensor, tile: int = TILE) -> torch.Tensor:
    """[N, K] bfloat16 -> [ceil(N / tile), K / 2, tile, 2]: the kernels' tile-interleaved layout."""
    n, k = weight.shape
    if k % 2:
        raise ValueError(f"the GEMV layout needs an even number of input features, got {k}")
    if n % tile:
        padded = weight.new_zeros(-(-n // tile) * tile, k)
        padded[:n] = weight
        weight = padded
    # NOTE: each bf16 pair moved as one int32: a 3-d transpose copy, ~3x faster than the 4-d permute of 2-byte
    # elements (the packing is a visible part of a large model's start)
    pair = {2: torch.int32, 4: torch.int64}[weight.element_size()]
    pairs = weight.contiguous().view(pair).view(-1, tile, k // 2)
    return pairs.transpose(1, 2).contiguous().view(weight.dtype).view(-1, k // 2, tile, 2)


def unpack_gemv_weight(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of pack_gemv_weight: [N, K] in the packed dtype."""
    tiles, pairs, tile, _ = packed.shape
    return packed.permute(0, 2, 1, 3).reshape(tiles * tile, pairs * 2)[:n]


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
    lib = load_library(SOURCE, "bf16-gemv", FLAGS, "bf16 GEMV kernel", "linear layers use oneDNN alone", HEADERS)
    return None if lib is None else Bf16Gemv(lib.bf16_gemv, "bf16_gemv")


BF16W_SOURCE = CSRC / "bf16w_gemv.c"
BF16W_TILE = 16  # output rows per tile of its layout (csrc/bf16w_gemv.c)


class Bf16WeightGemv(LinearKernel):
    """ctypes binding of `bf16w_gemv` (csrc/bf16w_gemv.c): bf16 weights, float32 x, bias and y; built at the
    kernel level this process runs (`level`), prefetching into `prefetch`."""

    def __init__(self, lib: ctypes.CDLL, level: str, prefetch: str) -> None:
        super().__init__(lib.bf16w_gemv, "bf16w_gemv")
        self._unpack, self._unpack_blocked, self.level = lib.bf16w_unpack, lib.bf16w_unpack_blocked, level
        self.prefetch = prefetch  # "l1" | "l2" | "none": where it prefetches the weights (platform.weight_prefetch)
        for fn in (self._unpack, self._unpack_blocked):
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_int]

    def __call__(self, packed: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
        """x [M, K] float32 contiguous, packed from `pack_gemv_weight(w, BF16W_TILE)` -> y [M, N] float32."""
        return self._product(packed, x, bias, n, torch.float32)

    def widen(self, packed: torch.Tensor, n: int, out: torch.Tensor) -> torch.Tensor:
        """The packed weight's first n rows as float32 [n, K], written into `out` (at least n * K floats)."""
        k = packed.shape[1] * 2
        out = out[: n * k].view(n, k)
        status = call_profiled("radixserve::linear::bf16w_unpack", self._unpack, packed.data_ptr(), out.data_ptr(),
                               n, k, torch.get_num_threads())
        if status != 0:
            raise ValueError(f"bf16w_unpack rejected a weight of {n} rows (status {status})")
        return out

    def widen_blocked(self, packed: torch.Tensor, n: int, address: int) -> None:
        """The packed weight's first n rows as float32 in oneDNN's blocked order [ceil(n / 64)][K][64], padding rows
        zero, written at `address` (ceil(n / 64) * 64 * K floats)."""
        status = call_profiled("radixserve::linear::bf16w_unpack", self._unpack_blocked, packed.data_ptr(), address,
                               n, packed.shape[1] * 2, torch.get_num_threads())
        if status != 0:
            raise ValueError(f"bf16w_unpack_blocked rejected a weight of {n} rows (status {status})")


def load_bf16w_kernel() -> Bf16WeightGemv | None:
    """The bf16-weight product at this process's kernel level (read at each call, so a forced lower
    RADIXSERVE_CPU_ISA gets its own build), or None without a compiler."""
    level = rs_platform.kernel_isa() if is_x86() else "portable"
    # NOTE: the portable build (plain C) has no prefetch to place
    return _built_bf16w(level, "none" if level == "portable" else rs_platform.weight_prefetch())


@functools.cache
def _built_bf16w(level: str, prefetch: str) -> Bf16WeightGemv | None:
    l2 = prefetch == "l2"
    lib = load_library(BF16W_SOURCE, f"bf16w-gemv-{level}" + ("-l2" if l2 else ""),
                       [*rs_platform.ISA_FLAGS[level], *(["-DPREFETCH_L2"] if l2 else [])], "bf16-weight kernel",
                       "bf16 weights are widened to float32 for every product")
    return None if lib is None else Bf16WeightGemv(lib, level, prefetch)


F32_SOURCE = CSRC / "f32_gemv.c"
F32_HEADERS = (CSRC / "simd.h", CSRC / "attention_common.h")


class F32Gemv(LinearKernel):
    """ctypes binding of `f32_gemv` (csrc/f32_gemv.c): float32 weights in their own [N, K] layout, float32 x, bias
    and y; built at the kernel level this process runs (`level`)."""

    def __init__(self, lib: ctypes.CDLL, level: str) -> None:
        super().__init__(lib.f32_gemv, "f32_gemv")
        self.level = level

    def __call__(self, weight: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [M, K] float32 contiguous, weight [N, K] float32 contiguous -> y [M, N] float32."""
        return self._product(weight, x, bias, weight.shape[0], torch.float32)


def load_f32_kernel() -> F32Gemv | None:
    """The float32 product at this process's kernel level (read at each call, so a forced lower RADIXSERVE_CPU_ISA
    gets its own build), or None without a compiler."""
    return _built_f32(rs_platform.kernel_isa() if is_x86() else "portable")


@functools.cache
def _built_f32(level: str) -> F32Gemv | None:
    lib = load_library(F32_SOURCE, f"f32-gemv-{level}", rs_platform.ISA_FLAGS[level], "float32 GEMV kernel",
                       "float32 layers use F.linear alone", F32_HEADERS)
    return None if lib is None else F32Gemv(lib, level)


def onednn_view(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A flat tensor of `dtype` over a oneDNN (mkldnn) tensor's whole buffer, padding included.

    NOTE: the view does not own the memory: the oneDNN tensor must outlive it."""
    nbytes = torch.ops.mkldnn._nbytes(packed)
    buffer = (ctypes.c_char * nbytes).from_address(torch.ops.mkldnn.data_ptr(packed))
    return torch.frombuffer(buffer, dtype=dtype)


def onednn_alias(packed: torch.Tensor | None, gemv: torch.Tensor) -> torch.Tensor:
    """A tensor of `gemv`'s shape over oneDNN's packed buffer when its bytes equal `gemv`'s, else `gemv` itself.

    NOTE: the alias does not own the memory: the oneDNN tensor must outlive it (both stay on the one method)."""
    if packed is None or not packed.is_mkldnn:
        return gemv
    if torch.ops.mkldnn._nbytes(packed) != gemv.numel() * gemv.element_size():
        return gemv
    alias = onednn_view(packed, gemv.dtype).view(gemv.shape)
    return alias if torch.equal(alias, gemv) else gemv
