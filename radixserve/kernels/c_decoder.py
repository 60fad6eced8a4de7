"""ctypes binding of the one-call decode step: the model struct it reads and the library's functions, in two
builds: bf16 (csrc/decode_step.c, AVX512-BF16) and float32 (csrc/decode_step_f32.c, at the AVX2 or AVX-512
kernel level this process runs). Both share the layer loop (csrc/decode_loop.h). The C decoder built on it is
models/c_decoder.py."""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from radixserve import platform as rs_platform
from radixserve.kernels.build import CSRC, call_profiled, is_x86, load_library
from radixserve.kernels.gemv import FLAGS

SOURCE = CSRC / "decode_step.c"
F32_SOURCE = CSRC / "decode_step_f32.c"
# simd.h includes attention_common.h; both builds include the shared layer loop
HEADERS = tuple(CSRC / name for name in ("simd.h", "attention_common.h", "decode_loop.h", "decode_gemma.h",
                                          "decode_lora.h"))
# csrc/decode_loop.h: the norms, each linear layer's weight and function, the qkv bias, K and V, the attention group,
# the rotary tables, and Gemma's four more norms
LAYER_POINTERS = 20
STYLES = {"llama": 0, "gemma": 1}  # decode_model.style: the layer loop that runs
F32_LEVELS = ("avx512_bf16", "avx512", "avx2")  # the kernel levels with a float32 build (vector code)


class ModelStruct(ctypes.Structure):
    _fields_ = [*((name, ctypes.c_int64) for name in ("num_layers", "hidden", "heads", "kv_heads", "head_dim",
                                                      "intermediate", "max_position", "num_groups", "style",
                                                      "kv_bf16")),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("layers", ctypes.c_void_p)]


class AttentionGroup(ctypes.Structure):
    """What the layers of one attention group write and read (csrc/decode_loop.h): every layer of a model without
    windows, or the layers of one sliding window; with cascade, also the shared prefix's slots and part (a)'s
    function."""

    _fields_ = [*((name, ctypes.c_void_p) for name in ("slots", "kv_indices", "seq_lens")),
                ("max_len", ctypes.c_int64), ("num_slots", ctypes.c_int64), ("prefix_slots", ctypes.c_void_p),
                ("prefix_len", ctypes.c_int64), ("prefix", ctypes.c_void_p)]


@dataclass(frozen=True)
class GroupTable:
    """One attention group's tables (see AttentionGroup): where the new K/V go, what each row attends over, and
    for cascade the shared prefix and the address of part (a)'s C function."""

    slots: torch.Tensor
    kv_indices: torch.Tensor
    seq_lens: torch.Tensor
    max_len: int
    num_slots: int
    prefix_slots: torch.Tensor | None = None
    prefix: int = 0


class LoraDescriptor(ctypes.Structure):
    """A step's LoRA rows (csrc/decode_lora.h): the SGMV function, the segments' row index and offsets, and the
    table of packed A / Bt addresses and ranks per (layer, linear layer, segment)."""

    _fields_ = [("sgmv", ctypes.c_void_p), ("index", ctypes.c_void_p), ("offsets", ctypes.c_void_p),
                ("num_segments", ctypes.c_int64), ("table", ctypes.c_void_p)]


def attention_groups(tables: list[GroupTable]) -> tuple[ctypes.Array, list[torch.Tensor]]:
    """AttentionGroups from one GroupTable per group, and the tensors their pointers name (the caller keeps them
    alive until the C call returns)."""
    groups, keep = (AttentionGroup * len(tables))(), []
    for group, table in zip(groups, tables, strict=True):
        keep += [table.slots.to(torch.int32).contiguous(), table.kv_indices.to(torch.int32).contiguous(),
                 table.seq_lens.to(torch.int64).contiguous()]
        group.slots, group.kv_indices, group.seq_lens = (t.data_ptr() for t in keep[-3:])
        group.max_len, group.num_slots = table.max_len, table.num_slots
        if table.prefix_slots is not None and table.prefix_slots.numel():
            keep.append(table.prefix_slots.to(torch.int32).contiguous())
            group.prefix_slots, group.prefix_len, group.prefix = keep[-1].data_ptr(), keep[-1].numel(), table.prefix
    return groups, keep


class CDecoderKernel:
    """One build's functions: the size of the work buffer and a decode step over every layer (elements of
    `dtype`); and the step's SiLU-and-mul and add + RMSNorm loops, for prefill chunks (models/prefill_passes.py)."""

    def __init__(self, lib: ctypes.CDLL, dtype: torch.dtype) -> None:
        self._lib, self.dtype = lib, dtype
        suffix = "bf16" if dtype == torch.bfloat16 else "f32"
        self._step = getattr(lib, f"decode_step_{suffix}")
        self._step.restype = ctypes.c_int
        self._step.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
        self._work = getattr(lib, f"decode_step_{suffix}_work_size")
        self._work.restype = ctypes.c_int64
        self._work.argtypes = [ctypes.c_void_p, ctypes.c_int64]
        self._silu_mul = getattr(lib, f"silu_mul_{suffix}")
        self._silu_mul.restype = ctypes.c_int
        self._silu_mul.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_int]
        self._add_rmsnorm = getattr(lib, f"add_rmsnorm_{suffix}")
        self._add_rmsnorm.restype = ctypes.c_int
        self._add_rmsnorm.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 2 + [ctypes.c_float, ctypes.c_int]

    def work_size(self, model: ModelStruct, rows: int) -> int:
        return self._work(ctypes.byref(model), rows)

    def run(self, model: ModelStruct, attention: int, hidden: torch.Tensor, residual: torch.Tensor,
            positions: torch.Tensor, groups: ctypes.Array, work: torch.Tensor,
            lora: LoraDescriptor | None = None) -> int:
        """Every decoder layer for hidden's rows, in place; `attention` is the C function to call (the linear
        layers' are in the model's layer table), `groups` the model's `num_groups` AttentionGroups, `lora` the
        step's LoRA rows (None: none). Returns the status: 0 done, 1 a position, slot, group or LoRA row out of
        range (nothing written), else layer*1000+call."""
        return call_profiled(
            "radixserve::decode_step", self._step, ctypes.byref(model), attention,
            None if lora is None else ctypes.addressof(lora), hidden.data_ptr(), residual.data_ptr(),
            positions.data_ptr(), ctypes.addressof(groups), hidden.shape[0], work.data_ptr(), torch.get_num_threads())

    def add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, normed: torch.Tensor,
                    total: torch.Tensor, eps: float) -> int:
        """total = x + residual, normed = RMSNorm(total) (rows of the build's dtype, contiguous); 0, or 1 for a width
        that is not a multiple of 32 (nothing written)."""
        rows, width = x.shape
        return call_profiled("radixserve::fused::add_rmsnorm_c", self._add_rmsnorm, x.data_ptr(),
                             residual.data_ptr(), weight.data_ptr(), normed.data_ptr(), total.data_ptr(), rows, width,
                             eps, torch.get_num_threads())

    def silu_mul(self, gate_up: torch.Tensor, out: torch.Tensor) -> int:
        """out = SiLU(gate) * up of [gate | up] rows; 0, or 1 for a width that is not a multiple of 32."""
        rows, width = gate_up.shape
        return call_profiled("radixserve::fused::silu_and_mul_c", self._silu_mul, gate_up.data_ptr(),
                             out.data_ptr(), rows, width // 2, torch.get_num_threads())


def load_c_decoder_kernel(dtype: torch.dtype = torch.bfloat16) -> CDecoderKernel | None:
    """The build for `dtype` (float32: at this process's kernel level, read at each call so that a forced lower
    RADIXSERVE_CPU_ISA gets its own), or None where it cannot run or build."""
    if dtype == torch.bfloat16:
        lib = _bf16_library()
        return None if lib is None else CDecoderKernel(lib, dtype)
    level = rs_platform.kernel_isa() if is_x86() else "portable"
    if dtype != torch.float32 or level not in F32_LEVELS:
        return None
    return _f32_kernel(level)


@functools.cache
def _bf16_library() -> ctypes.CDLL | None:
    return load_library(SOURCE, "decode-step", FLAGS, "decode step kernel", "decode runs the layers in Python",
                        HEADERS)


@functools.cache
def _f32_kernel(level: str) -> CDecoderKernel | None:
    lib = load_library(F32_SOURCE, f"decode-step-f32-{level}", rs_platform.ISA_FLAGS[level],
                       "float32 decode step kernel", "decode runs the layers in Python", HEADERS)
    return None if lib is None else CDecoderKernel(lib, torch.float32)
