"""Deterministic (batch-invariant) inference: what `--enable-deterministic-inference` switches, decided once.

A token's numbers must not depend on what else runs: how many rows a forward has, where the token's row sits,
how its prompt was split into chunks, whether its prefix came from the radix cache, which event loop ran it, or
whether speculation verified it. The mode gets that by running every forward through one computation per row:

- every forward's tokens go through the C decoder (models/c_decoder.py) as rows, a prompt chunk too: the
  token at position p attends over its request's slots 0 .. p with the decode attention kernel, which walks them in
  order for that row alone; the step's norm, rotary and SiLU loops are per row;
- every linear layer multiplies with its method's row kernel at every row count (f32_gemv, bf16w_gemv, the tiled
  integer kernel): each output's sum runs over the input in one order whatever rows share the pass. Where the fast
  path would switch at a row count (oneDNN for a prefill chunk, the widened bf16 copy, the expanded integer weight)
  the mode stays on the row kernel;
- no cascade (a prefix the whole batch shares would be attended once for all rows, in other pieces);
- the final norm runs the step's C row loop at every row count (the compiled op below 64 rows would round a
  decode batch's norm otherwise than a prompt's).

Sampling needs nothing: a seeded request draws from (seed, output index) (layers/sampler.py).
"""

from __future__ import annotations

import torch

FLAG = "--enable-deterministic-inference"


class DeterminismUnavailable(ValueError):
    """The mode was asked for where it cannot hold; the message says why."""


def deterministic_linear_method(requested: str, device: torch.device, dtype: torch.dtype, weights: str | None) -> str:
    """The linear method of float weights in the mode: the one `--dtype auto` chose for bf16 weights, else the
    float32 GEMV; an explicitly asked method must have a row kernel."""
    if device.type != "cpu":
        raise DeterminismUnavailable(f"{FLAG} runs on the CPU (its row kernels are C kernels); not on {device.type}")
    from radixserve.layers.bf16_weights import Bf16WeightLinearMethod
    from radixserve.layers.f32_gemv import F32GemvLinearMethod

    if requested in (Bf16WeightLinearMethod.name, F32GemvLinearMethod.name):
        return requested
    if requested == "auto" and dtype == torch.float32:
        return Bf16WeightLinearMethod.name if weights == "bfloat16" else F32GemvLinearMethod.name
    compute = str(dtype).removeprefix("torch.")
    raise DeterminismUnavailable(
        f"{FLAG}: linear method {requested!r} under {compute} compute has no kernel whose row sums are the same at "
        "every row count; the mode runs float32 compute (--dtype float32 or auto on a CPU without bf16 products) "
        "with --linear-method auto, f32_gemv or bf16_weights")


def check_deterministic(decoder_refusal: str | None, windows: tuple[int, ...]) -> None:
    """Raises DeterminismUnavailable where a forward of this model could not run as rows of the C decoder."""
    if windows:
        raise DeterminismUnavailable(f"{FLAG}: sliding-window layers ({', '.join(map(str, windows))}) are not covered")
    if decoder_refusal is not None:
        raise DeterminismUnavailable(f"{FLAG} runs every forward in the C decoder, which does not run here: "
                                     f"{decoder_refusal}")


def deterministic_entry(on: bool) -> tuple[str, str]:
    """The plan's entry for the mode: (choice, reason)."""
    if not on:
        return "off", f"{FLAG} not given: kernels chosen per row count for speed"
    return "on", ("every forward's tokens as rows of the C decoder (prompt chunks too: the decode attention "
                  "kernel per token), each linear layer's row kernel at every row count, no cascade, the final "
                  "norm's C loop at every row count: a request's logprobs are the same bits in any batch, "
                  "chunking, cache state, loop or speculation")
