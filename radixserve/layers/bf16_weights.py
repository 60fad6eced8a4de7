"""float32 compute over bfloat16 weights, for CPUs without bf16 products (AVX2, AVX-512 without BF16).

A decode step reads every weight once, and on such a CPU `--dtype bfloat16` is slow (its products are
emulated) while float32 reads twice the bytes. This method keeps each weight in bfloat16 (half the bytes;
what `--dtype bfloat16` keeps on a CPU with bf16 products) and computes in float32: csrc/bf16w_gemv.c widens
the weight in registers up to `RowTable.bf16_weights_rows` rows; above (a prefill chunk) the weight is widened into a float32
scratch for one float32 product (oneDNN's; `prefill_product`), written straight in the blocked order oneDNN
multiplies from, so oneDNN does not reorder it again. Measured on one core forced to AVX2 (ATen, MKL and oneDNN
too) against the faster of float32 `F.linear` and oneDNN (benchmarks/bench_bf16_weights.py): 1.1-2.4x faster at
1-32 rows, even at 64, 0.8-0.9x at 128-256, 0.92-0.98x at 1,024.

Where the plan allows it (`plan_prefill_copies`: the copies fit RADIXSERVE_BF16W_PREFILL_COPY_MB), each decoder
layer also keeps its weight widened once into that blocked order (`keep_prefill_copy`), and a prefill chunk
multiplies by it without widening: decode still reads the bf16 weight, prefill skips the per-chunk widening (2-6% of
a cold prefill of SmolLM2 at the AVX2 and AVX-512 classes), for 4 more bytes per weight.

It changes the model's numbers (weights rounded to bf16), so timing never picks it (`rounds_weights`): the
dtype choice does (`--dtype auto`, platform.py) or `--linear-method bf16_weights`.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Mapping

import torch
import torch.nn.functional as F

from radixserve.kernels.gemv import (
    BF16W_TILE,
    Bf16WeightGemv,
    load_bf16w_kernel,
    onednn_view,
    pack_gemv_weight,
    unpack_gemv_weight,
)
from radixserve.layers.linear import LinearBase, LinearMethod, register_linear_method, tunable_layers

WIDEN_MAX_ELEMENTS = 64 << 20  # larger weights (an LM head asked for many rows of logits) stay on the kernel
BLOCKED_HINT = 1024  # the rows oneDNN is told to pack a weight for (its order held for 256-2,048 rows alike)


class WidenScratch(threading.local):
    """This thread's float32 buffers that each layer's widened weight is written into in turn (a forward runs its
    layers one at a time on one thread): one plain buffer grown to the largest weight, and one oneDNN packed weight
    per weight shape (the blocked order). NOTE: a fresh tensor of tens of MB per product cost more in page faults
    than the widening itself."""

    def __init__(self) -> None:
        self.buffer = torch.empty(0, dtype=torch.float32)
        self.blocked: dict[tuple[int, int], torch.Tensor] = {}

    def take(self, elements: int) -> torch.Tensor:
        """At least `elements` floats, valid until this thread's next `take`."""
        if self.buffer.numel() < elements:
            self.buffer = torch.empty(elements, dtype=torch.float32)
        return self.buffer

    def take_blocked(self, n: int, k: int) -> torch.Tensor:
        """oneDNN's packed float32 weight for an [n, k] layer (an opaque mkldnn tensor), whose bytes the caller
        overwrites; valid until this thread's next `take_blocked` of the same shape."""
        weight = self.blocked.get((n, k))
        if weight is None:
            weight = self.blocked[(n, k)] = blocked_weight(n, k)
        return weight


def blocked_weight(n: int, k: int) -> torch.Tensor:
    """A oneDNN packed float32 weight for an [n, k] layer (opaque mkldnn tensor, zeros), whose bytes a caller
    overwrites through its data pointer with `Bf16WeightGemv.widen_blocked`."""
    return torch.ops.mkldnn._reorder_linear_weight(torch.zeros(n, k), BLOCKED_HINT)


SCRATCH = WidenScratch()


def prefill_product(kernel: Bf16WeightGemv, packed: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None,
                    n: int, copy: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W.T + bias in float32 for a prefill chunk: over `copy` (the layer's resident blocked float32 copy) if
    given, else W the packed bf16 weight widened into this thread's scratch: in oneDNN's blocked order where
    `prefill_path` says so, else in plain [n, K] order for `dense_product`."""
    if copy is not None:
        return torch.ops.mkldnn._linear_pointwise(x, copy, bias, "none", [], "")
    k = x.shape[1]
    if prefill_path(n, k) == "blocked":
        weight = SCRATCH.take_blocked(n, k)
        kernel.widen_blocked(packed, n, torch.ops.mkldnn.data_ptr(weight))
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return dense_product(x, kernel.widen(packed, n, SCRATCH.take(n * k)), bias)


def dense_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias in float32 over a plain widened weight: oneDNN's product (it reorders the weight into its
    blocked order itself) measured 0.75-1.02x F.linear's (MKL) time at the AVX2 class on decoder shapes, 256 and
    1,024 rows (benchmarks/bench_bf16_weights.py --prefill); F.linear where oneDNN is absent or turned off."""
    if prefill_path(*weight.shape) != "linear":
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


@functools.cache
def prefill_path(n: int, k: int) -> str:
    """How a prefill chunk multiplies an [n, k] bf16 weight: "blocked" (widened in oneDNN's blocked order: 0.91-1.0x
    the time of "onednn" per product on SmolLM2's and Qwen2.5-1.5B's layers at 256-1,024 rows, AVX2 class, 2 threads;
    0.80-0.90x on SmolLM2's while the VM's memory read slow), "onednn" (widened plain, oneDNN reorders it), or
    "linear" (F.linear: oneDNN absent or
    RADIXSERVE_BF16W_ONEDNN_PREFILL=0). "blocked" needs oneDNN to ask for the order bf16w_unpack_blocked writes,
    checked once per shape (`blocked_order_holds`), and RADIXSERVE_BF16W_BLOCKED_PREFILL on."""
    from radixserve import envs

    if not (envs.BF16W_ONEDNN_PREFILL.get() and torch.backends.mkldnn.is_available()):
        return "linear"
    return "blocked" if envs.BF16W_BLOCKED_PREFILL.get() and blocked_order_holds(n, k) else "onednn"


def copy_bytes(n: int, k: int) -> int:
    """Bytes of an [n, k] weight's float32 copy in oneDNN's blocked order (rows padded to 64)."""
    return -(-n // 64) * 64 * k * 4


def copy_budget() -> int:
    """RADIXSERVE_BF16W_PREFILL_COPY_MB in bytes; by default an eighth of the machine's memory, at most 2 GiB."""
    from radixserve import envs

    mb = envs.BF16W_PREFILL_COPY_MB.get()
    if mb >= 0:
        return mb << 20
    return min(2 << 30, os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 8)


def _decoder_layers(model: torch.nn.Module) -> list[LinearBase]:
    """The float linear layers a prefill chunk runs at its full row count (the LM head sees the last rows only)."""
    return [layer for name, layer in tunable_layers(model) if name.rsplit(".", 1)[-1] != "lm_head"]


def plan_prefill_copies(model: torch.nn.Module, methods: Mapping[tuple[int, int], str]) -> tuple[int, str]:
    """Whether the decoder layers planned on this method keep resident blocked float32 copies for prefill: their
    bytes (0: no copies) and why."""
    shapes = [layer.shape for layer in _decoder_layers(model) if methods.get(layer.shape) == Bf16WeightLinearMethod.name]
    if not shapes:
        return 0, "no decoder layer keeps bf16 weights under float32 compute"
    total, budget = sum(copy_bytes(n, k) for n, k in shapes), copy_budget()
    if budget == 0:
        return 0, "RADIXSERVE_BF16W_PREFILL_COPY_MB=0: each prefill chunk widens the weights"
    if any(prefill_path(n, k) != "blocked" for n, k in set(shapes)):
        return 0, "prefill widens in plain order here (oneDNN's blocked order not confirmed, or switched off)"
    if total > budget:
        return 0, (f"the copies would take {mb(total)}, over the {mb(budget)} budget "
                   "(RADIXSERVE_BF16W_PREFILL_COPY_MB): each prefill chunk widens the weights")
    return total, (f"blocked float32 copies of the decoder weights within the {mb(budget)} budget "
                   "(RADIXSERVE_BF16W_PREFILL_COPY_MB): prefill chunks skip widening them")


def mb(size: int) -> str:
    """Bytes as the plan shows them."""
    return f"{size / 2**20:.1f} MB"


def blocked_order_holds(n: int, k: int) -> bool:
    """Whether oneDNN packs a float32 [n, k] linear weight as [ceil(n / 64)][k][64], zero rows past n (what
    bf16w_unpack_blocked writes): weights holding each element's row + 1, then its column + 1 (exact in float32),
    packed and read back."""
    blocks = -(-n // 64)
    rows = torch.arange(1, n + 1, dtype=torch.float32)[:, None].expand(n, k)
    cols = torch.arange(1, k + 1, dtype=torch.float32)[None, :].expand(n, k)
    for probe in (rows, cols):
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(probe.contiguous(), BLOCKED_HINT)
            if torch.ops.mkldnn._nbytes(packed) != blocks * 64 * k * 4:
                return False
            got = onednn_view(packed, torch.float32)
        except (RuntimeError, AttributeError):  # no such op in this build, or oneDNN refused the shape
            return False
        want = torch.zeros(blocks * 64, k)
        want[:n] = probe
        if not torch.equal(got, want.view(blocks, 64, k).transpose(1, 2).reshape(-1)):
            return False
    return True


class Bf16WeightLinearMethod(LinearMethod):
    name = "bf16_weights"
    rounds_weights = True

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype) -> bool:
        return device.type == "cpu" and dtype == torch.float32 and load_bf16w_kernel() is not None

    def __init__(self) -> None:
        self.packed: torch.Tensor | None = None
        self.prefill_copy: torch.Tensor | None = None  # oneDNN's blocked float32 weight (keep_prefill_copy)
        self.every_row = False  # deterministic inference: bf16w_gemv at every row count

    def use_row_kernel_everywhere(self, on: bool = True) -> bool:
        # NOTE: bf16w_gemv.c adds each output's products pair by pair in input order, for one row or a group of rows
        self.every_row = on
        return True

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        self.packed = pack_gemv_weight(layer.weight.detach().to(torch.bfloat16), BF16W_TILE)
        self.kernel = load_bf16w_kernel()

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).contiguous().to(torch.float32)
        n = layer.out_features
        if not self.every_row and flat.shape[0] > self.rows.bf16_weights_rows and self.packed.numel() <= WIDEN_MAX_ELEMENTS:
            # NOTE: the widened weight lives in this thread's scratch until its next layer's product
            y = prefill_product(self.kernel, self.packed, flat, layer.bias, n, self.prefill_copy)
        else:
            y = self.kernel(self.packed, flat, layer.bias, n)
        return y.view(*x.shape[:-1], n).to(x.dtype)

    def keep_prefill_copy(self, layer: LinearBase) -> None:
        """Widens the weight once into a resident packed float32 weight in oneDNN's blocked order (where
        `prefill_path` is "blocked"), which prefill chunks then multiply by instead of widening it each time."""
        n, k = layer.out_features, layer.in_features
        copy = blocked_weight(n, k)
        self.kernel.widen_blocked(self.packed, n, torch.ops.mkldnn.data_ptr(copy))
        self.prefill_copy = copy

    def c_linear(self, rows: int, dtype: torch.dtype) -> int | None:
        usable = 0 < rows and (self.every_row or rows <= self.rows.bf16_weights_rows) and dtype == torch.float32 and self.packed is not None
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
        forms = {} if self.packed is None else {id(self.packed): self.packed.numel() * self.packed.element_size()}
        if self.prefill_copy is not None:
            forms[id(self.prefill_copy)] = torch.ops.mkldnn._nbytes(self.prefill_copy)
        return forms

    def describe(self) -> str:
        return f"{self.name} ({self.kernel.level})" if self.packed is not None else self.name

    def row_kernels(self, in_features: int, large_rows: frozenset[int] = frozenset()) -> str:
        kernel = load_bf16w_kernel()
        if self.every_row:
            return f"bf16w_gemv ({kernel.level}) at every row count (deterministic inference)"
        last = self.rows.bf16_weights_rows
        return (f"bf16w_gemv ({kernel.level}, prefetch {kernel.prefetch}) at 1-{last} rows, a float32 copy (in oneDNN's "
                f"blocked order where it holds) and oneDNN from {last + 1}")


def keep_prefill_copies(model: torch.nn.Module) -> int:
    """Gives every decoder layer on this method its resident prefill copy (the plan's `prefill_copy_bytes` said
    they fit); returns how many."""
    layers = [layer for layer in _decoder_layers(model) if isinstance(layer.method, Bf16WeightLinearMethod)]
    for layer in layers:
        layer.method.keep_prefill_copy(layer)
    return len(layers)


register_linear_method(Bf16WeightLinearMethod)
