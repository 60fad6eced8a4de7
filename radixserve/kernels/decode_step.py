"""ctypes binding of the one-call decode step (csrc/decode_step.c): the model struct it reads and the library's
functions. The C decoder built on it is models/decode_step.py."""

from __future__ import annotations

import ctypes
import functools

import torch

from radixserve.kernels.build import CSRC, call_profiled, load_library
from radixserve.kernels.gemv import FLAGS

SOURCE = CSRC / "decode_step.c"
HEADERS = tuple(CSRC / name for name in ("simd.h", "attention_common.h"))  # simd.h includes attention_common.h
LAYER_POINTERS = 9  # IN_NORM, POST_NORM, QKV, QKV_BIAS, O, GATE_UP, DOWN, K_CACHE, V_CACHE


class ModelStruct(ctypes.Structure):
    _fields_ = [*((name, ctypes.c_int64) for name in ("num_layers", "hidden", "heads", "kv_heads", "head_dim",
                                                      "intermediate", "max_position", "num_slots")),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float),
                *((name, ctypes.c_void_p) for name in ("layers", "cos_table", "sin_table"))]


class DecodeStepKernel:
    """The library's three functions: the size of the work buffer, a decode step over every layer, and the
    step's SiLU-and-mul loop (also used for prefill chunks)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib

    def work_size(self, model: ModelStruct, rows: int) -> int:
        return self._lib.decode_step_work_size(ctypes.byref(model), rows)

    def run(self, model: ModelStruct, linear: int, attention: int, hidden: torch.Tensor, residual: torch.Tensor,
            positions: torch.Tensor, slots: torch.Tensor, kv_indices: torch.Tensor, seq_lens: torch.Tensor,
            max_len: int, work: torch.Tensor) -> int:
        """Every decoder layer for hidden's rows, in place; `linear` and `attention` are the C functions to call.
        Returns the status: 0 done, 1 a position or slot out of range (nothing written), else layer*1000+call."""
        return call_profiled(
            "radixserve::decode_step", self._lib.decode_step_bf16, ctypes.byref(model), linear, attention,
            hidden.data_ptr(), residual.data_ptr(), positions.data_ptr(), slots.data_ptr(), kv_indices.data_ptr(),
            seq_lens.data_ptr(), hidden.shape[0], max_len, work.data_ptr(), torch.get_num_threads())

    def silu_mul(self, gate_up: torch.Tensor, out: torch.Tensor) -> int:
        rows, width = gate_up.shape
        return call_profiled("radixserve::fused::silu_and_mul_c", self._lib.silu_mul_bf16, gate_up.data_ptr(),
                             out.data_ptr(), rows, width // 2, torch.get_num_threads())


def load_decode_step_kernel() -> DecodeStepKernel | None:
    lib = _library()
    return None if lib is None else DecodeStepKernel(lib)


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = load_library(SOURCE, "decode-step", FLAGS, "decode step kernel", "decode runs the layers in Python",
                       HEADERS)
    if lib is None:
        return None
    lib.decode_step_bf16.restype = ctypes.c_int
    lib.decode_step_bf16.argtypes = [ctypes.c_void_p] * 9 + [ctypes.c_int64] * 2 + [ctypes.c_void_p, ctypes.c_int]
    lib.decode_step_work_size.restype = ctypes.c_int64
    lib.decode_step_work_size.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.silu_mul_bf16.restype = ctypes.c_int
    lib.silu_mul_bf16.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_int]
    return lib
