"""The float32 decode linear method: our GEMV for the smallest decode batches, oneDNN above.

`--dtype float32` keeps every weight in float32 (no rounding). csrc/f32_gemv.c streams the weight rows in
their own layout at the kernel level this process runs (AVX-512, AVX2 + FMA, or plain C); it is the function
the float32 C decoder calls for such a layer, so small decode batches run every decoder layer in one C
call. It beats oneDNN's prepacked product at one row and ties it at four; above `RowTable.f32_gemv_rows` oneDNN
is faster (benchmarks/bench_f32_linear.py), so those rows keep oneDNN's product. Like `onednn_gemv` in bf16,
the layer keeps two copies of its weight (the loaded one for the GEMV, oneDNN's blocked one): `--linear-method
onednn` keeps one. Timing decides per shape (layers/linear_tuning.py).
"""

from __future__ import annotations

import torch

from radixserve.kernels.gemv import load_f32_kernel
from radixserve.layers.linear import LinearBase, OneDNNLinearMethod, register_linear_method


class F32GemvLinearMethod(OneDNNLinearMethod):
    name = "f32_gemv"
    preference = 1  # NOTE: oneDNN's own product above the GEMV rows, and the one the float32 C decoder calls

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype) -> bool:
        return dtype == torch.float32 and super().supports(device, dtype) and load_f32_kernel() is not None

    def __init__(self) -> None:
        super().__init__()
        self.weight: torch.Tensor | None = None  # the loaded weight, kept for the GEMV
        self.every_row = False  # deterministic inference: the GEMV at every row count

    def use_row_kernel_everywhere(self, on: bool = True) -> bool:
        # NOTE: f32_gemv.c sums each output over K in one lane order and reduces it once, whatever rows share a pass
        self.every_row = on
        return True

    def _gemv_rows(self, rows: int) -> bool:
        return 0 < rows and (self.every_row or rows <= self.rows.f32_gemv_rows)

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        super().process_weights_after_loading(layer)
        # NOTE: a detached view of the loaded storage: it stays alive when the layer's parameter is emptied
        self.weight = layer.weight.detach().contiguous()
        self.kernel = load_f32_kernel()

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        if self.every_row and x.dtype == torch.float32 and x.numel():
            flat = x.reshape(-1, x.shape[-1]).contiguous()
            return self.kernel(self.weight, flat, layer.bias).view(*x.shape[:-1], layer.out_features)
        rows = x.shape[0] if x.dim() == 2 and x.is_contiguous() else 0
        if self._gemv_rows(rows) and x.dtype == torch.float32:
            return self.kernel(self.weight, x, layer.bias)
        return super().apply(layer, x)

    def c_linear(self, rows: int, dtype: torch.dtype) -> int | None:
        usable = self._gemv_rows(rows) and dtype == torch.float32 and self.weight is not None
        return self.kernel.address if usable else None

    @property
    def c_weight(self) -> torch.Tensor | None:
        return self.weight

    def dense_weight(self, layer: LinearBase) -> torch.Tensor:
        return self.weight if self.weight is not None else super().dense_weight(layer)

    def own_forms(self) -> dict[int, int]:
        dense = self.weight
        return {**super().own_forms(), **({} if dense is None else {id(dense): dense.numel() * dense.element_size()})}

    def describe(self) -> str:
        return f"{self.name} ({self.kernel.level})" if self.weight is not None else self.name

    def row_kernels(self, in_features: int, large_rows: frozenset[int] = frozenset()) -> str:
        if self.every_row:
            return f"f32_gemv ({load_f32_kernel().level}) at every row count (deterministic inference)"
        return f"1-{self.rows.f32_gemv_rows} rows f32_gemv ({load_f32_kernel().level}), oneDNN above"


register_linear_method(F32GemvLinearMethod)
