"""Linear layers and the registry of linear methods: how a weight is kept and multiplied.

A `LinearBase` holds its parameters in the checkpoint's layout (weight [out, in], optional bias), so
loading is the same for every method. Once the model sits on its device in its dtype, the runner
calls `process_weights_after_loading`: each layer's `LinearMethod` then turns the loaded weight into
what it multiplies with (left dense; packed into oneDNN's blocked layout; quantized methods later),
and `forward` is `method.apply`. Methods are registered by name in `LINEAR_METHODS`;
`linear_tuning.choose_methods` picks one per weight shape by measuring them on this machine.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn


class LinearMethod(ABC):
    """How one linear layer stores its weight after loading and computes x @ W.T + b."""

    name: ClassVar[str]

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype) -> bool:
        return True

    def process_weights_after_loading(self, layer: LinearBase) -> None:  # noqa: B027 (optional hook)
        """Called once, with the loaded weight on the runner's device and dtype."""

    @abstractmethod
    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor: ...


class DenseLinearMethod(LinearMethod):
    """The weight as loaded, multiplied by `F.linear` (the path on CUDA, and the fallback everywhere)."""

    name = "dense"

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)


class OneDNNLinearMethod(LinearMethod):
    """The weight reordered once into oneDNN's blocked layout, multiplied by oneDNN (CPU only).

    `F.linear` in bfloat16 on the CPU reorders the weight on every call; the packed weight is read as
    it is, which matters most when the weight is read once per step (decode)."""

    name = "onednn"

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype) -> bool:
        if device.type != "cpu" or not torch.backends.mkldnn.is_available():
            return False
        if dtype == torch.bfloat16:
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        return dtype == torch.float32

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        layer.packed_weight = pack_onednn_weight(layer.dense_weight())

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, layer.packed_weight, layer.bias, "none", [], "")


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
    """Adds a method (e.g. an int8 or int4 packed weight), selectable by `method.name`."""
    LINEAR_METHODS[method.name] = method


def linear_method_names() -> list[str]:
    return [AUTO, *sorted(LINEAR_METHODS)]


class LinearBase(nn.Linear):
    """y = x @ weight.T + bias, computed by `self.method` (dense until the runner chooses).

    An `nn.Linear`, so that code which plans per linear layer (quantization's module swap,
    layers/quantization/model_quant.py) treats it as one; a swapped-in QuantizedLinear runs its own kernels.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.method: LinearMethod = DenseLinearMethod()
        self.packed_weight: torch.Tensor | None = None  # set by a method that keeps its own form
        self.gemv_weight: torch.Tensor | None = None  # a second form for few rows (layers/gemv.py)

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)

    def dense_weight(self) -> torch.Tensor:
        """The [out, in] weight in the parameter's dtype, unpacked again if only the packed form is kept."""
        if self.weight.numel() == 0 and self.packed_weight is not None:
            return self.packed_weight.to_dense().to(self.weight.dtype)
        return self.weight.detach()

    def weight_nbytes(self) -> int:
        """Bytes of the weight as kept: the packed forms when a method keeps them, else the parameter."""
        extra = 0 if self.gemv_weight is None else self.gemv_weight.numel() * self.gemv_weight.element_size()
        if self.packed_weight is not None:
            packed = self.packed_weight
            nbytes = torch.ops.mkldnn._nbytes(packed) if packed.is_mkldnn else packed.numel() * packed.element_size()
            return nbytes + extra
        return self.weight.numel() * self.weight.element_size() + extra

    def release_dense_weight(self) -> None:
        """Frees the loaded weight once a method keeps its own copy (`dense_weight` can rebuild it)."""
        if self.packed_weight is not None:
            self.weight.data = self.weight.data.new_empty(0)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, method={self.method.name}"


def linear_layers(model: nn.Module) -> Iterable[tuple[str, LinearBase]]:
    return ((name, m) for name, m in model.named_modules() if isinstance(m, LinearBase))


def process_weights_after_loading(model: nn.Module, methods: dict[tuple[int, int], str]) -> dict[str, int]:
    """Gives every linear layer the method named for its weight shape and lets it prepare the weight.

    `methods` maps (out_features, in_features) -> method name; shapes it lacks stay dense. A weight
    that a method packed is freed unless another module shares it (tied embeddings). Calling it again
    (another runner on the same loaded model) repacks only layers whose method or dtype changed.
    Returns how many layers each method got.
    """
    shared = _params_outside_linears(model)
    counts: dict[str, int] = {}
    for _, layer in linear_layers(model):
        name = methods.get(layer.shape, DenseLinearMethod.name)
        packed = layer.packed_weight
        if layer.method.name != name or (packed is not None and packed.dtype != layer.weight.dtype):
            dense = layer.dense_weight()
            layer.packed_weight = layer.gemv_weight = None
            layer.weight.data = dense
            layer.method = LINEAR_METHODS[name]()
            layer.method.process_weights_after_loading(layer)
            if id(layer.weight) not in shared:
                layer.release_dense_weight()
        counts[name] = counts.get(name, 0) + 1
    return counts


def _params_outside_linears(model: nn.Module) -> set[int]:
    return {id(p) for m in model.modules() if not isinstance(m, LinearBase) for p in m.parameters(recurse=False)}
