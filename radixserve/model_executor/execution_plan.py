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
    kernel = getattr(backend, "decode_kernel", None)
    dname = str(dtype).removeprefix("torch.")
    used = kernel.selected_kernels().get(dname, []) if kernel is not None else []
    level = f" ({kernel.isa})" if kernel is not None else ""
    why_torch = ("no C kernels (--attention-backend torch, or not a CPU)" if kernel is None else
                 f"torch's op measured faster at this level and dtype ({dname})")
    if "decode" in used:
        decode = PlanEntry("attention decode", "C decode" + level, f"measured faster than torch's op here{level}")
    else:
        decode = PlanEntry("attention decode", "torch", why_torch)
    if getattr(backend, "cascade", None) is not None:
        prefix = PlanEntry("attention shared prefix", "cascade, " + ("C prefix" if "prefix" in used else "torch flash"),
                           "a prefix the whole batch shares is attended once")
    else:
        prefix = PlanEntry("attention shared prefix", "off", "--disable-cascade-attention")
    return [PlanEntry("attention backend", type(backend).__name__, f"--attention-backend {args.attention_backend}"),
            decode, _extend_entry(backend, used, dname, level, why_torch), prefix]


def _extend_entry(backend: Any, used: list[str], dname: str, level: str, why_torch: str) -> PlanEntry:
    if getattr(backend, "amx_extend", None) is not None and dname == "bfloat16":
        return PlanEntry("attention extend", "C extend_amx", "bf16 on AMX tiles")
    if "extend" not in used:
        return PlanEntry("attention extend", "torch SDPA", why_torch)
    if backend.extend_kernel is None:
        return PlanEntry("attention extend", "torch SDPA", "RADIXSERVE_CPU_PREFILL_KERNEL=0")
    return PlanEntry("attention extend", "C extend", f"measured faster than SDPA here{level}")


def _fused_reason(runner: Any, fused: tuple[str, ...]) -> str:
    if runner.server_args.disable_fused_ops:
        return "--disable-fused-ops"
    if runner.device.type != "cpu":
        return "the fused ops are compiled for the CPU only"
    return "compiled ahead of time for this CPU (cached)" if fused else "they did not compile here"
