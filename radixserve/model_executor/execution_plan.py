"""How one forward runs on this machine: every choice made once at start-up, before anything is prepared.

`plan_execution` decides, in one place and each with its reason: the dtype (platform.choose_dtype), the KV
cache's dtype (`resolve_kv_dtype`), each
float linear weight shape's method and, for the GEMV method, the row counts where its large AMX product wins
(layers/linear_tuning.py, measured here and cached), the fused ops (compiled ahead of time and cached), which
decoder runs decode batches (the Python layers or the C decoder over the model's exported weight view),
and the attention backend with the C kernels it uses per phase (layers/attention/registry.plan_attention).
Then the parts receive their share and nothing decides again: `device_setup.setup_model_for_device(model,
plan)` gives the linear layers their methods and the model its fused ops and decoder; the attention backend
is built from `plan.attention`. The plan is logged once at start-up and returned by `/get_server_info`
(`platform.execution_plan`), so "why is this slow here" has one answer.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from radixserve.configs.row_table import DEFAULT_ROWS, RowTable

if TYPE_CHECKING:
    from radixserve.layers.attention.base import AttentionPlan
    from radixserve.layers.fused_ops import FusedOps
    from radixserve.model_executor.cuda_graph_runner import GraphPlan
    from radixserve.platform import DtypeChoice
    from radixserve.server_args import ServerArgs

Shape = tuple[int, int]
C_DECODER, PYTHON_DECODER = "C decoder", "python layers"
_C_DECODER_REASON = {
    torch.bfloat16: "bf16 on the AVX512-BF16 GEMV: every decoder layer in one C call",
    torch.float32: "float32 on the bf16-weight kernel: every decoder layer in one C call",
}
_F32_WEIGHTS_REASON = "float32 on the float32 GEMV: every decoder layer in one C call"


def _c_decoder_reason(dtype: torch.dtype, methods: Mapping[Shape, str]) -> str:
    if dtype == torch.float32 and "f32_gemv" in methods.values() and "bf16_weights" not in methods.values():
        return _F32_WEIGHTS_REASON
    return _C_DECODER_REASON.get(dtype, "every decoder layer in one C call")


@dataclass(frozen=True)
class PlanEntry:
    part: str  # "dtype", "linear 1728x576", "attention decode", "fused ops", "decoder", ...
    choice: str
    reason: str


@dataclass(frozen=True)
class ExecutionPlan:
    dtype: torch.dtype
    kv_dtype: torch.dtype  # the KV cache's: the compute dtype, or bf16 under float32 compute (--kv-cache-dtype)
    linear_methods: Mapping[Shape, str]  # float weight shape -> method name (packed layers keep their format's)
    large_rows: Mapping[Shape, frozenset[int]]  # onednn_gemv shapes -> row counts for the large AMX product
    fused_ops: FusedOps | None  # the compiled passes between products; None: eager torch
    decoder: str  # C_DECODER or PYTHON_DECODER
    decoder_refusal: str | None  # why not the C decoder; None when it runs
    attention: AttentionPlan
    prefill_copy_bytes: int  # bf16-weight decoder layers' resident float32 copies for prefill (0: none)
    entries: tuple[PlanEntry, ...]
    cuda_graphs: GraphPlan | None = None  # decode buckets captured at start-up (cuda_graph_runner.py); None: off
    deterministic: bool = False  # --enable-deterministic-inference (deterministic.py): every forward as C step rows
    rows: RowTable = DEFAULT_ROWS  # every row count where a kernel changes (configs/row_table.py), handed to the parts

    def choice(self, part: str) -> str:
        return next(e.choice for e in self.entries if e.part == part)

    def as_dict(self) -> dict[str, dict[str, str]]:
        return {e.part: {"choice": e.choice, "reason": e.reason} for e in self.entries}

    def describe(self) -> str:
        """One line per entry, for the start-up log."""
        return "\n".join(f"  {e.part:<26} {e.choice:<28} {e.reason}" for e in self.entries)


def plan_execution(model: Any, device: torch.device, dtype_choice: DtypeChoice, args: ServerArgs) -> ExecutionPlan:
    """Every choice of how `model` (loaded, on `device` in the chosen dtype) runs, none applied yet."""
    from radixserve.layers.attention.registry import backend_class, plan_attention, resolve_backend
    from radixserve.layers.fused_ops import load_fused_ops
    from radixserve.layers.linear_tuning import plan_large_rows, plan_linear_methods
    from radixserve.model_executor.cuda_graph_runner import plan_cuda_graphs
    from radixserve.model_executor.deterministic import (
        check_deterministic,
        deterministic_entry,
        deterministic_linear_method,
    )

    dtype = getattr(torch, dtype_choice.dtype)
    rows = RowTable.from_env()
    kv_dtype, kv_reason = resolve_kv_dtype(args.kv_cache_dtype, dtype, dtype_choice.weights)
    requested = _requested_linear_method(args.linear_method, dtype_choice, device)
    gave = ""  # why the decoder shapes' methods were overridden for the C decoder (_methods_for_the_c_decoder)
    deterministic = args.enable_deterministic_inference
    if deterministic:
        requested = deterministic_linear_method(requested, device, dtype, dtype_choice.weights)
    methods = plan_linear_methods(model, device, dtype, requested, rows)
    large = plan_large_rows(model, methods, dtype)
    if resolve_backend(args.attention_backend, device) == "cpu":
        from radixserve.kernels.attention import build_in_background

        # NOTE: after the timed choices above (a compiler beside them would skew them): on a first start the
        # attention kernels build while the fused ops compile, instead of after them
        build_in_background()
    fused = not args.disable_fused_ops and model.uses_fused_ops
    ops = load_fused_ops(model.config, dtype, device, kv_dtype) if fused else None
    refusal = _decoder_refusal(model, device, dtype, ops, methods, kv_dtype)
    if refusal is not None and requested == "auto":
        methods, refusal, gave = _methods_for_the_c_decoder(model, device, dtype, ops, methods, kv_dtype, refusal)
    windows = getattr(model.config, "windows", ())
    cap = getattr(model.config, "attn_logit_softcapping", None)
    if deterministic:
        check_deterministic(refusal, windows)
    no_cascade = _cascade_refusal(args, device, dtype, cap)
    attention = plan_attention(args.attention_backend, device, cascade=no_cascade is None, windows=windows, rows=rows)
    copies = _prefill_copy_entries(model, methods)
    if deterministic and copies[0]:
        copies = 0, [PlanEntry("bf16 prefill copies", "off", "deterministic inference: prompts multiply with bf16w_gemv")]
    hybrid = bool(windows) and not args.disable_hybrid_swa_memory
    context_len = args.context_length or getattr(model.config, "context_len", 0)
    graphs = plan_cuda_graphs(args, device, backend_class(attention.backend).graph_refusal(windows, hybrid, context_len))
    entries = [PlanEntry("dtype", dtype_choice.dtype, dtype_choice.reason),
               PlanEntry("kv cache", str(kv_dtype).removeprefix("torch."), kv_reason),
               *_linear_entries(model, methods, large, requested, by_dtype=requested != args.linear_method,
                                deterministic=deterministic, rows=rows),
               *copies[1],
               *_attention_entries(attention, dtype, args, no_cascade),
               *_window_entries(windows, not args.disable_hybrid_swa_memory, no_cascade),
               *_softcap_entries(cap, attention.backend),
               PlanEntry("cuda graphs", _graph_choice(graphs), graphs.reason),
               PlanEntry("fused ops", ", ".join(_op_names(ops)) or "off", _fused_reason(args, device, ops, model)),
               PlanEntry("decoder", PYTHON_DECODER if refusal else C_DECODER,
                         refusal or _c_decoder_reason(dtype, methods) + gave),
               PlanEntry("deterministic", *deterministic_entry(deterministic)),
               PlanEntry("rows", "row table", rows.describe())]
    return ExecutionPlan(dtype, kv_dtype, methods, large, ops, PYTHON_DECODER if refusal else C_DECODER, refusal, attention,
                         copies[0], tuple(entries), graphs, deterministic, rows)


def _graph_choice(graphs: GraphPlan) -> str:
    sizes = graphs.bs_list
    return f"decode bs {sizes[0]}..{sizes[-1]} ({len(sizes)} graphs)" if sizes else "off"


def resolve_kv_dtype(name: str, dtype: torch.dtype, weights: str | None = None) -> tuple[torch.dtype, str]:
    """--kv-cache-dtype under compute `dtype` (`weights`: "bfloat16" where `--dtype auto` keeps the linear weights in
    bf16 under float32 compute): the cache's dtype and why. The attention paths read a cache in the compute dtype,
    or a bf16 cache under float32 compute (widened to float32 as it is loaded); nothing else."""
    if name == "auto" and dtype == torch.float32 and weights == "bfloat16":
        # NOTE: what `--dtype auto` does for the weights it does for the cache: bf16 storage, float32 math
        return torch.bfloat16, ("--kv-cache-dtype auto with --dtype auto on a CPU without bf16 products: K/V kept in "
                                "bf16 like the weights (half the bytes per token), widened to float32 as attention "
                                "loads them")
    if name == "auto" or getattr(torch, {"bf16": "bfloat16"}.get(name, name)) == dtype:
        return dtype, "the compute dtype" + (" (--kv-cache-dtype auto)" if name == "auto" else "")
    kv_dtype = getattr(torch, {"bf16": "bfloat16"}.get(name, name))
    if kv_dtype == torch.bfloat16 and dtype == torch.float32:
        return kv_dtype, ("--kv-cache-dtype: K/V stored in bf16 and widened to float32 as attention loads them "
                          "(half the bytes per token)")
    compute = str(dtype).removeprefix("torch.")
    raise ValueError(f"--kv-cache-dtype {name} under {compute} compute is not supported: the KV cache is in the "
                     "compute dtype, or bfloat16 under float32 compute")


def _requested_linear_method(requested: str, dtype_choice: DtypeChoice, device: torch.device) -> str:
    """--linear-method, except that `auto` under a dtype choice that keeps the weights in bf16 (float32 compute
    on a CPU without bf16 products) means the bf16-weight method where its kernel runs."""
    from radixserve.layers.bf16_weights import Bf16WeightLinearMethod

    if requested == "auto" and dtype_choice.weights == "bfloat16" and Bf16WeightLinearMethod.supports(
            device, getattr(torch, dtype_choice.dtype)):
        return Bf16WeightLinearMethod.name
    return requested


def _decoder_refusal(model: Any, device: torch.device, dtype: torch.dtype, ops: FusedOps | None,
                     methods: Mapping[Shape, str], kv_dtype: torch.dtype) -> str | None:
    from radixserve.models.c_decoder import c_decoder_refusal

    if device.type != "cpu":
        return "the C decoder runs on the CPU only"
    return c_decoder_refusal(model.decoder_weights(), dtype, ops, methods, kv_dtype)


def _methods_for_the_c_decoder(model: Any, device: torch.device, dtype: torch.dtype, ops: FusedOps | None,
                               methods: dict[Shape, str], kv_dtype: torch.dtype, refusal: str
                               ) -> tuple[dict[Shape, str], str | None, str]:
    """Where timing shape by shape chose a method the C decoder cannot call for some float32 decoder layer (dense
    timed a few percent faster at 512 rows, say), the float32 GEMV for every decoder shape instead, if that lets the
    C decoder run and the whole choice is faster (decoder_choice.py: a decode step's products both ways, from the
    timings, and the Python layers' calls): it is our GEMV up to `RowTable.f32_gemv_rows` rows and oneDNN's product
    above, and the C decoder saves every decode step ~10 Python calls per layer (measured on a 2-core AVX2 EPYC,
    SmolLM2 in float32: batch-1 decode 27 tokens/s on the Python layers against 81 in the C decoder). Returns
    (methods, refusal, why)."""
    from radixserve.layers.f32_gemv import F32GemvLinearMethod
    from radixserve.model_executor.decoder_choice import decoder_trade

    weights = model.decoder_weights()
    if (dtype != torch.float32 or weights is None or "a linear layer runs" not in refusal
            or not F32GemvLinearMethod.supports(device, dtype)):
        return methods, refusal, ""
    shapes = {linear.shape for layer in weights.layers for linear in layer.linears}
    overridden = sorted(f"{n}x{k} {methods[(n, k)]}" for n, k in shapes
                        if (n, k) in methods and methods[(n, k)] != F32GemvLinearMethod.name)
    tried = {**methods, **{shape: F32GemvLinearMethod.name for shape in shapes if shape in methods}}
    again = _decoder_refusal(model, device, dtype, ops, tried, kv_dtype)
    if again is not None:
        return methods, refusal, ""
    counts = Counter(linear.shape for layer in weights.layers for linear in layer.linears)
    trade = decoder_trade(counts, methods, F32GemvLinearMethod.name, len(weights.layers), dtype)
    if trade is not None and not trade.c_wins:
        return methods, f"{refusal} (kept: f32_gemv on every decoder shape would be slower, {trade.describe()})", ""
    why = "not timed here" if trade is None else trade.describe()
    return tried, None, (f" (f32_gemv given to every decoder shape, where timing alone chose "
                         f"{', '.join(overridden)}: that would run every decode step in the Python layers; {why})")


def _op_names(ops: FusedOps | None) -> tuple[str, ...]:
    if ops is None:
        return ()
    return tuple(op.name for op in (ops.add_rmsnorm, ops.rotary_kv, ops.silu_and_mul) if op is not None)


def _linear_entries(model: Any, methods: Mapping[Shape, str], large: Mapping[Shape, frozenset[int]],
                    requested: str, by_dtype: bool = False, deterministic: bool = False,
                    rows: RowTable = DEFAULT_ROWS) -> list[PlanEntry]:
    """One entry per (weight shape, method), counting the layers; each method's row counts from `rows`."""
    from radixserve.layers.linear import LINEAR_METHODS, DenseLinearMethod, linear_layers
    from radixserve.layers.linear_tuning import lm_head_only_shapes
    from radixserve.layers.quantization.linear import EVERY_ROW_KERNELS

    tuned = ("the fastest of the candidates timed here at {rows} (cached per machine)"
             if requested == "auto" else "deterministic inference: a method with a row kernel" if deterministic
             else "--dtype auto: bf16 weights, float32 compute" if by_dtype else f"--linear-method {requested}")
    counts: Counter[tuple[str, str, str]] = Counter()
    head_only = lm_head_only_shapes(model)
    for _, layer in linear_layers(model):
        if layer.method.chosen_by_format:
            method, reason = layer.method, "the weight format (--quantization, or the GGUF file's type)"
        else:
            timed_at = ("1 and 32 rows (an LM head: one row per sampled sequence)" if layer.shape in head_only
                        else "1, 32 and 512 rows")
            method = LINEAR_METHODS[methods.get(layer.shape, DenseLinearMethod.name)]()
            reason = tuned.format(rows=timed_at)
        if deterministic and layer.method.chosen_by_format:  # NOTE: tiled and told by device_setup, after the plan
            kernels = EVERY_ROW_KERNELS
        else:
            if deterministic:  # NOTE: the plan's copy of the method, told what device_setup tells the layer's
                method.use_row_kernel_everywhere()
            if method is layer.method:
                method = copy.copy(method)  # NOTE: the plan reads a format's method; device_setup gives the layer its rows
            method.rows = rows
            kernels = method.row_kernels(layer.in_features, large.get(layer.shape, frozenset()))
        counts[(f"{layer.out_features}x{layer.in_features}", method.describe(), f"{reason}; {kernels}")] += 1
    return [PlanEntry(f"linear {shape}", f"{method} x{n}", reason)
            for (shape, method, reason), n in sorted(counts.items())]


def _prefill_copy_entries(model: Any, methods: Mapping[Shape, str]) -> tuple[int, list[PlanEntry]]:
    """The bytes of the bf16-weight layers' resident prefill copies, and their entry (none without such layers)."""
    from radixserve.layers.bf16_weights import Bf16WeightLinearMethod, mb, plan_prefill_copies

    if Bf16WeightLinearMethod.name not in methods.values():
        return 0, []
    size, reason = plan_prefill_copies(model, methods)
    return size, [PlanEntry("bf16 prefill copies", mb(size) if size else "off", reason)]


def _cascade_refusal(args: ServerArgs, device: torch.device, dtype: torch.dtype, cap: float | None) -> str | None:
    """Why attention over a prefix the whole batch shares is not split (cascade); None where it may be."""
    from radixserve.layers.attention.registry import resolve_backend

    if args.disable_cascade_attention:
        return "--disable-cascade-attention"
    if args.enable_deterministic_inference:
        return "deterministic inference: every row attends over its own slots in one order"
    if resolve_backend(args.attention_backend, device) == "triton":
        return "the triton backend has no cascade path: each request attends over its whole context"
    if cap is not None:  # NOTE: no cascade path caps scores (layers/attention/softcap.py)
        return "attention soft-cap: no cascade path caps scores"
    if resolve_backend(args.attention_backend, device) == "cpu":
        from radixserve.kernels.attention import CASCADE_LOSES, load_decode_kernel

        kernel = load_decode_kernel()
        if kernel is not None and (kernel.kernel_class, dtype) in CASCADE_LOSES:
            return (f"measured slower than the C kernels alone at this level and dtype ({kernel.kernel_class}, "
                    f"{str(dtype).removeprefix('torch.')})")
    return None


def _attention_entries(plan: AttentionPlan, dtype: torch.dtype, args: ServerArgs, no_cascade: str | None
                       ) -> list[PlanEntry]:
    dname = str(dtype).removeprefix("torch.")
    level = f" ({plan.level})" if plan.level else ""
    why_torch = ("no C kernels (--attention-backend torch, not a CPU, or they did not build)" if plan.level is None
                 else f"torch's op measured faster at this level and dtype ({dname})")
    backend = PlanEntry("attention backend", plan.backend, plan.reason or f"--attention-backend {args.attention_backend}")
    if plan.backend == "triton":
        from radixserve.layers.attention.triton_backend import DEFAULT_KV_SPLITS

        return [backend, PlanEntry("attention decode", f"triton split-K ({DEFAULT_KV_SPLITS} splits)",
                                   "flash decoding over each request's slot table row"),
                PlanEntry("attention extend", "triton prefix + causal",
                          "the cached prefix from the pool and the new tokens in one kernel"),
                PlanEntry("attention shared prefix", "off", no_cascade or "")]
    if plan.uses("decode", dtype):
        decode = PlanEntry("attention decode", "C decode" + level, f"measured faster than torch's op here{level}")
    else:
        decode = PlanEntry("attention decode", "torch", why_torch)
    if plan.cascade:
        prefix = PlanEntry("attention shared prefix",
                           "cascade, " + ("C prefix_amx" if plan.uses("prefix_amx", dtype) else
                                          "C prefix" if plan.uses("prefix", dtype) else "torch flash"),
                           "a prefix the whole batch shares is attended once")
    else:
        prefix = PlanEntry("attention shared prefix", "off", no_cascade or "")
    return [backend, decode, _extend_entry(plan, dtype, level, why_torch), prefix]


def _extend_entry(plan: AttentionPlan, dtype: torch.dtype, level: str, why_torch: str) -> PlanEntry:
    from radixserve import envs

    if plan.uses("extend_amx", dtype):
        return PlanEntry("attention extend", "C extend_amx", "bf16 on AMX tiles")
    if plan.level is not None and not envs.CPU_PREFILL_KERNEL.get():
        return PlanEntry("attention extend", "torch SDPA", f"{envs.CPU_PREFILL_KERNEL.name}=0")
    if not plan.uses("extend", dtype):
        return PlanEntry("attention extend", "torch SDPA", why_torch)
    return PlanEntry("attention extend", "C extend", f"measured faster than SDPA here{level}")


def _window_entries(windows: tuple[int, ...], hybrid: bool, no_cascade: str | None) -> list[PlanEntry]:
    if not windows:
        return []
    paths = ("window layers: decode over the window's slots (C decode or torch), extend with the window in the C "
             "extend kernel (banded torch SDPA where it does not run); " +
             ("cascade over the part of a shared prefix the batch's windows still see, decided on that part's length"
              if no_cascade is None else f"no cascade ({no_cascade})"))
    memory = ("; KV in a window pool of their own (hybrid, --swa-full-tokens-ratio), every batch" if hybrid else
              "; KV in the one pool (--disable-hybrid-swa-memory), only in batches where a request is longer than "
              "the window")
    return [PlanEntry("attention window", ", ".join(map(str, windows)), paths + memory)]


def _softcap_entries(cap: float | None, backend: str) -> list[PlanEntry]:
    if cap is None:
        return []
    if backend == "triton":
        return [PlanEntry("attention soft-cap", f"{cap:g}", "in the triton kernels (float32 scores capped, then masked)")]
    return [PlanEntry("attention soft-cap", f"{cap:g}", "every capped layer (window layers too): torch math attention "
                      "(float32 scores capped, masked, softmax), no C kernels / cascade, whatever the entries above say")]


def _fused_reason(args: ServerArgs, device: torch.device, ops: FusedOps | None, model: Any = None) -> str:
    if args.disable_fused_ops:
        return "--disable-fused-ops"
    if not model.uses_fused_ops:
        return "this model's layers are not the fused ops' structure (eager torch)"
    if device.type != "cpu":
        return "the fused ops are compiled for the CPU only"
    return "compiled ahead of time for this CPU (cached)" if ops else "they did not compile here"
