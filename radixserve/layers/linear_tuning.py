"""Choosing a linear method per weight shape by measuring the candidates here, once per machine.

For each weight shape of the model, every method that supports the device and dtype is timed at a
few token counts (one decode row, a decode batch, a prefill chunk) on a random weight of that shape;
the method with the lowest summed time relative to the best at each count wins. Timing runs on one
thread: which method is faster is a property of the kernels, and on a machine shared with other work
a second OpenMP thread waits for a core whenever another process holds it (milliseconds per call),
which would decide the choice by the load of the moment. Results are kept in
$RADIXSERVE_CACHE_DIR/linear_methods.json, keyed by torch's version, the CPU's capability, the dtype
and the shape, so later starts only read the file.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from radixserve import envs
from radixserve.configs.row_table import DEFAULT_ROWS, RowTable
from radixserve.layers import bf16_weights, f32_gemv, gemv  # noqa: F401 (register their linear methods)
from radixserve.layers.linear import (
    AUTO,
    LINEAR_METHODS,
    DenseLinearMethod,
    LinearBase,
    OneDNNLinearMethod,
    process_weights_after_loading,
    tunable_layers,
)

logger = logging.getLogger(__name__)

TOKEN_COUNTS = (1, 32, 512)  # batch-1 decode, batch-32 decode, a prefill chunk
# NOTE: the LM head multiplies one row per sampled sequence (a prefill computes the last token's logits only), so
# a shape that only LM heads have is timed at decode's counts: at 512 rows the vocabulary-sized product was ~90% of
# a first start's timing (34 s of 37 on Qwen2.5-0.5B's 151936x896 in bf16 on a 2-core Zen 4)
LM_HEAD_TOKEN_COUNTS = (1, 32)
CALLS_PER_POINT = 9
# NOTE: a method stops being called at a point once it has spent this long there (after at least MIN_CALLS timed
# calls): a vocabulary-sized weight's calls take 50-300 ms each, and their minimum settles in two or three
POINT_BUDGET_S = 0.3
MIN_CALLS = 2
TIMED_OUT_FEATURES = 32768
CACHE_FILE = "linear_methods.json"
Shape = tuple[int, int]  # (out_features, in_features)


@dataclass(frozen=True)
class Timing:
    method: str
    tokens: int
    seconds: float  # fastest of CALLS_PER_POINT calls (fewer where they take long: POINT_BUDGET_S)

    def gflops(self, shape: Shape) -> float:
        return 2 * self.tokens * shape[0] * shape[1] / self.seconds / 1e9


def configure_linear_methods(model: torch.nn.Module, device: torch.device, dtype: torch.dtype,
                             requested: str = AUTO) -> dict[str, int]:
    """Plans (`plan_linear_methods`, `plan_large_rows`) and applies (`apply_linear_plan`) in one call; returns
    how many layers each method got."""
    methods = plan_linear_methods(model, device, dtype, requested)
    return apply_linear_plan(model, methods, plan_large_rows(model, methods, dtype))


def plan_linear_methods(model: torch.nn.Module, device: torch.device, dtype: torch.dtype,
                        requested: str = AUTO, rows: RowTable = DEFAULT_ROWS) -> dict[Shape, str]:
    """The method of each float weight shape of `model`: `requested`, or the fastest measured here (auto)."""
    shapes = sorted({layer.shape for _, layer in tunable_layers(model)})
    if requested == AUTO:
        return choose_methods(shapes, device, dtype, lm_head_only_shapes(model), rows)
    if requested not in LINEAR_METHODS:
        raise ValueError(f"unknown linear method {requested!r}; available: {', '.join(sorted(LINEAR_METHODS))}")
    if not LINEAR_METHODS[requested].supports(device, dtype):
        raise ValueError(f"linear method {requested!r} does not run on {device.type} in {dtype}")
    return dict.fromkeys(shapes, requested)


def apply_linear_plan(model: torch.nn.Module, methods: dict[Shape, str],
                      large: dict[Shape, frozenset[int]]) -> dict[str, int]:
    """Gives every float linear layer its planned method (and the GEMV method its large-product rows)."""
    counts = process_weights_after_loading(model, methods)
    for _, layer in tunable_layers(model):
        if isinstance(layer.method, gemv.GemvLinearMethod):
            layer.method.large_rows = large.get(layer.shape, frozenset())
    return counts


LARGE_CALLS = 3
LARGE_MARGIN = 1.05  # the large AMX product must beat oneDNN by this much to take a row count
LARGE_MAX_WEIGHT = 8 << 20  # elements; larger weights (the LM head) keep oneDNN above decode sizes


def plan_large_rows(model: torch.nn.Module, methods: dict[Shape, str], dtype: torch.dtype) -> dict[Shape, frozenset[int]]:
    """For shapes planned on `onednn_gemv` on AMX CPUs: the LARGE_GRID row counts at which our large AMX product
    beats oneDNN's, timed per weight shape (on a random weight of that shape) at the thread count the model runs
    with (oneDNN decides itself how many threads a product gets, and for some shapes near 1,000 rows it takes
    one: that is what this finds), cached like the methods."""
    shapes = sorted(shape for shape, name in methods.items() if name == gemv.GemvLinearMethod.name
                    and shape[0] * shape[1] <= LARGE_MAX_WEIGHT and gemv.has_large_product(shape[1]))
    if not shapes:
        return {}
    cache = TimingCache(envs.CACHE_DIR.get() / CACHE_FILE)
    planned = {}
    for shape in shapes:
        key = f"{cache_key(shape, dtype)} | large, {torch.get_num_threads()} threads"
        timings = cache.get(key)
        if timings is None or {t.tokens for t in timings} != set(gemv.LARGE_GRID):
            logger.info("timing the large AMX product against oneDNN for weight %dx%d (first start only)", *shape)
            timings = _time_large(_layer_with(gemv.GemvLinearMethod.name, (torch.randn(*shape) * 0.02).to(dtype)))
            cache.put(key, timings)
        planned[shape] = large_rows(timings)
    return planned


def large_rows(timings: list[Timing]) -> frozenset[int]:
    onednn = {t.tokens: t.seconds for t in timings if t.method == "onednn"}
    return frozenset(t.tokens for t in timings if t.method == "amx_large" and t.seconds * LARGE_MARGIN < onednn[t.tokens])


def _time_large(layer: LinearBase) -> list[Timing]:
    method, timings = layer.method, []
    kernels = {"onednn": lambda x: OneDNNLinearMethod.apply(method, layer, x),
               "amx_large": lambda x: method.large(method.gemv_weight, x, layer.bias, layer.out_features)}
    with torch.inference_mode():
        for rows in gemv.LARGE_GRID:
            x = torch.randn(rows, layer.in_features).to(method.gemv_weight.dtype)
            best = dict.fromkeys(kernels, float("inf"))
            for round_ in range(LARGE_CALLS + 1):
                for name, run in kernels.items():
                    start = time.perf_counter()
                    run(x)
                    if round_:
                        best[name] = min(best[name], time.perf_counter() - start)
            timings += [Timing(name, rows, seconds) for name, seconds in best.items()]
    return timings


def candidates(device: torch.device, dtype: torch.dtype) -> list[str]:
    """The methods timing may choose from: those that run here and keep the weights' values."""
    return [name for name, cls in LINEAR_METHODS.items() if not cls.rounds_weights and cls.supports(device, dtype)]


def lm_head_only_shapes(model: torch.nn.Module) -> frozenset[Shape]:
    """The weight shapes that no layer but an LM head has (timed at decode's row counts only)."""
    heads, others = set(), set()
    for name, layer in tunable_layers(model):
        (heads if name.rsplit(".", 1)[-1] == "lm_head" else others).add(layer.shape)
    return frozenset(heads - others)


def choose_methods(shapes: list[Shape], device: torch.device, dtype: torch.dtype,
                   decode_only: frozenset[Shape] = frozenset(), rows: RowTable = DEFAULT_ROWS) -> dict[Shape, str]:
    """The fastest method of each shape, measured here once (cached); `decode_only` shapes at decode's rows."""
    names = candidates(device, dtype)
    if len(names) <= 1 or device.type != "cpu":
        return dict.fromkeys(shapes, names[0] if names else DenseLinearMethod.name)
    cache = TimingCache(envs.CACHE_DIR.get() / CACHE_FILE)
    chosen = {}
    for shape in shapes:
        key = cache_key(shape, dtype)
        timings = cache.get(key)
        if timings is None or {t.method for t in timings} != set(names):
            logger.info("measuring linear methods %s for weight %dx%d (%s; first start only)",
                        "/".join(names), shape[0], shape[1], str(dtype).removeprefix("torch."))
            timings = measure(shape, names, dtype, LM_HEAD_TOKEN_COUNTS if shape in decode_only else TOKEN_COUNTS)
            cache.put(key, timings)
        chosen[shape] = best_method(timings, rows)
    return chosen


TIE_MARGIN = 0.05  # scores within 5% of the best are a tie, broken by LinearMethod.preference


def best_method(timings: list[Timing], rows: RowTable = DEFAULT_ROWS) -> str:
    """The method with the lowest sum of (its time / the best time) over the token counts; among methods within
    TIE_MARGIN of it, the most preferred. NOTE: `onednn_gemv` runs the very same oneDNN product as `onednn` above
    its decode rows, so at the prefill point their times differ by noise alone; on Qwen2.5-1.5B's 2048x1536 qkv
    shape that noise picked `onednn` by 0.2%, and one such layer turns the C decoder off for the model. A wider
    noise event did it again (Qwen2.5-0.5B's 9728x896 on the AMX Xeon: 7.15 ms against 5.63 at 512 rows, cached;
    timed again, 5.4-5.6 ms both), so above its decode rows `onednn_gemv` is credited with the faster of the two
    times: only the decode rows, where they run different kernels, decide between them."""
    timings = _same_product_above_decode_rows(timings, rows)
    best_at = {n: min(t.seconds for t in timings if t.tokens == n) for n in {t.tokens for t in timings}}
    score: dict[str, float] = {}
    for t in timings:
        score[t.method] = score.get(t.method, 0.0) + t.seconds / best_at[t.tokens]
    lowest = min(score.values())
    tied = [name for name, value in score.items() if value <= lowest * (1 + TIE_MARGIN)]
    return max(tied, key=lambda name: (_preference(name), -score[name]))


def _same_product_above_decode_rows(timings: list[Timing], rows: RowTable) -> list[Timing]:
    """`onednn_gemv`'s timings with each count above its decode rows set to the faster of its and `onednn`'s."""
    onednn = {t.tokens: t.seconds for t in timings if t.method == OneDNNLinearMethod.name}
    decode_rows = max(rows.amx_rows, rows.bf16_gemv_rows)
    return [Timing(t.method, t.tokens, min(t.seconds, onednn[t.tokens]))
            if t.method == gemv.GemvLinearMethod.name and t.tokens > decode_rows and t.tokens in onednn else t
            for t in timings]


def _preference(name: str) -> int:
    method = LINEAR_METHODS.get(name)
    return 0 if method is None else method.preference


def measure(shape: Shape, names: list[str], dtype: torch.dtype,
            token_counts: tuple[int, ...] = TOKEN_COUNTS) -> list[Timing]:
    """The fastest of CALLS_PER_POINT calls of each method at each token count, the methods' calls
    interleaved so that load from other processes hits them alike."""
    out_features, in_features = shape
    # NOTE: every candidate tiles over the output features, so a vocabulary-sized weight is timed on its first
    # TIMED_OUT_FEATURES rows: the same comparison, for a fifth of the set-up (random weight, packing, copies)
    weight = torch.randn(min(out_features, TIMED_OUT_FEATURES), in_features, dtype=dtype) * 0.02
    layers = {name: _layer_with(name, weight) for name in names}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _interleaved(layers, names, in_features, dtype, token_counts)
    finally:
        torch.set_num_threads(threads)


def _interleaved(layers: dict[str, LinearBase], names: list[str], in_features: int, dtype: torch.dtype,
                 token_counts: tuple[int, ...]) -> list[Timing]:
    timings = []
    with torch.inference_mode():
        for tokens in token_counts:
            x = torch.randn(tokens, in_features).to(dtype)
            best = dict.fromkeys(names, float("inf"))
            spent = dict.fromkeys(names, 0.0)
            for round_ in range(CALLS_PER_POINT + 1):
                for name, layer in layers.items():
                    if round_ > MIN_CALLS and spent[name] > POINT_BUDGET_S:
                        continue
                    start = time.perf_counter()
                    layer(x)
                    took = time.perf_counter() - start
                    if round_:  # NOTE: round 0 warms up (first-call setup, caches)
                        best[name] = min(best[name], took)
                        spent[name] += took
            timings += [Timing(name, tokens, best[name]) for name in names]
    return timings


def _layer_with(name: str, weight: torch.Tensor) -> LinearBase:
    layer = LinearBase(weight.shape[1], weight.shape[0])
    layer.weight.data = weight.clone()
    layer.method = LINEAR_METHODS[name]()
    layer.method.process_weights_after_loading(layer)
    return layer


def cache_key(shape: Shape, dtype: torch.dtype) -> str:
    cpu = torch.backends.cpu.get_cpu_capability()
    return f"torch {torch.__version__} | cpu {cpu} | {str(dtype).removeprefix('torch.')} | {shape[0]}x{shape[1]}"


class TimingCache:
    """A JSON file of key -> timings; written whole and atomically (several processes may start at once)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def _read(self) -> dict[str, list[dict]]:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}

    def get(self, key: str) -> list[Timing] | None:
        rows = self._read().get(key)
        try:
            return None if rows is None else [Timing(**row) for row in rows]
        except TypeError:
            return None

    def put(self, key: str, timings: list[Timing]) -> None:
        data = self._read()
        data[key] = [asdict(t) for t in timings]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, self.path)

    def report(self, dtype: torch.dtype) -> list[tuple[Shape, list[Timing]]]:
        """The cached timings of this machine, torch and dtype, by shape (for benchmarks)."""
        prefix = cache_key((0, 0), dtype).rsplit("|", 1)[0]
        rows = []
        for key, timings in sorted(self._read().items()):
            if key.startswith(prefix):
                out_features, in_features = (int(v) for v in key.rsplit("|", 1)[1].strip().split("x"))
                rows.append(((out_features, in_features), [Timing(**t) for t in timings]))
        return rows


