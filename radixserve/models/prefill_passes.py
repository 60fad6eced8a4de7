"""The C decoder's row passes over prefill batches (kernels/csrc/decode_step.c and decode_step_f32.c).

RowSiluAndMul and RowAddRMSNorm stand in for the compiled nn.Modules SiluAndMul and AddRMSNorm of
layers/fused_ops.py from `RowTable.prefill_passes_from` rows (named apart so each name means one thing).

A model whose decode batches run the C decoder has that step's loops for the passes between matrix products:
in bf16 bit-equal to the compiled fused ops (layers/fused_ops.py) or rounding alike, in float32 equal to them to
float32 rounding. On a prefill chunk they are faster than inductor's code, so from that many rows the layers call
them too (and a float32 prefill then rounds as its decode steps do); below, the compiled op's call is the cheaper
one. Measured at 2 threads, SmolLM2's widths: bf16 on the Zen 4 EPYC (AVX512-BF16), SiLU-and-mul at 2,048 rows
1.15 ms against 1.77, add + RMSNorm 53 against 100 us at 512 rows and 189 against 371 us at 2,048; float32 on the
AMX Xeon forced to the AVX2 class, add + RMSNorm 50 against 106 us at 512 rows, SiLU-and-mul 164 against 226 us.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from radixserve.configs.row_table import DEFAULT_ROWS, RowTable
from radixserve.kernels.c_decoder import CDecoderKernel, load_c_decoder_kernel


def _takes(kernel: CDecoderKernel, x: torch.Tensor, min_rows: int) -> bool:
    return x.shape[0] >= min_rows and x.dtype == kernel.dtype and x.is_contiguous()


class RowSiluAndMul:
    """SiLU-and-mul of a fused [gate | up] batch: the C loop from `min_rows` rows (in bf16 the compiled op's
    rounding steps: a result differs, if at all, by one bf16 unit in a few places), the compiled op below."""

    def __init__(self, kernel: CDecoderKernel, compiled: Any, min_rows: int) -> None:
        self._kernel, self._compiled, self._min_rows = kernel, compiled, min_rows

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        if not _takes(self._kernel, gate_up, self._min_rows):
            return self._compiled(gate_up)
        rows, width = gate_up.shape
        out = torch.empty(rows, width // 2, dtype=gate_up.dtype)
        if self._kernel.silu_mul(gate_up, out):
            raise ValueError(f"SiLU-and-mul needs a [gate | up] width that is a multiple of 32, got {width}")
        return out


class RowAddRMSNorm:
    """(RMSNorm(x + residual), x + residual) of a batch: the C rows from `min_rows` rows (in bf16 bit-equal to the
    compiled op; in float32 the sum is, the norm to float32 rounding), the compiled op below. `eps`: the model's, the
    one the compiled op was built with."""

    def __init__(self, kernel: CDecoderKernel, compiled: Any, eps: float, min_rows: int) -> None:
        self._kernel, self._compiled, self.eps, self._min_rows = kernel, compiled, eps, min_rows

    def __call__(self, x: torch.Tensor, residual: torch.Tensor,
                 weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not (_takes(self._kernel, x, self._min_rows) and x.dim() == 2 and residual.shape == x.shape and residual.dtype == x.dtype
                and weight.dtype == x.dtype):
            return self._compiled(x, residual, weight)
        normed, total = torch.empty_like(x), torch.empty_like(x)
        if self._kernel.add_rmsnorm(x, residual.contiguous(), weight.contiguous(), normed, total, self.eps):
            return self._compiled(x, residual, weight)  # a width the rows do not take (not a multiple of 32)
        return normed, total


@dataclass(frozen=True)
class PrefillPasses:
    """The passes a model runs in place of its compiled ones (LlamaForCausalLM.set_fused_ops)."""

    silu_and_mul: RowSiluAndMul
    add_rmsnorm: RowAddRMSNorm


def c_prefill_passes(ops: Any, eps: float, every_row: bool = False, rows: RowTable = DEFAULT_ROWS) -> PrefillPasses | None:
    """The C decoder's passes in the dtype of the compiled ops `ops` (FusedOps), over them, for a model with
    RMSNorm `eps`, from `rows.prefill_passes_from` rows; None where that build cannot run. `every_row` (deterministic inference): the C loops at every
    row count (the final norm of a decode batch and of a prompt's last rows then round alike)."""
    kernel = load_c_decoder_kernel(ops.dtype)
    if kernel is None:
        return None
    start = 1 if every_row else rows.prefill_passes_from
    return PrefillPasses(RowSiluAndMul(kernel, ops.silu_and_mul, start),
                         RowAddRMSNorm(kernel, ops.add_rmsnorm, eps, start))
