"""float32 compute over bfloat16 weights, for CPUs without bf16 products (AVX2, AVX-512 without BF16).

A decode step reads every weight once, and on such a CPU `--dtype bfloat16` is slow (its products are
emulated) while float32 reads twice the bytes. This method keeps each weight in bfloat16 (half the bytes;
what `--dtype bfloat16` keeps on a CPU with bf16 products) and computes in float32: csrc/bf16w_gemv.c widens
the weight in registers below WIDEN_ROWS rows; from there (a prefill chunk) the weight is widened into a float32
scratch for one float32 product (oneDNN's; `dense_product`). Measured on one core forced to AVX2 (ATen, MKL and oneDNN too) against the faster
of float32 `F.linear` and oneDNN (benchmarks/bench_bf16_weights.py): 1.1-2.4x faster at 1-32 rows, even at 64,
0.8-0.9x at 128-256, 0.92-0.98x at 1,024.

It changes the model's numbers (weights rounded to bf16), so timing never picks it (`rounds_weights`): the
dtype choice does (`--dtype auto`, platform.py) or `--linear-method bf16_weights`.
"""

from __future__ import annotations

import functools
import threading

import torch
import torch.nn.functional as F

from radixserve.kernels.gemv import BF16W_TILE, load_bf16w_kernel, pack_gemv_weight, unpack_gemv_weight
from radixserve.layers.linear import LinearBase, LinearMethod, register_linear_method

WIDEN_ROWS = 256  # from this many rows on, the weight is widened to float32 for one F.linear (a prefill chunk)
WIDEN_MAX_ELEMENTS = 64 << 20  # larger weights (an LM head asked for many rows of logits) stay on the kernel


class WidenScratch(threading.local):
    """One float32 buffer per thread that each layer's widened weight is written into in turn (a forward runs its
    layers one at a time on one thread), grown to the largest one. NOTE: a fresh tensor of tens of MB per
    product cost more in page faults than the widening itself."""

    def __init__(self) -> None:
        self.buffer = torch.empty(0, dtype=torch.float32)

    def take(self, elements: int) -> torch.Tensor:
        """At least `elements` floats, valid until this thread's next `take`."""
        if self.buffer.numel() < elements:
            self.buffer = torch.empty(elements, dtype=torch.float32)
        return self.buffer


SCRATCH = WidenScratch()


def dense_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias in float32 for a prefill chunk. oneDNN's float32 product over the plain widened weight
    (it blocks the weight itself) measured 0.75-1.02x F.linear's (MKL) time at the AVX2 class on decoder shapes,
    256 and 1,024 rows (benchmarks/bench_bf16_weights.py --prefill); F.linear where oneDNN is absent or turned off
    (RADIXSERVE_BF16W_ONEDNN_PREFILL=0)."""
    if _onednn_prefill():
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


@functools.cache
def _onednn_prefill() -> bool:
    from radixserve import envs

    return envs.BF16W_ONEDNN_PREFILL.get() and torch.backends.mkldnn.is_available()


class Bf16WeightLinearMethod(LinearMethod):
    name = "bf16_weights"
    rounds_weights = True

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype) -> bool:
        return device.type == "cpu" and dtype == torch.float32 and load_bf16w_kernel() is not None

    def __init__(self) -> None:
        self.packed: torch.Tensor | None = None

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        self.packed = pack_gemv_weight(layer.weight.detach().to(torch.bfloat16), BF16W_TILE)
        self.kernel = load_bf16w_kernel()

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).contiguous().to(torch.float32)
        n = layer.out_features
        if flat.shape[0] >= WIDEN_ROWS and self.packed.numel() <= WIDEN_MAX_ELEMENTS:
            # NOTE: the widened weight lives in this thread's scratch until its next layer's product
            y = dense_product(flat, self.kernel.widen(self.packed, n, SCRATCH.take(n * layer.in_features)), layer.bias)
        else:
            y = self.kernel(self.packed, flat, layer.bias, n)
        return y.view(*x.shape[:-1], n).to(x.dtype)

    def c_linear(self, rows: int, dtype: torch.dtype) -> int | None:
        usable = 0 < rows < WIDEN_ROWS and dtype == torch.float32 and self.packed is not None
        return self.kernel.address if usable else None

    @property
    def c_weight(self) -> torch.Tensor | None:
        return self.packed

    def dense_weight(self, layer: LinearBase) -> torch.Tensor:
        if layer.weight.numel() == 0 and self.packed is not None:
            return unpack_gemv_weight(self.packed, layer.out_features).to(layer.weight.dtype)
        return layer.weight.detach()

    def own_weight(self) -> torch.Tensor | None:
        return self.packed

    def own_forms(self) -> dict[int, int]:
        return {} if self.packed is None else {id(self.packed): self.packed.numel() * self.packed.element_size()}

    def describe(self) -> str:
        return f"{self.name} ({self.kernel.level})" if self.packed is not None else self.name

    def row_kernels(self, in_features: int, large_rows: frozenset[int] = frozenset()) -> str:
        return (f"bf16w_gemv ({load_bf16w_kernel().level}) below {WIDEN_ROWS} rows, a float32 copy and F.linear from "
                f"{WIDEN_ROWS}")


register_linear_method(Bf16WeightLinearMethod)
