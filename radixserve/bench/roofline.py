"""The roofline of a forward step: what it must read and compute, and the least time this machine needs for it.

A step's cost is computed from the model config alone (`ModelConfig`), never measured:

- bytes: every decoder linear weight and the LM head read once per step at their stored dtype (`weight_bytes`: 2 for
  bf16 weights, 4 for float32), the KV each row attends to read once and the step's new KV written once, at the KV
  cache's dtype. Activations, norms and the embedding rows are left out (under 0.1% of a SmolLM2 step).
- FLOPs: 2 per multiply-add of the decoder's linear products (q/k/v, o, gate/up, down) over every row, of the LM head
  over the rows that are sampled (one per decode row; one per request of a prefill: the last token's logits), and of
  attention (q.k and p.v: 4 x q_size per attended token per row per layer; a prefill's causal pairs only; a
  sliding-window layer attends to its window at most).

The machine's rates (`MachineRates`) are measured at the start of a benchmark: the read bandwidth (torch.mv over a
1 GiB bf16 matrix, far beyond any cache) and torch's GEMM rate per compute dtype on the model's own layer shapes at
`GEMM_ROWS` rows. A step's bound is max(bytes / bandwidth, FLOPs / GEMM rate) (the classic roofline: whichever of
memory and arithmetic is the limit), and a figure's achieved fraction is its bound time over its measured time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

GEMM_ROWS = 512  # rows of the GEMM-rate probe: large enough for torch's GEMM to reach its rate on these shapes
GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class StepCost:
    """What a step (or a sum of steps) reads and computes."""

    weight_bytes: float = 0.0
    kv_bytes: float = 0.0
    linear_flops: float = 0.0  # the decoder layers' products
    head_flops: float = 0.0  # the LM head's
    attention_flops: float = 0.0

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes

    @property
    def flops(self) -> float:
        return self.linear_flops + self.head_flops + self.attention_flops

    def __add__(self, other: StepCost) -> StepCost:
        return StepCost(self.weight_bytes + other.weight_bytes, self.kv_bytes + other.kv_bytes,
                        self.linear_flops + other.linear_flops, self.head_flops + other.head_flops,
                        self.attention_flops + other.attention_flops)


def layer_params(cfg) -> int:
    """Weights of one decoder layer's linear products (q/k/v, o, gate/up, down)."""
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return hidden * (q_size + 2 * kv_size) + q_size * hidden + hidden * 2 * inter + inter * hidden


def head_params(cfg) -> int:
    """Weights of the LM head (the embedding itself where it is tied: still read once per step)."""
    return cfg.vocab_size * cfg.hidden_size


def weight_bytes(cfg, bytes_per_weight: float) -> float:
    """Bytes of the weights a forward reads once: every decoder linear layer and the LM head."""
    return (cfg.num_layers * layer_params(cfg) + head_params(cfg)) * bytes_per_weight


def _windows(cfg) -> list[int | None]:
    windows = getattr(cfg, "layer_windows", ()) or ()
    return list(windows) if windows else [None] * cfg.num_layers


def _kv_token_bytes(cfg, kv_bytes: float) -> float:
    """Bytes of one token's K and V in one layer."""
    return 2 * cfg.num_kv_heads * cfg.head_dim * kv_bytes


def decode_step(cfg, contexts: Sequence[int], bytes_per_weight: float, kv_bytes: float) -> StepCost:
    """One decode step of len(contexts) rows; `contexts[i]`: the tokens row i attends to, its new token included."""
    rows, q_size = len(contexts), cfg.num_heads * cfg.head_dim
    attended = sum(min(c, w) if w else c for w in _windows(cfg) for c in contexts)  # Σ over layers and rows
    return StepCost(weight_bytes=weight_bytes(cfg, bytes_per_weight),
                    kv_bytes=(attended + rows * cfg.num_layers) * _kv_token_bytes(cfg, kv_bytes),
                    linear_flops=2.0 * rows * cfg.num_layers * layer_params(cfg),
                    head_flops=2.0 * rows * head_params(cfg),
                    attention_flops=4.0 * q_size * attended)


def _causal_pairs(prefix: int, new: int, window: int | None) -> int:
    """(query, key) pairs of `new` tokens after `prefix` cached ones, each attending to itself and what precedes it."""
    if window is None:
        return new * prefix + new * (new + 1) // 2
    return sum(min(prefix + i, window) for i in range(1, new + 1))


def prefill(cfg, new_tokens: Sequence[int], bytes_per_weight: float, kv_bytes: float,
            prefixes: Sequence[int] | None = None) -> StepCost:
    """One prefill forward over requests of `new_tokens[i]` computed tokens after `prefixes[i]` cached ones (0 when
    omitted); the LM head runs on each request's last token only."""
    prefixes = list(prefixes) if prefixes is not None else [0] * len(new_tokens)
    q_size, tokens = cfg.num_heads * cfg.head_dim, sum(new_tokens)
    pairs = sum(_causal_pairs(p, n, w) for w in _windows(cfg) for p, n in zip(prefixes, new_tokens, strict=True))
    kv_tokens = cfg.num_layers * (sum(prefixes) + 2 * tokens)  # prefix and new K/V read once, new K/V written once
    return StepCost(weight_bytes=weight_bytes(cfg, bytes_per_weight), kv_bytes=kv_tokens * _kv_token_bytes(cfg, kv_bytes),
                    linear_flops=2.0 * tokens * cfg.num_layers * layer_params(cfg),
                    head_flops=2.0 * len(new_tokens) * head_params(cfg),
                    attention_flops=4.0 * q_size * pairs)


def decode_run(cfg, prompt_lens: Sequence[int], steps: int, bytes_per_weight: float, kv_bytes: float) -> StepCost:
    """`steps` decode steps of a batch of prompts whose prefill already produced the first token: step k attends to
    prompt + k tokens per row."""
    total = StepCost()
    for k in range(1, steps + 1):
        total = total + decode_step(cfg, [p + k for p in prompt_lens], bytes_per_weight, kv_bytes)
    return total


@dataclass(frozen=True)
class Formats:
    """How an engine stores and computes: the compute dtype and the bytes of a weight and of a KV element."""

    compute: str
    bytes_per_weight: float
    kv_bytes: float

    @classmethod
    def of(cls, compute: str, weights: str | None = None, kv: str | None = None) -> Formats:
        return cls(compute, DTYPE_BYTES[weights or compute], DTYPE_BYTES[kv or compute])

    @classmethod
    def of_runner(cls, runner) -> Formats | None:
        """A radixserve ModelRunner's formats; None for packed (quantized) weights, which this roofline leaves out."""
        from radixserve.layers.linear import linear_layers

        if any(layer.method.chosen_by_format for _, layer in linear_layers(runner.model)):
            return None
        choice = runner.dtype_choice
        kv = str(runner.token_to_kv_pool.dtype).removeprefix("torch.")
        return cls.of(choice.dtype, choice.weights, kv)

    def describe(self) -> str:
        return f"{self.compute} compute, {self.bytes_per_weight:g}-byte weights, {self.kv_bytes:g}-byte KV"


def workload_costs(cfg, fmt: Formats, requests: Iterable[tuple[int, int, int]], prefill_batches: int,
                   decode_batches: int) -> tuple[StepCost, StepCost]:
    """(prefill, decode) work of a served workload, from its requests' (prompt, cached, completion) tokens and the
    scheduler's batch counts: each batch reads the weights once; request r's k-th decode token attends to prompt + k
    tokens. Retractions and speculative steps are left out."""
    requests = list(requests)
    pre = prefill(cfg, [p - c for p, c, _ in requests], fmt.bytes_per_weight, fmt.kv_bytes, [c for _, c, _ in requests])
    pre = pre + StepCost(weight_bytes=max(prefill_batches - 1, 0) * pre.weight_bytes)
    dec = StepCost()
    for prompt, _, completion in requests:
        for k in range(1, completion):
            row = decode_step(cfg, [prompt + k], fmt.bytes_per_weight, fmt.kv_bytes)
            dec = dec + StepCost(kv_bytes=row.kv_bytes, linear_flops=row.linear_flops, head_flops=row.head_flops,
                                 attention_flops=row.attention_flops)
    if decode_batches:
        dec = dec + StepCost(weight_bytes=decode_batches * weight_bytes(cfg, fmt.bytes_per_weight))
    return pre, dec


@dataclass(frozen=True)
class MachineRates:
    """This machine's measured read bandwidth and GEMM rate per compute dtype."""

    read_gb_s: float
    gemm_gflops: Mapping[str, float] = field(default_factory=dict)  # compute dtype -> GFLOP/s

    def memory_s(self, cost: StepCost) -> float:
        return cost.bytes / (self.read_gb_s * 1e9)

    def compute_s(self, cost: StepCost, dtype: str) -> float:
        return cost.flops / (self.gemm_gflops[dtype] * 1e9)

    def seconds(self, cost: StepCost, dtype: str) -> float:
        """The roofline: the least time the step can take here."""
        return max(self.memory_s(cost), self.compute_s(cost, dtype))

    def limit(self, cost: StepCost, dtype: str) -> str:
        """Which roof binds: "memory" or "compute"."""
        return "memory" if self.memory_s(cost) >= self.compute_s(cost, dtype) else "compute"

    def describe(self) -> str:
        rates = ", ".join(f"{d} GEMM {g:.0f} GFLOP/s" for d, g in self.gemm_gflops.items())
        return f"read {self.read_gb_s:.1f} GB/s, {rates}"


def fraction(bound_s: float, measured_s: float) -> float:
    """The achieved fraction of the roofline: bound time over measured time (1.0: at the limit)."""
    return bound_s / measured_s if measured_s > 0 else 0.0


@dataclass(frozen=True)
class Figure:
    """A measured speed and its roofline: `rate` and `bound_rate` in tokens/s."""

    rate: float
    bound_rate: float
    limit: str

    @property
    def fraction(self) -> float:
        return self.rate / self.bound_rate if self.bound_rate else 0.0

    def cell(self) -> str:
        return f"{self.bound_rate:.0f} ({self.limit}), {self.fraction:.0%}"


def figure(rates: MachineRates, cost: StepCost, dtype: str, tokens: float, measured_s: float) -> Figure:
    """`tokens` produced (or prefilled) in `measured_s` seconds by work of `cost`, against its roofline."""
    bound = rates.seconds(cost, dtype)
    return Figure(tokens / measured_s if measured_s else 0.0, tokens / bound if bound else 0.0, rates.limit(cost, dtype))


# ---- measuring the machine -----------------------------------------------------------------------------------------

def best_seconds(fn: Callable[[], object], passes: int = 5) -> float:
    """The fastest of `passes` timed calls of `fn`, after one untimed warm-up call."""
    fn()
    best = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def torch_read_gb_s(gib: float = 1.0, passes: int = 10) -> float:
    """Read bandwidth as torch sees it: torch.mv over a bf16 matrix of `gib` GiB (the best of `passes`)."""
    import torch

    data = torch.ones(int(gib * GIB) // 2, dtype=torch.bfloat16).view(2**16, -1)
    vector = torch.ones(data.shape[1], dtype=torch.bfloat16)
    seconds = best_seconds(lambda: torch.mv(data, vector), passes)
    return data.numel() * 2 / seconds / 1e9


def layer_shapes(cfg) -> list[tuple[int, int]]:
    """(out, in) of one decoder layer's products, fused as radixserve runs them (qkv, o, gate_up, down)."""
    hidden, q_size, kv_size = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return [(q_size + 2 * kv_size, hidden), (hidden, q_size), (2 * cfg.intermediate_size, hidden),
            (hidden, cfg.intermediate_size)]


def gemm_gflops(cfg, dtype: str, rows: int = GEMM_ROWS, passes: int = 10) -> float:
    """torch's GEMM rate in `dtype` over one decoder layer's shapes at `rows` rows (the best of `passes`)."""
    import torch

    torch_dtype = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    pairs = [(torch.randn(rows, k, generator=g).to(torch_dtype), torch.randn(n, k, generator=g).to(torch_dtype))
             for n, k in layer_shapes(cfg)]
    flops = sum(2.0 * rows * n * k for n, k in layer_shapes(cfg))

    def run() -> None:
        with torch.inference_mode():
            for x, w in pairs:
                torch.nn.functional.linear(x, w)

    return flops / best_seconds(run, passes) / 1e9


def measure_rates(cfg, dtypes: Iterable[str]) -> MachineRates:
    """The read bandwidth and the GEMM rate per compute dtype, with torch's current thread count."""
    return MachineRates(torch_read_gb_s(), {d: gemm_gflops(cfg, d) for d in dict.fromkeys(dtypes)})
