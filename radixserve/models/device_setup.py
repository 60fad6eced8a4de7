"""What a loaded model needs once it is on its device and dtype: linear methods, then fused ops."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from radixserve.layers.fused_ops import load_fused_ops
from radixserve.layers.linear_tuning import configure_linear_methods
from radixserve.layers.quantization.model_quant import tile_packed_weights
from radixserve.models.decode_step import c_silu_and_mul, decode_step_refusal, load_decode_step

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeviceSetup:
    linear_methods: dict[str, int]  # method name -> number of linear layers running it
    fused_ops: tuple[str, ...]  # the compiled ops in use (empty: eager passes)
    seconds: float
    decode_step_refusal: str | None  # why decode batches do not run the decoder layers in one C call; None: they do

    @property
    def decode_step(self) -> bool:
        return self.decode_step_refusal is None

    def describe(self) -> str:
        linear = ", ".join(f"{name} x{n}" for name, n in sorted(self.linear_methods.items()))
        return (f"linear {linear} | fused ops {', '.join(self.fused_ops) or 'off'}"
                f" | decode step {'C' if self.decode_step else 'python'}")


def setup_model_for_device(model: torch.nn.Module, device: torch.device, dtype: torch.dtype,
                           linear_method: str = "auto", fused_ops: bool = True) -> DeviceSetup:
    """Chooses and prepares every linear layer's method, and attaches the fused ops (CPU) or clears them."""
    start = time.perf_counter()
    counts = configure_linear_methods(model, device, dtype, linear_method)
    if device.type == "cpu":
        tile_packed_weights(model)
    ops = load_fused_ops(model.config, dtype, device) if fused_ops else None
    # NOTE: every choice is made first, then given to the model once through its setters (no attribute of a
    # layer is written twice): the fused ops, the SiLU-and-mul they run with, and the decoder.
    seam = hasattr(model, "set_decoder")
    if not seam:
        refusal = "this model has no decoder seam"
    elif device.type != "cpu":
        refusal = "the C decode step runs on the CPU only"
    else:
        refusal = decode_step_refusal(model, dtype, ops)
    model.set_fused_ops(ops, silu_and_mul_op=c_silu_and_mul(ops) if refusal is None else None)
    if seam:
        model.set_decoder(load_decode_step(model) if refusal is None else None)
    names = () if ops is None else tuple(
        op.name for op in (ops.add_rmsnorm, ops.rotary_kv, ops.silu_and_mul) if op is not None)
    return DeviceSetup(counts, names, time.perf_counter() - start, refusal)
