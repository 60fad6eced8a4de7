"""The linear method of packed weights, the embedding of a packed table, and the matmul path per batch size.

Paths of `PackedLinearMethod.apply` (measured by benchmarks/bench_quant_matmul.py at the model's shapes):
- up to `RowTable.packed_rows` rows (decode): the C kernel, integer dot products on int8-quantized activations;
- more rows (prefill, large decode batches): the C kernel expands the weight into a reused float
  buffer, in pieces of at most DEQUANT_CHUNK values, and torch's dense GEMM (oneDNN) multiplies;
- no C compiler: the same in plain torch (`PackedWeight.dequantize`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.configs.row_table import DEFAULT_ROWS, RowTable
from radixserve.kernels.quant import BoundMatmul, QuantKernel, load_quant_kernel
from radixserve.kernels.quant_tiled import load_tiled_kernel
from radixserve.layers.linear import LinearBase, LinearMethod
from radixserve.layers.quantization.formats import PackedWeight
from radixserve.layers.quantization.tiled import TILE, TiledWeight

EVERY_ROW_KERNELS = "the tiled integer kernel at every row count (deterministic inference)"  # row_kernels' text then
DEQUANT_CHUNK = 1 << 21  # values per expanded piece (4 MiB in bfloat16)
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


class PackedLinearMethod(LinearMethod):
    """The linear method of packed weights: y = x @ W^T (+ bias) with W int8 or int4, in rows or tiles.

    The method owns the packed table, filled by `load_rows` as checkpoint shards arrive (a fused layer's
    q/k/v rows one after another) or set whole; the layer keeps only its bias. Chosen by the weight format
    (quantization.model_quant.quantize_model), never re-chosen by linear tuning."""

    name = "packed"
    chosen_by_format = True

    def __init__(self, packed: PackedWeight) -> None:
        self.packed = packed
        self.kernel: QuantKernel | None = None
        self._bound: BoundMatmul | None = None  # the kernel bound to `packed` (decode's fast path)
        self._descriptor: tuple[TiledWeight, torch.Tensor] | None = None  # c_weight, for the packed weight it describes
        self.every_row = False  # deterministic inference: the tiled integer kernel at every row count

    def use_row_kernel_everywhere(self, on: bool = True) -> bool:
        # NOTE: the tiled kernel rounds each row's activations per block of 32 on their own and adds the blocks'
        # products in order, whether the row shares its pass with others or not; the row layout has no such kernel
        if on and (not isinstance(self.packed, TiledWeight) or load_tiled_kernel() is None):
            return False
        self.every_row = on
        return True

    def load_rows(self, tensor: torch.Tensor | PackedWeight, start: int, length: int) -> None:
        """Quantizes float rows [start, start + length) of the weight (a fused layer's shard); -1: all rows."""
        self._bound = None
        _load_rows(self.packed, tensor, start, length)

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        bias = layer.bias
        if self.every_row and bias is None and x.dtype in _KERNEL_DTYPES and x.numel():
            flat = x.reshape(-1, layer.in_features).contiguous()
            return load_tiled_kernel().matmul(self.packed, flat, x.dtype).view(*x.shape[:-1], layer.out_features)
        if isinstance(self.packed, TiledWeight) and x.dim() == 2 and bias is None and x.dtype in _KERNEL_DTYPES:
            return tiled_linear(self.packed, x.contiguous(), self.rows.tiled_rows)
        if x.dim() == 2 and x.shape[0] <= self.rows.packed_rows and bias is None and x.dtype in _KERNEL_DTYPES:
            bound = self._bound
            if bound is None or bound.packed is not self.packed:  # NOTE: `packed` may be assigned directly
                bound = self._bind()
            if bound is not None:
                return bound(x.contiguous(), x.dtype)
        shape = x.shape
        y = packed_linear(self.packed, x.reshape(-1, layer.in_features), self._kernel(), self.rows)
        if bias is not None:
            y = y + bias
        return y.view(*shape[:-1], layer.out_features)

    def c_linear(self, rows: int, dtype: torch.dtype) -> int | None:
        """The tiled kernel for up to `rows.tiled_rows` rows in float32 or bfloat16 (the row layout has no C entry)."""
        kernel = load_tiled_kernel()
        fits = 0 < rows and (self.every_row or rows <= self.rows.tiled_rows)
        if not isinstance(self.packed, TiledWeight) or not fits or kernel is None:
            return None
        return kernel.linear_address(dtype)

    @property
    def c_weight(self) -> torch.Tensor | None:
        if not isinstance(self.packed, TiledWeight):
            return None
        if self._descriptor is None or self._descriptor[0] is not self.packed:  # NOTE: `packed` may be reassigned
            self._descriptor = (self.packed, load_tiled_kernel().c_descriptor(self.packed))
        return self._descriptor[1]

    def dense_weight(self, layer: LinearBase) -> torch.Tensor:
        return self.packed.dequantize(torch.float32)

    def own_forms(self) -> dict[int, int]:
        return {id(self.packed): self.packed.nbytes}

    def describe(self) -> str:
        return f"packed {self.packed.format_name}"

    def row_kernels(self, in_features: int, large_rows: frozenset[int] = frozenset()) -> str:
        if self.every_row:
            return EVERY_ROW_KERNELS
        if isinstance(self.packed, TiledWeight) or load_tiled_kernel() is not None:
            return f"1-{self.rows.tiled_rows} rows the tiled integer kernel, expansion + dense GEMM above"
        return f"1-{self.rows.packed_rows} rows the integer kernel, expansion + dense GEMM above"

    def _bind(self) -> BoundMatmul | None:
        kernel = self._kernel()
        self._bound = None if kernel is None else kernel.bind(self.packed)
        return self._bound

    def _kernel(self) -> QuantKernel | None:
        if self.kernel is None:
            self.kernel = load_quant_kernel()
        return self.kernel


def packed_layer(in_features: int, out_features: int, packed: PackedWeight, bias: bool = False) -> LinearBase:
    """A linear layer on a packed weight (tests, and layers built outside a model)."""
    layer = LinearBase(in_features, out_features, bias=bias)
    layer.set_method(PackedLinearMethod(packed))
    return layer


class QuantizedEmbedding(nn.Module):
    """Row lookup of a packed [vocab, hidden] table (shared with a tied quantized LM head)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.dtype = num_embeddings, embedding_dim, dtype
        self.packed: PackedWeight | None = None

    def load_rows(self, tensor: torch.Tensor, start: int, length: int) -> None:
        _load_rows(self.packed, tensor, start, length)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        return self.packed.dequantize(self.dtype, rows=flat).view(*ids.shape, self.embedding_dim)

    def _apply(self, fn, recurse: bool = True):
        # NOTE: Module.to(dtype) reaches here; remember the dtype for the rows we dequantize.
        probe = fn(torch.empty(0, dtype=self.dtype))
        if probe.is_floating_point():
            self.dtype = probe.dtype
        return super()._apply(fn, recurse)


def _load_rows(packed: PackedWeight, tensor: torch.Tensor | PackedWeight, start: int, length: int) -> None:
    """Float rows are quantized into place; an already packed part (a GGUF tensor) is copied."""
    length = packed.shape[0] if length < 0 else length
    if tuple(tensor.shape) != (length, packed.shape[1]):
        raise ValueError(f"tensor shape {tuple(tensor.shape)} does not fit rows {start}..{start + length} of a "
                         f"packed weight of shape {packed.shape}")
    if isinstance(tensor, PackedWeight):
        packed.set_rows(start, tensor)
    else:
        packed.load_float_rows(tensor, start)


def packed_linear(packed: PackedWeight, x: torch.Tensor, kernel: QuantKernel | None,
                  rows: RowTable = DEFAULT_ROWS) -> torch.Tensor:
    """x [M, K] -> [M, N] in x's dtype; `rows`: where the kernels stop (`packed_rows`, `tiled_rows`)."""
    dtype = x.dtype
    if isinstance(packed, TiledWeight):
        if dtype not in _KERNEL_DTYPES:
            return F.linear(x, packed.dequantize(torch.float32).to(dtype))
        return tiled_linear(packed, x.contiguous(), rows.tiled_rows)
    if kernel is None or dtype not in _KERNEL_DTYPES:
        return F.linear(x, packed.dequantize(dtype))
    x = x.contiguous()
    if x.shape[0] <= rows.packed_rows:
        return kernel.matmul(packed, x, dtype)
    return _dequant_gemm(packed, x, kernel)


_buffers: dict[torch.dtype, torch.Tensor] = {}


def _scratch(dtype: torch.dtype, numel: int) -> torch.Tensor:
    # NOTE: one buffer per dtype, reused by every layer; forwards run one at a time per process.
    buf = _buffers.get(dtype)
    if buf is None or buf.numel() < numel:
        buf = _buffers[dtype] = torch.empty(numel, dtype=dtype)
    return buf[:numel]


def _dequant_gemm(packed: PackedWeight, x: torch.Tensor, kernel: QuantKernel) -> torch.Tensor:
    n, k = packed.shape
    rows = max(1, min(n, DEQUANT_CHUNK // k))
    if rows >= n:
        return F.linear(x, kernel.dequant(packed, 0, n, _scratch(x.dtype, n * k).view(n, k)))
    out = torch.empty(x.shape[0], n, dtype=x.dtype)
    for start in range(0, n, rows):
        stop = min(n, start + rows)
        w = kernel.dequant(packed, start, stop, _scratch(x.dtype, (stop - start) * k).view(stop - start, k))
        out[:, start:stop] = F.linear(x, w)
    return out


def tiled_linear(packed: TiledWeight, x: torch.Tensor, max_rows: int) -> torch.Tensor:
    """x [M, K] contiguous, float32 or bfloat16 -> [M, N]: the tiled kernel up to `max_rows` rows, else the weight
    expanded (transposed, in pieces of at most DEQUANT_CHUNK values) and torch's dense GEMM."""
    kernel = load_tiled_kernel()
    if x.shape[0] <= max_rows:
        return kernel.matmul(packed, x, x.dtype)
    n, k = packed.shape
    cols = max(TILE, DEQUANT_CHUNK // k // TILE * TILE)
    if cols >= n:
        return x @ kernel.expand_t(packed, 0, n, x.dtype, _scratch(x.dtype, n * k).view(k, n))
    out = torch.empty(x.shape[0], n, dtype=x.dtype)
    for start in range(0, n, cols):
        stop = min(n, start + cols)
        out[:, start:stop] = x @ kernel.expand_t(packed, start, stop, x.dtype,
                                                 _scratch(x.dtype, (stop - start) * k).view(k, stop - start))
    return out
