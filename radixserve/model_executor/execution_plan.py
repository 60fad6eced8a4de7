"""How one forward runs on this machine, decided at start-up: one record of every choice and its reason.

`ExecutionPlan.of_runner` is built once, after the model is on its device (linear methods chosen, fused ops
and the decode step loaded) and the attention backend is built. It is logged once at start-up and returned
by `/get_server_info` (`platform.execution_plan`), so "why is this slow here" has one answer: the dtype,
each linear weight shape's method, the attention kernel of each phase, the fused ops, and which decoder runs
(the Python layers or the C decode step), each with the reason it was chosen.

NOTE: the plan records the decisions; the layers still make them when they are set up (linear_tuning.py,
fused_ops.py, decode_step.py, the attention backend). Moving the decisions into the plan, so that layers
receive their part of it, is the next step.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PlanEntry:
    part: str  # "dtype", "linear 1728x576", "attention decode", "fused ops", "decoder", ...
    choice: str
    reason: str


@dataclass(frozen=True)
class ExecutionPlan:
    entries: tuple[PlanEntry, ...]

    def choice(self, part: str) -> str:
        return next(e.choice for e in self.entries if e.part == part)

    def as_dict(self) -> dict[str, dict[str, str]]:
        return {e.part: {"choice": e.choice, "reason": e.reason} for e in self.entries}

    def describe(self) -> str:
        """One line per entry, for the start-up log."""
        return "\n".join(f"  {e.part:<26} {e.choice:<28} {e.reason}" for e in self.entries)

    @staticmethod
    def of_runner(runner: Any) -> ExecutionPlan:
        args = runner.server_args
        entries = [PlanEntry("dtype", runner.dtype_choice.dtype, runner.dtype_choice.reason)]
        entries += _linear_entries(runner.model, args.linear_method)
        entries += _attention_entries(runner.attn_backend, runner.dtype, args)
        fused = runner.device_setup.fused_ops
        entries.append(PlanEntry("fused ops", ", ".join(fused) or "off", _fused_reason(runner, fused)))
        refusal = runner.device_setup.decode_step_refusal
        entries.append(PlanEntry("decoder", "python layers" if refusal else "C decode step",
                                 refusal or "bf16 on the AVX512-BF16 GEMV: every decoder layer in one C call"))
        return ExecutionPlan(tuple(entries))


def _linear_entries(model: Any, requested: str) -> list[PlanEntry]:
    """One entry per (weight shape, method), counting the layers."""
    from radixserve.layers.linear import LinearBase
    from radixserve.layers.quantization.linear import QuantizedLinear

    counts: Counter[tuple[str, str, str]] = Counter()
    for _, module in model.named_modules():
        if isinstance(module, LinearBase):
            reason = (f"--linear-method {requested}" if requested != "auto" else
                      "the fastest of the candidates timed here at 1, 32 and 512 rows (cached per machine)")
            counts[(f"{module.out_features}x{module.in_features}", module.method.name, reason)] += 1
        elif isinstance(module, QuantizedLinear):
            fmt = f"int{module.bits}" + (" per channel" if module.per_channel and module.bits == 8 else "")
            counts[(f"{module.out_features}x{module.in_features}", f"packed {fmt}", "--quantization")] += 1
    return [PlanEntry(f"linear {shape}", f"{method} x{n}", reason)
            for (shape, method, reason), n in sorted(counts.items())]


def _attention_entries(backend: Any, dtype: Any, args: Any) -> list[PlanEntry]:
    name = type(backend).__name__
    kernel = getattr(backend, "decode_kernel", None)
    dname = str(dtype).removeprefix("torch.")
    used = kernel.selected_kernels().get(dname, []) if kernel is not None else []
    level = f" ({kernel.isa})" if kernel is not None else ""
    why_torch = ("no C kernels (--attention-backend torch, or not a CPU)" if kernel is None else
                 f"torch's op measured faster at this level and dtype ({dname})")
    amx = getattr(backend, "amx_extend", None) is not None and dname == "bfloat16"
    extend = "C extend_amx" if amx else ("C extend" if "extend" in used and backend.extend_kernel is not None
                                          else "torch SDPA")
    extend_reason = ("bf16 on AMX tiles" if amx else f"measured faster than SDPA here{level}" if extend == "C extend"
                     else why_torch if kernel is None or "extend" not in used else "RADIXSERVE_CPU_PREFILL_KERNEL=0")
    cascade = getattr(backend, "cascade", None) is not None
    return [
        PlanEntry("attention backend", name, f"--attention-backend {args.attention_backend}"),
        PlanEntry("attention decode", "C decode" + level if "decode" in used else "torch",
                  f"measured faster than torch's op here{level}" if "decode" in used else why_torch),
        PlanEntry("attention extend", extend, extend_reason),
        PlanEntry("attention shared prefix", ("cascade, " + ("C prefix" if "prefix" in used else "torch flash"))
                  if cascade else "off", "a prefix the whole batch shares is attended once" if cascade
                  else "--disable-cascade-attention"),
    ]


def _fused_reason(runner: Any, fused: tuple[str, ...]) -> str:
    if runner.server_args.disable_fused_ops:
        return "--disable-fused-ops"
    if runner.device.type != "cpu":
        return "the fused ops are compiled for the CPU only"
    return "compiled ahead of time for this CPU (cached)" if fused else "they did not compile here"
