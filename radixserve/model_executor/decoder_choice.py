"""The C decoder or the Python layers, as a whole choice: a decode step's cost both ways, from the timed products.

Timing picks a linear method shape by shape, but the C decoder needs every decoder shape on a method it can call
(in float32: `f32_gemv`). Where timing picked another method for some shape (dense a few percent faster at 512
rows, say), running the C decoder means giving that shape `f32_gemv` too, and the plan must compare the two whole
choices, not one shape:

- the C decoder: every decoder product at 1 row (batch-1 decode) with `f32_gemv`;
- the Python layers: every product with the method timing chose for its shape, plus the Python layers' own calls
  (`PYTHON_CALLS_PER_LAYER` calls of `PYTHON_CALL_S` each, per layer and step).

Both from the per-shape timings the linear tuning cached on this machine (layers/linear_tuning.py), so nothing
new is timed. The prefill side (512 rows, where `f32_gemv` runs oneDNN's product) is reported beside it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

import torch

# NOTE: measured on a 2-core AVX2 EPYC (SmolLM2-135M, float32): a decoder layer's Python path makes ~10 calls
# (norms, rotary + KV write, attention, activation, products) of 25-40 us each once the weight stream has evicted
# their code; batch-1 decode ran at 27 tokens/s in the Python layers against 81 in the C decoder (30 layers)
PYTHON_CALLS_PER_LAYER = 10
PYTHON_CALL_S = 30e-6
Shape = tuple[int, int]


@dataclass(frozen=True)
class DecoderTrade:
    """A decode step's decoder products (and the Python calls) both ways, seconds; prefill's products at 512 rows."""

    c_step_s: float
    python_step_s: float
    c_prefill_s: float | None
    python_prefill_s: float | None

    @property
    def c_wins(self) -> bool:
        return self.c_step_s < self.python_step_s

    def describe(self) -> str:
        text = (f"a batch-1 decode step, estimated from the timed products: {self.c_step_s * 1e3:.2f} ms in the C "
                f"decoder against {self.python_step_s * 1e3:.2f} ms in the Python layers "
                f"({PYTHON_CALLS_PER_LAYER} calls of ~{PYTHON_CALL_S * 1e6:.0f} us per layer included)")
        if self.c_prefill_s is not None and self.python_prefill_s is not None:
            text += (f"; a 512-token prefill's products {self.c_prefill_s * 1e3:.1f} ms against "
                     f"{self.python_prefill_s * 1e3:.1f} ms")
        return text


def decoder_trade(shapes: Counter[Shape], chosen: Mapping[Shape, str], c_method: str, num_layers: int,
                  dtype: torch.dtype) -> DecoderTrade | None:
    """The two choices' costs: `shapes` counts the decoder's products per weight shape, `chosen` is timing's method
    per shape, `c_method` the one the C decoder would use on all of them. None where a shape has no cached timing
    of both methods at 1 row (timing did not run: a forced --linear-method, one candidate)."""
    from radixserve import envs
    from radixserve.layers.linear_tuning import CACHE_FILE, TimingCache, cache_key

    cache = TimingCache(envs.CACHE_DIR.get() / CACHE_FILE)
    c_step = python_step = 0.0
    c_prefill: float | None = 0.0
    python_prefill: float | None = 0.0
    for shape, count in shapes.items():
        timings = cache.get(cache_key(shape, dtype)) or []
        at = {(t.method, t.tokens): t.seconds for t in timings}
        mine, theirs = (c_method, 1), (chosen.get(shape, c_method), 1)
        if mine not in at or theirs not in at:
            return None
        c_step += count * at[mine]
        python_step += count * at[theirs]
        big_mine, big_theirs = (c_method, 512), (chosen.get(shape, c_method), 512)
        if c_prefill is not None and python_prefill is not None and big_mine in at and big_theirs in at:
            c_prefill += count * at[big_mine]
            python_prefill += count * at[big_theirs]
        else:
            c_prefill = python_prefill = None
    python_step += num_layers * PYTHON_CALLS_PER_LAYER * PYTHON_CALL_S
    return DecoderTrade(c_step, python_step, c_prefill, python_prefill)
