"""Linear layers and the one protocol of linear methods: how a weight is kept and multiplied.

A `LinearBase` holds its parameters in the checkpoint's layout (weight [out, in], optional bias), so
loading is the same for every method, and a `LinearMethod` that owns whatever form of the weight it
multiplies with. Every weight format is a method: dense (`F.linear`), oneDNN's blocked layout, the bf16
GEMV/AMX layout (layers/gemv.py) and packed int8/int4, row or tiled (layers/quantization/linear.py).

Two ways a layer gets its method:
- float weights: once the model sits on its device in its dtype, `process_weights_after_loading` gives
  each layer the method named for its weight shape (`linear_tuning.choose_methods` measures them here)
  and the method turns the loaded weight into its own form;
- packed weights: quantization gives the layer a packed method before any weight exists (the checkpoint's
  format decides, `LinearMethod.chosen_by_format`), and the method quantizes rows as they are loaded.
`forward` is `method.apply` either way.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.configs.row_table import DEFAULT_ROWS, RowTable


class LinearMethod(ABC):
    """How one linear layer keeps its weight and computes x @ W.T + b. A method owns its weight's forms.
    `rows`: the row counts where its kernels change (the execution plan's table, given at set-up)."""

    name: ClassVar[str]
    chosen_by_format: ClassVar[bool] = False  # True: set by the weight format (packed), never re-chosen by tuning
    rounds_weights: ClassVar[bool] = False  # True: changes the weights' values, so only an explicit choice picks it
    preference: ClassVar[int] = 0  # breaks a timing tie (linear_tuning.TIE_MARGIN): the higher is taken
    rows: RowTable = DEFAULT_ROWS  # NOTE: device_setup gives each layer's method the plan's table

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype) -> bool:
        return True

    def process_weights_after_loading(self, layer: LinearBase) -> None:  # noqa: B027 (optional hook)
        """Called once, with the loaded weight on the runner's device and dtype."""

    @abstractmethod
    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor: ...

    def own_weight(self) -> torch.Tensor | None:
        """The weight in the method's own form, if it keeps one (then the loaded parameter can be freed)."""
        return None

    def dense_weight(self, layer: LinearBase) -> torch.Tensor:
        """The [out, in] weight in the parameter's dtype."""
        return layer.weight.detach()

    def own_forms(self) -> dict[int, int]:
        """id -> bytes of each form of the weight the method keeps beside the layer's parameters (a form shared
        by two layers, a tied packed table, has one id)."""
        return {}

    def describe(self) -> str:
        return self.name

    def c_linear(self, rows: int, dtype: torch.dtype) -> int | None:
        """The address of the C function that multiplies `rows` rows of `dtype` as `apply` would (for C code that
        calls it itself: the C decoder, models/c_decoder.py), or None. Its arguments: `c_weight`'s data,
        x, bias, y (all `dtype`), m, n, k, threads."""
        return None

    @property
    def c_weight(self) -> torch.Tensor | None:
        """The weight in the form `c_linear`'s function reads."""
        return None

    def row_kernels(self, in_features: int, large_rows: frozenset[int] = frozenset()) -> str:
        """Which kernel multiplies how many rows (the method's thresholds and its timed choices, merged), for
        the execution plan."""
        return f"{self.name} at every row count"

    def use_row_kernel_everywhere(self, on: bool = True) -> bool:
        """Deterministic inference (`on`): from now on multiply every row count with the method's row kernel, whose
        sums for one row run in one order whatever the other rows (how many, which, where that row sits); off: the
        kernels per row count again. False where the method has no such kernel (its products at different row
        counts round differently)."""
        return not on


class DenseLinearMethod(LinearMethod):
    """The weight as loaded, multiplied by `F.linear` (the path on CUDA, and the fallback everywhere)."""

    name = "dense"

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)

    def row_kernels(self, in_features: int, large_rows: frozenset[int] = frozenset()) -> str:
        return "F.linear at every row count"


class OneDNNLinearMethod(LinearMethod):
    """The weight reordered once into oneDNN's blocked layout, multiplied by oneDNN (CPU only).

    `F.linear` in bfloat16 on the CPU reorders the weight on every call; the packed weight is read as
    it is, which matters most when the weight is read once per step (decode)."""

    name = "onednn"

    def __init__(self) -> None:
        self.packed_weight: torch.Tensor | None = None

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype) -> bool:
        if device.type != "cpu" or not torch.backends.mkldnn.is_available():
            return False
        if dtype == torch.bfloat16:
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        return dtype == torch.float32

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        self.packed_weight = pack_onednn_weight(layer.weight.detach())

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, layer.bias, "none", [], "")

    def row_kernels(self, in_features: int, large_rows: frozenset[int] = frozenset()) -> str:
        return "oneDNN at every row count"

    def own_weight(self) -> torch.Tensor | None:
        return self.packed_weight

    def dense_weight(self, layer: LinearBase) -> torch.Tensor:
        if layer.weight.numel() == 0 and self.packed_weight is not None:
            return self.packed_weight.to_dense().to(layer.weight.dtype)
        return layer.weight.detach()

    def own_forms(self) -> dict[int, int]:
        packed = self.packed_weight
        return {} if packed is None else {id(packed): torch.ops.mkldnn._nbytes(packed)}


def pack_onednn_weight(weight: torch.Tensor) -> torch.Tensor:
    # NOTE: no batch-size hint: one packing serves every number of tokens (measured as fast as a
    # per-size packing at 32 and 1,024 tokens, within 10% at 1).
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())


LINEAR_METHODS: dict[str, type[LinearMethod]] = {
    DenseLinearMethod.name: DenseLinearMethod,
    OneDNNLinearMethod.name: OneDNNLinearMethod,
}
AUTO = "auto"  # chosen per weight shape by measurement (linear_tuning.py)


def register_linear_method(method: type[LinearMethod]) -> None:
    """Adds a method for float weights (e.g. another kernel), selectable by `method.name`."""
    LINEAR_METHODS[method.name] = method


def linear_method_names() -> list[str]:
    return [AUTO, *sorted(LINEAR_METHODS)]


class LinearBase(nn.Linear):
    """y = x @ weight.T + bias, computed by `self.method` (dense until the runner or quantization chooses).

    A layer whose method is packed has no `weight` parameter: the method holds the packed table."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.method: LinearMethod = DenseLinearMethod()
        self.lora: Any = None  # the LoRA products of a mixed batch (lora/layers.LoraLinear), once LoRA is on

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.method.apply(self, x)
        # NOTE: the base product once for every row; each adapter's rows then add their own delta
        return y if self.lora is None else self.lora.add_to(x, y)

    def set_method(self, method: LinearMethod) -> None:
        """Gives the layer a method chosen by its weight format (quantization) before weights are loaded."""
        self.method = method
        if method.chosen_by_format:
            self.register_parameter("weight", None)  # NOTE: the method keeps the only copy of the weight

    def dense_weight(self) -> torch.Tensor:
        """The [out, in] weight, rebuilt from the method's own form if the loaded one was freed."""
        return self.method.dense_weight(self)

    def weight_nbytes(self) -> int:
        """Bytes of the weight as kept: the parameter (empty once freed) and the method's own forms."""
        param = 0 if self.weight is None else self.weight.numel() * self.weight.element_size()
        return param + sum(self.method.own_forms().values())

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, "
                f"method={self.method.describe()}")


def linear_layers(model: nn.Module) -> Iterable[tuple[str, LinearBase]]:
    return ((name, m) for name, m in model.named_modules() if isinstance(m, LinearBase))


def tunable_layers(model: nn.Module) -> Iterable[tuple[str, LinearBase]]:
    """The linear layers of float weights, whose method the runner chooses per shape."""
    return ((name, m) for name, m in linear_layers(model) if not m.method.chosen_by_format)


def process_weights_after_loading(model: nn.Module, methods: dict[tuple[int, int], str]) -> dict[str, int]:
    """Gives every float linear layer the method named for its weight shape and lets it prepare the weight.

    `methods` maps (out_features, in_features) -> method name; shapes it lacks stay dense; layers whose
    format chose their method (packed) keep it. A weight that a method keeps in its own form is freed unless
    another module shares it (tied embeddings). Calling it again (another runner on the same loaded model)
    prepares only layers whose method or dtype changed. Returns how many layers each method got.
    """
    shared = _params_outside_linears(model)
    counts: dict[str, int] = {}
    for _, layer in linear_layers(model):
        if layer.method.chosen_by_format:
            counts[layer.method.name] = counts.get(layer.method.name, 0) + 1
            continue
        name = methods.get(layer.shape, DenseLinearMethod.name)
        own = layer.method.own_weight()
        if layer.method.name != name or (own is not None and own.dtype != layer.weight.dtype):
            layer.weight.data = layer.dense_weight()
            layer.method = LINEAR_METHODS[name]()
            layer.method.process_weights_after_loading(layer)
            if layer.method.own_weight() is not None and id(layer.weight) not in shared:
                layer.weight.data = layer.weight.data.new_empty(0)
        counts[name] = counts.get(name, 0) + 1
    return counts


def _params_outside_linears(model: nn.Module) -> set[int]:
    return {id(p) for m in model.modules() if not isinstance(m, LinearBase) for p in m.parameters(recurse=False)}
