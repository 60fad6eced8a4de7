"""Gives a loaded model its part of the execution plan: linear methods, packed-weight tiling, fused ops, decoder.

Nothing here decides: every choice is the plan's (model_executor/execution_plan.py). The model receives each
part once through its setters, so no attribute of a layer is written twice.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from radixserve.layers.bf16_weights import keep_prefill_copies
from radixserve.layers.linear import linear_layers
from radixserve.layers.linear_tuning import apply_linear_plan
from radixserve.layers.quantization.model_quant import tile_packed_weights
from radixserve.model_executor.deterministic import FLAG, DeterminismUnavailable
from radixserve.models.c_decoder import load_c_decoder
from radixserve.models.prefill_passes import c_prefill_passes

if TYPE_CHECKING:
    from radixserve.model_executor.execution_plan import ExecutionPlan


@dataclass(frozen=True)
class DeviceSetup:
    linear_methods: dict[str, int]  # method name -> number of linear layers running it
    fused_ops: bool  # the compiled passes are attached (else eager torch)
    c_decoder: bool  # decode batches run the decoder layers in one C call
    seconds: float

    def describe(self) -> str:
        linear = ", ".join(f"{name} x{n}" for name, n in sorted(self.linear_methods.items()))
        return (f"linear {linear} | fused ops {'on' if self.fused_ops else 'off'}"
                f" | decoder {'C' if self.c_decoder else 'python'}")


def setup_model_for_device(model: torch.nn.Module, device: torch.device, plan: ExecutionPlan) -> DeviceSetup:
    """Applies the plan's linear methods, tiles packed weights for their kernels (CPU), then attaches the fused
    ops and the decoder (the C decoder over the model's weight view where the plan chose it)."""
    start = time.perf_counter()
    counts = apply_linear_plan(model, dict(plan.linear_methods), dict(plan.large_rows))
    for _, layer in linear_layers(model):
        layer.method.rows = plan.rows  # NOTE: every kernel switch reads the plan's one row table
    if plan.prefill_copy_bytes:
        keep_prefill_copies(model)
    if device.type == "cpu":
        tile_packed_weights(model)
    c_decoder = plan.decoder_refusal is None
    ops = plan.fused_ops
    # NOTE: where the C decoder runs, prefill's row passes are its loops (they replace fused ops: none, none here)
    every = plan.deterministic
    # NOTE: set either way: a loaded model reused by another runner keeps its methods (one mode per loaded model
    # at a time). The plan chose methods with row kernels; packed layers have theirs once tiled (above).
    for name, layer in linear_layers(model):
        if not layer.method.use_row_kernel_everywhere(every):
            raise DeterminismUnavailable(f"{FLAG}: layer {name} ({layer.method.describe()}) has no row kernel")
    passes = c_prefill_passes(ops, model.config.rms_norm_eps, every, plan.rows) if c_decoder and ops is not None else None
    model.set_fused_ops(ops, passes)
    model.set_decoder(load_c_decoder(model.decoder_weights(), plan.dtype, every, plan.rows) if c_decoder else None)
    return DeviceSetup(counts, ops is not None, c_decoder, time.perf_counter() - start)
