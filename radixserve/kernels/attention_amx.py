"""Causal extend (prefill) attention in bfloat16 on AMX tiles (csrc/extend_amx.c), for CPUs with AMX-BF16.

On such a CPU torch's SDPA (its flash kernel) was the fastest extend path we had; this kernel computes
the products on the tiles and the softmax in AVX-512, and measured 1.4-2.4x faster than SDPA at 32-2,048
tokens (benchmarks/bench_prefill_attention.py). It reads K/V in place from the pool like the C extend
kernel (same `reqs` rows), without seeds or log-sum-exps. The same blocks run unmasked, with log-sum-exps,
as cascade's part (a) (`shared_prefix`: every query of the batch over the prefix it shares), in the Python
layers and in the C decoder alike. `RADIXSERVE_CPU_PREFILL_KERNEL=0` turns it off with the other extend
kernel.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from radixserve import platform as rs_platform
from radixserve.kernels.build import CSRC, call_profiled, is_x86, load_amx_library
from radixserve.platform import AMX_FLAGS

SOURCE = CSRC / "extend_amx.c"
HEADERS = tuple(CSRC / name for name in ("simd.h", "attention_common.h", "amx_tiles.h"))
FLAGS = AMX_FLAGS
MAX_DIM = 256


class AmxExtendKernel:
    """`extend` with the C extend kernel's arguments, bf16 only, at any length; `shared_prefix` with the C
    prefix kernel's (cascade's part (a)), without window bounds."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.extend_attention_amx_bf16
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 4 + [ctypes.c_float, ctypes.c_int]
        self._prefix_fn = lib.prefix_attention_amx_bf16
        self._prefix_fn.restype = ctypes.c_int
        self._prefix_fn.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 5 + [ctypes.c_float, ctypes.c_int]

    def prefix_supports(self, q: torch.Tensor, num_kv_heads: int, kv_dtype: torch.dtype | None = None) -> bool:
        """Whether `shared_prefix` takes `q` over a `kv_dtype` cache (bf16 both, dim a multiple of 32)."""
        heads, dim = q.shape[1], q.shape[2]
        return (q.device.type == "cpu" and q.dtype == torch.bfloat16 and (kv_dtype or q.dtype) == torch.bfloat16
                and dim % 32 == 0 and dim <= MAX_DIM and heads % num_kv_heads == 0)

    def prefix_address(self, dtype: torch.dtype, kv_dtype: torch.dtype) -> int | None:
        """The C function of `shared_prefix` for a `dtype` q over a `kv_dtype` cache (the C decoder calls it
        for cascade batches), or None."""
        if (dtype, kv_dtype) != (torch.bfloat16, torch.bfloat16):
            return None
        return ctypes.cast(self._prefix_fn, ctypes.c_void_p).value

    def shared_prefix(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, slots: torch.Tensor,
                      scale: float, first: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Every query token [n, heads, dim] over the same slots (int32 [prefix_len] >= 1) -> the output [n, heads,
        dim] and the log-sum-exp, float32 [n, heads] (as `DecodeKernel.shared_prefix`, without `first`)."""
        if first is not None:
            raise ValueError("the AMX prefix kernel takes no window bounds (first)")
        if not self.prefix_supports(q, k_buf.shape[1], k_buf.dtype) or v_buf.dtype != k_buf.dtype:
            raise ValueError(f"the AMX prefix kernel takes bf16 q and K/V with dim a multiple of 32, not q {q.dtype} "
                             f"{tuple(q.shape)} over K/V {k_buf.dtype}")
        if not (k_buf.is_contiguous() and v_buf.is_contiguous()):
            raise ValueError("the AMX prefix kernel needs contiguous K/V buffers")
        q, slots = q.contiguous(), slots.to(torch.int32).contiguous()
        out, lse = torch.empty_like(q), torch.empty(q.shape[:2], dtype=torch.float32)
        status = call_profiled(
            "radixserve::prefix_attention_amx", self._prefix_fn, q.data_ptr(), k_buf.data_ptr(), v_buf.data_ptr(),
            slots.data_ptr(), None, out.data_ptr(), lse.data_ptr(), q.shape[0], slots.shape[0], q.shape[1],
            k_buf.shape[1], q.shape[2], scale, torch.get_num_threads())
        if status != 0:
            raise ValueError(f"the AMX prefix kernel rejected q {tuple(q.shape)} over {slots.shape[0]} slots of K/V "
                             f"{tuple(k_buf.shape)} (status {status})")
        return out, lse

    def extend_supports(self, q: torch.Tensor, k_buf: torch.Tensor) -> bool:
        heads, dim = q.shape[1], q.shape[2]
        return (q.device.type == "cpu" and q.dtype == torch.bfloat16 and k_buf.dtype == torch.bfloat16
                and dim % 32 == 0 and dim <= MAX_DIM and heads % k_buf.shape[1] == 0)

    def extend(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, kv_indices: torch.Tensor,
               reqs: torch.Tensor, scale: float, seed: tuple[torch.Tensor, torch.Tensor] | None = None,
               with_lse: bool = False) -> tuple[torch.Tensor, None]:
        """q [tokens, heads, dim]; kv_indices int32 context slots; reqs int64 [bs, 4] (q_start, q_len,
        kv_start, kv_len) -> (out [tokens, heads, dim], None)."""
        if seed is not None or with_lse:
            raise ValueError("the AMX extend kernel takes no seed and returns no log-sum-exp")
        if not (k_buf.is_contiguous() and v_buf.is_contiguous()):
            raise ValueError("the AMX extend kernel needs contiguous K/V buffers")
        q, kv_indices, reqs = q.contiguous(), kv_indices.to(torch.int32).contiguous(), reqs.contiguous()
        out = torch.empty_like(q)
        status = call_profiled(
            "radixserve::extend_attention_amx", self._fn, q.data_ptr(), k_buf.data_ptr(), v_buf.data_ptr(),
            kv_indices.data_ptr(), reqs.data_ptr(), out.data_ptr(), reqs.shape[0], q.shape[1], k_buf.shape[1],
            q.shape[2], scale, torch.get_num_threads())
        if status != 0:
            raise ValueError(f"the AMX extend kernel rejected q {tuple(q.shape)} over K/V {tuple(k_buf.shape)} "
                             f"(status {status})")
        return out, None


def load_amx_extend_kernel() -> AmxExtendKernel | None:
    """The kernel where AMX-BF16 is visible (platform.kernel_class() == "amx", read at each call, so a
    forced lower RADIXSERVE_CPU_ISA hides it), it builds, and the OS grants this process AMX state; else None."""
    if not is_x86() or rs_platform.kernel_class() != "amx":
        return None
    return _built_kernel()


@functools.cache
def _built_kernel() -> AmxExtendKernel | None:
    lib = load_amx_library(SOURCE, "extend-amx", FLAGS, "AMX extend attention", "prefill attention uses SDPA",
                           HEADERS)
    return None if lib is None else AmxExtendKernel(lib)
