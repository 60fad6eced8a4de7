"""Every row count at which a forward changes kernel, defined once.

A linear layer, the C decoder, prefill's row passes, LoRA's segments and attention each switch kernels at some
number of rows (or new tokens, or shared tokens). Those counts are this table's fields and nowhere else: the
execution plan builds the process's one `RowTable` (`RowTable.from_env`, with `RADIXSERVE_GEMV_MAX_ROWS` and
`RADIXSERVE_F32_GEMV_MAX_ROWS` applied), shows it (`/get_server_info`, the plan's "rows" entry) and hands each part its table at set-up
(`model_executor/device_setup.py`, the attention backend through its `AttentionPlan`, the LoRA manager). A
part built outside a plan (a unit test, a kernel benchmark) reads `DEFAULT_ROWS`.

Counts named `*_rows` are inclusive upper bounds ("1..N rows"); `*_from` are the first count of the next kernel.
Each value was measured on the machines named beside it (docs/cpu_fast_path.md, docs/attention.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch

from radixserve import envs

GEMV_LIMIT = 64  # NOTE: the most rows the bf16 GEMV can take at all (DP_MAX_M in csrc/bf16_gemv.c)


@dataclass(frozen=True)
class CascadePolicy:
    """When a batch runs cascade attention; measured with the CPU backend (docs/attention.md, "When")."""

    min_prefix: int = 256  # shared tokens; below, the extra calls and the merge cost more than they save
    # decode also needs this many requests: part (a) is one more attention call per layer, which a small
    # batch does not win back (batch 8 lost at every prefix up to 1,000 on an AVX2 float32 run; 32 won)
    min_decode_batch: int = 16
    # and (batch - 1) * prefix, the prefix K/V rows it no longer re-reads, this large
    min_decode_saved: int = 768

    def takes(self, decode: bool, batch_size: int, shared: int) -> bool:
        """Whether a batch of `batch_size` requests runs cascade for layers that read `shared` of its shared
        prefix's keys in part (a): all P for full layers, the part inside the batch's windows for window ones.
        NOTE: the one place the decision is made; the planners only measure `shared`."""
        if decode:
            return (batch_size >= max(2, self.min_decode_batch) and shared >= self.min_prefix
                    and (batch_size - 1) * shared >= self.min_decode_saved)
        return batch_size >= 2 and shared >= self.min_prefix


@dataclass(frozen=True)
class RowTable:
    """The row counts of one process's kernels (module docstring)."""

    # linear layers: each method's own kernel up to its count, oneDNN's (or a dense) product above
    f32_gemv_rows: int = 7  # float32 GEMV (f32_gemv.c); oneDNN won from 8 rows (benchmarks/bench_f32_linear.py)
    bf16_gemv_rows: int = 32  # bf16 GEMV without AMX (bf16_gemv.c, AVX512-BF16; at most GEMV_LIMIT)
    amx_rows: int = 32  # the AMX kernel: two 16-row A tiles
    bf16_weights_rows: int = 255  # bf16w_gemv; from 256 rows (a prefill chunk) the weight is widened once for oneDNN
    packed_rows: int = 4  # the row-layout int8/int4 kernel (no tiled layout), expansion + dense GEMM above
    tiled_rows: int = 32  # the tiled int8/int4 kernel, expansion + dense GEMM above
    # the C decoder's SiLU-and-mul and add + RMSNorm loops over prefill batches from this many rows
    prefill_passes_from: int = 64
    # LoRA: one C SGMV call per layer for every segment up to this many rows, torch matmuls for larger ones
    lora_segment_rows_f32: int = 127
    lora_segment_rows_bf16: int = 31
    # attention: the C extend kernel for batches whose requests have at most this many new tokens. It was 512
    # while SDPA was level or ahead at 1,024 on most classes; since the kernel's AVX2 and float32 paths got faster
    # it wins at 1,024 and 2,048 on every SIMD class of a Zen 4 (1.1-2.6x, 1 thread; bench_extend_attention.py)
    extend_kernel_new_tokens: int = 2048
    cascade: CascadePolicy = field(default_factory=CascadePolicy)

    @classmethod
    def from_env(cls) -> RowTable:
        """The defaults with the environment's overrides (RADIXSERVE_GEMV_MAX_ROWS, RADIXSERVE_F32_GEMV_MAX_ROWS)."""
        table, bf16, f32 = cls(), envs.GEMV_MAX_ROWS.get(), envs.F32_GEMV_MAX_ROWS.get()
        return replace(table, bf16_gemv_rows=table.bf16_gemv_rows if bf16 is None else min(GEMV_LIMIT, max(1, bf16)),
                       f32_gemv_rows=table.f32_gemv_rows if f32 is None else max(1, f32))

    def lora_segment_rows(self, dtype: torch.dtype) -> int | None:
        """The largest segment the LoRA C kernel takes in `dtype`; None: no C kernel in that dtype."""
        # NOTE: asked by every LoRA layer of every forward: no table built per call
        if dtype == torch.float32:
            return self.lora_segment_rows_f32
        return self.lora_segment_rows_bf16 if dtype == torch.bfloat16 else None

    def linear_row_limits(self) -> tuple[int, ...]:
        """Every row count at which some linear method changes kernel: the C decoder's candidate batch limits."""
        return (1, self.f32_gemv_rows, self.bf16_gemv_rows, self.amx_rows, self.bf16_weights_rows, self.tiled_rows)

    def describe(self) -> str:
        """One line for the plan."""
        rows = ", ".join(f"{f.name} {getattr(self, f.name)}" for f in fields(self) if f.name != "cascade")
        c = self.cascade
        return (f"{rows}; cascade from {c.min_prefix} shared tokens (decode: {c.min_decode_batch}+ requests, "
                f"{c.min_decode_saved}+ rows saved)")


DEFAULT_ROWS = RowTable()
