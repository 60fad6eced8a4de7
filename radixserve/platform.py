"""What this CPU can do, and the choices that follow from it: the kernel ISA and the `--dtype auto` dtype.

The only module that reads /proc/cpuinfo. `cpu_info()` is the hardware (ISA features, physical cores,
torch's own view of the CPU); `kernel_isa()` is the level our C attention kernels run at, the best the
CPU has unless RADIXSERVE_CPU_ISA forces a lower one; `choose_dtype` decides `--dtype auto` from the
features that level leaves visible and a short bf16-vs-float32 matmul measurement (skipped on AMX): a pure
function, `auto_dtype`; `kernel_class()` keys which C kernels beat torch here.

    python -m radixserve.platform        # prints what radixserve sees here
"""

from __future__ import annotations

import functools
import logging
import os
import platform as _stdlib_platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from radixserve import envs

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# The features radixserve reports and decides by: /proc/cpuinfo flag names on x86; on ARM, NEON is
# `asimd`, SVE `sve` and the BF16 dot-product instructions `bf16` (reported here as arm_bf16).
X86_FEATURES = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni",
                "avx512_bf16", "avx512_fp16", "avx_vnni", "avx_ne_convert", "amx_tile", "amx_bf16")
ARM_FEATURES = {"asimd": "neon", "sve": "sve", "bf16": "arm_bf16"}

# Levels of our C kernels, best first; a level runs where the CPU has all of its features.
# avx512 is AVX-512 F/BW/VL/DQ without the BF16 instructions (Skylake-SP .. Ice Lake, Zen 4 minus BF16).
KERNEL_ISAS = ("avx512_bf16", "avx512", "avx2", "portable")
# NOTE: f16c with avx2: every AVX2 CPU has it, and the packed kernels' float16 scales need it
_AVX512 = frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"})
ISA_REQUIRES: dict[str, frozenset[str]] = {
    "avx512_bf16": _AVX512 | {"avx512_bf16"},
    "avx512": _AVX512,
    "avx2": frozenset({"avx2", "fma", "f16c"}),
    "portable": frozenset(),
}
# NOTE: every CPU with the AVX-512 BF16 instructions (Cooper Lake, Sapphire Rapids on, Zen 4 on) also has AVX512-VNNI,
# so a forced avx512_bf16 level keeps it visible: the packed int8/int4 kernels then run as on such a CPU.
FORCED_ALSO_SHOWS: dict[str, frozenset[str]] = {"avx512_bf16": frozenset({"avx512_vnni"})}
# The compiler flags of each level: the one table every C build uses (`kernels/build.py`). Never -march=native,
# so a machine builds and tests the lower levels too.
_AVX512_FLAGS = ("-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")
ISA_FLAGS: dict[str, tuple[str, ...]] = {
    "avx512_bf16": (*_AVX512_FLAGS, "-mavx512bf16"),
    "avx512": _AVX512_FLAGS,
    "avx2": ("-mavx2", "-mfma"),
    "portable": (),
}
AMX_FLAGS = (*ISA_FLAGS["avx512_bf16"], "-mamx-tile", "-mamx-bf16")  # kernels on AMX tiles (bf16)
# The packed int8/int4 kernels' levels (kernels/quant.py): their integer dot products differ
# by the VNNI instructions a CPU has, not by the float levels above.
QUANT_ISAS = ("avx512_vnni", "avx_vnni", "avx2", "portable")
_QUANT_BASE = ("-mavx2", "-mfma", "-mf16c")
QUANT_ISA_FLAGS: dict[str, tuple[str, ...]] = {
    "avx512_vnni": (*_QUANT_BASE, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni"),
    "avx_vnni": (*_QUANT_BASE, "-mavxvnni"),
    "avx2": _QUANT_BASE,
    "portable": (),
}
QUANT_ISA_REQUIRES: dict[str, frozenset[str]] = {
    "avx512_vnni": frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}),
    "avx_vnni": frozenset({"avx2", "fma", "f16c", "avx_vnni"}),
    "avx2": frozenset({"avx2", "fma", "f16c"}),
    "portable": frozenset(),
}
# Features that make bf16 matrix products native (no float32 round trip in torch's GEMMs).
NATIVE_BF16 = ("amx_bf16", "avx512_bf16", "arm_bf16")
# With bf16 instructions but no AMX, bf16 still loses to float32 if measured this much slower (oneDNN may
# lack a fast path for the CPU): a clear margin, so that noise never flips a native CPU to float32.
NATIVE_SLOWDOWN_LIMIT = 1.2
BF16_PROBE_SHAPE = (256, 576, 1536)  # tokens x hidden -> intermediate of SmolLM2-135M's MLP
BF16_PROBE_CALLS = 11  # per dtype, alternating; the first of each is dropped


@dataclass(frozen=True)
class CpuInfo:
    arch: str  # platform.machine(): x86_64, aarch64, arm64 ...
    model: str
    features: frozenset[str]  # of X86_FEATURES and the ARM names above
    physical_cores: int
    logical_cpus: int
    torch_capability: str  # torch.backends.cpu.get_cpu_capability(): what torch's own kernels run at
    vendor: str = ""  # /proc/cpuinfo's vendor_id: GenuineIntel, AuthenticAMD ("" where it does not say)

    @property
    def is_x86(self) -> bool:
        return self.arch.lower() in ("x86_64", "amd64")  # NOTE: the kernel levels are built for 64-bit x86 only


@dataclass(frozen=True)
class DtypeChoice:
    dtype: str  # bfloat16 | float32 | float16: what activations, KV and products compute in
    reason: str
    weights: str | None = None  # "bfloat16": linear weights kept in bf16 under float32 compute; None: as dtype


# NOTE: where `auto` picks float32 on a CPU, the linear weights are kept in bf16 (layers/bf16_weights.py): a decode
# step reads half the bytes, the products stay float32, and the weights are the ones bf16 CPUs run.
BF16_WEIGHT_SIMD = frozenset({"avx2", "fma"})  # the features the bf16-weight kernel needs to beat float32
BF16_WEIGHTS_REASON = "; linear weights kept in bfloat16 (half the bytes a decode step reads), computed in float32"


@functools.cache
def cpu_info() -> CpuInfo:
    """This machine's CPU, read once per process."""
    import torch

    arch = _stdlib_platform.machine() or "unknown"
    fields = _cpuinfo_fields()
    features = _features(arch, fields)
    return CpuInfo(arch, _model_name(fields), features, _physical_cores(fields),
                   os.cpu_count() or 1, torch.backends.cpu.get_cpu_capability(),
                   fields[0].get("vendor_id", "") if fields else "")


def cpu_name() -> str:
    return cpu_info().model


def missing_features(isa: str, features: frozenset[str]) -> list[str]:
    """The features `isa` needs that `features` lacks (empty: it runs)."""
    return sorted(ISA_REQUIRES[_check_isa(isa)] - features)


def best_isa(info: CpuInfo) -> str:
    if not info.is_x86:
        return "portable"
    return next(isa for isa in KERNEL_ISAS if not missing_features(isa, info.features))


def runnable_isas(info: CpuInfo | None = None) -> list[str]:
    """Every kernel level this CPU can run, best first."""
    info = info or cpu_info()
    best = best_isa(info)
    return list(KERNEL_ISAS[KERNEL_ISAS.index(best):])


def kernel_isa() -> str:
    """The level our kernels run at: RADIXSERVE_CPU_ISA if set (it may only go down), else the best here."""
    info = cpu_info()
    forced = envs.CPU_ISA.get()
    if forced == "auto":
        return best_isa(info)
    if forced not in runnable_isas(info):
        lacking = missing_features(forced, info.features) if info.is_x86 else [f"an x86 CPU (this is {info.arch})"]
        raise envs.EnvError(f"{envs.CPU_ISA.name}={forced}: this CPU lacks {', '.join(lacking)}; "
                            f"it can run {', '.join(runnable_isas(info))}")
    return forced


def visible_features(info: CpuInfo | None = None) -> frozenset[str]:
    """The features radixserve decides by. Forcing a level (RADIXSERVE_CPU_ISA) hides every x86 feature that
    level does not need (or every CPU of it has: FORCED_ALSO_SHOWS), so that e.g. avx2 makes radixserve decide as
    on an AVX2-only CPU and avx512_bf16 as on one without AMX (torch's own kernels still use what the CPU has; see bench/docs.TORCH_ISA_ENV)."""
    info = info or cpu_info()
    if envs.CPU_ISA.get() == "auto":
        return info.features
    level = kernel_isa()
    allowed = ISA_REQUIRES[level] | FORCED_ALSO_SHOWS.get(level, frozenset())
    return frozenset(f for f in info.features if f not in X86_FEATURES or f in allowed)


def kernel_class() -> str:
    """The class our kernel selection is keyed by (kernels.attention.SELECTED): the kernel level, or `amx` at
    avx512_bf16 with AMX-BF16 visible, where torch's own bf16 attention runs on AMX tiles."""
    isa = kernel_isa()
    return "amx" if isa == "avx512_bf16" and "amx_bf16" in visible_features() else isa


def weight_prefetch() -> str:
    """Where the bf16-weight decode kernel's vector builds (kernels/csrc/bf16w_gemv.c) prefetch: "l2" or "l1".
    NOTE: on Intel cores a prefetch into L1 takes one of the few line-fill buffers that demand loads also need,
    so one core streams less than memory gives it (a 1-row product over 716 MB at the AVX2 class, 2 threads:
    20 GB/s prefetching into L1, 25 GB/s into L2). AMD documents L2 prefetches only from Zen 4 on, and our Zen 4
    figures were measured prefetching into L1, so elsewhere the kernel keeps doing that. Products of one row (batch-1
    decode) read four streams per thread and prefetch into L1 on every CPU instead (faster than either with one
    stream); this choice applies to 2 rows and more."""
    chosen = envs.WEIGHT_PREFETCH.get()
    if chosen != "auto":
        return chosen
    return "l2" if cpu_info().vendor == "GenuineIntel" else "l1"


def auto_dtype(device_type: str, features: frozenset[str], bf16_slowdown: float | None = None) -> DtypeChoice:
    """`--dtype auto`, decided. `bf16_slowdown`: measured bf16 / float32 matmul time here, or None.

    bfloat16 with AMX-BF16 (no measurement needed); with AVX512-BF16 or ARM BF16 unless bf16 was measured
    clearly slower (NATIVE_SLOWDOWN_LIMIT); without native bf16 only if measured at least as fast as float32."""
    if device_type == "cuda":
        return DtypeChoice("bfloat16", "CUDA")
    native = [f for f in NATIVE_BF16 if f in features]
    if native:
        names = ", ".join(native)
        if "amx_bf16" in native or bf16_slowdown is None or bf16_slowdown <= NATIVE_SLOWDOWN_LIMIT:
            return DtypeChoice("bfloat16", f"bf16 matrix products are native here ({names})"
                               + ("" if bf16_slowdown is None or "amx_bf16" in native
                                  else f", measured {bf16_slowdown:.2f}x the float32 time"))
        return _float32(f"bf16 instructions are present ({names}), but bf16 matmuls measured "
                        f"{bf16_slowdown:.1f}x slower than float32 here", features)
    lacking = "no native bf16 matrix products (no AMX-BF16, AVX512-BF16 or ARM BF16)"
    if bf16_slowdown is None:
        return _float32(f"{lacking}; not measured", features)
    if bf16_slowdown <= 1.0:
        return DtypeChoice("bfloat16", f"{lacking}, but bf16 matmuls measured {1 / bf16_slowdown:.2f}x as fast "
                                       "as float32")
    return _float32(f"{lacking}; bf16 matmuls measured {bf16_slowdown:.1f}x slower than float32", features)


def _float32(reason: str, features: frozenset[str]) -> DtypeChoice:
    """float32 compute; the weights in bf16 where our bf16-weight kernel has SIMD (AVX2 + FMA or better). NOTE: its
    plain-C build measured 0.6-0.8x float32 MKL at decode sizes (forced portable class), so not there."""
    if BF16_WEIGHT_SIMD <= features:
        return DtypeChoice("float32", reason + BF16_WEIGHTS_REASON, weights="bfloat16")
    return DtypeChoice("float32", reason)



def choose_dtype(name: str, device_type: str) -> DtypeChoice:
    """The dtype for `--dtype name` on this machine and why; an explicit bf16 where it is slow logs one warning."""
    if device_type != "cpu":
        return DtypeChoice(name, "explicit --dtype") if name != "auto" else auto_dtype(device_type, frozenset())
    if name != "auto":
        if name == "bfloat16" and (_bf16_slowdown_here() or 0.0) > 1.0:
            _warn_slow_bf16()
        return DtypeChoice(name, "explicit --dtype")
    return auto_dtype("cpu", visible_features(), _bf16_slowdown_here())


def _bf16_slowdown_here() -> float | None:
    """The measured bf16 / float32 matmul time, except on AMX, where bf16 is known to be fast."""
    return None if "amx_bf16" in visible_features() else measure_bf16_slowdown()


@functools.cache
def measure_bf16_slowdown() -> float:
    """bf16 / float32 time of a linear layer of SmolLM2-135M's MLP shape, the fastest of BF16_PROBE_CALLS alternating
    calls each (~0.1-0.3 s where bf16 is slow); measured once per process."""
    import torch
    import torch.nn.functional as F

    tokens, hidden, out = BF16_PROBE_SHAPE
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(tokens, hidden, generator=g), torch.randn(out, hidden, generator=g)
    pairs = {torch.float32: (x, w), torch.bfloat16: (x.bfloat16(), w.bfloat16())}
    times: dict[torch.dtype, list[float]] = {dtype: [] for dtype in pairs}
    with torch.inference_mode():
        for _ in range(BF16_PROBE_CALLS):
            for dtype, (a, b) in pairs.items():
                start = time.perf_counter()
                F.linear(a, b)
                times[dtype].append(time.perf_counter() - start)
    # NOTE: the first call of each dtype pays one-time setup (weight packing, thread pool); dropped. The fastest call
    # is the product's own time: the medians of three, as before, read 1.21-1.66x for the same CPU from one process to
    # the next (a forced avx512_bf16 class), either side of NATIVE_SLOWDOWN_LIMIT; the fastest of ten, 1.53-1.60x.
    bf16, f32 = (min(times[d][1:]) for d in (torch.bfloat16, torch.float32))
    return bf16 / max(f32, 1e-9)


def describe(info: CpuInfo | None = None) -> dict[str, Any]:
    """For /get_server_info and benchmark headers."""
    info = info or cpu_info()
    isa = kernel_isa()
    return {"arch": info.arch, "cpu": info.model, "physical_cores": info.physical_cores,
            "logical_cpus": info.logical_cpus, "features": sorted(info.features),
            "torch_cpu_capability": info.torch_capability, "kernel_isa": isa, "best_kernel_isa": best_isa(info),
            "kernel_isa_forced": envs.CPU_ISA.get() != "auto", "kernel_class": kernel_class(),
            "visible_features": sorted(visible_features(info))}


def summary_line(info: CpuInfo | None = None) -> str:
    """One line: the CPU, its features, cores, torch's capability and our kernel level."""
    info = info or cpu_info()
    isa, best = kernel_isa(), best_isa(info)
    forced = f" (forced by {envs.CPU_ISA.name}; the CPU can run {best})" if envs.CPU_ISA.get() != "auto" else ""
    features = " ".join(sorted(info.features)) or "none of the tracked ones"
    return (f"{info.model} ({info.arch}), {info.physical_cores} physical cores, features: {features}; torch CPU "
            f"capability {info.torch_capability}; radixserve kernels {isa}{forced}")


@functools.cache
def _warn_slow_bf16() -> None:
    logger.warning("--dtype bfloat16 where bf16 matrix products are slow: bf16 matmuls measured %.1fx slower "
                   "than float32 here (--dtype auto: %s)", measure_bf16_slowdown(), choose_dtype("auto", "cpu").dtype)


def _check_isa(isa: str) -> str:
    if isa not in ISA_REQUIRES:
        raise ValueError(f"unknown kernel ISA {isa!r}; expected one of {', '.join(KERNEL_ISAS)}")
    return isa


def _read_cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def _cpuinfo_fields() -> list[dict[str, str]]:
    """/proc/cpuinfo as one dict per processor (empty where there is no such file)."""
    text = _read_cpuinfo()
    blocks = []
    for block in text.strip().split("\n\n") if text.strip() else []:
        fields = {}
        for line in block.splitlines():
            key, sep, value = line.partition(":")
            if sep:
                fields[key.strip().lower()] = value.strip()
        blocks.append(fields)
    return blocks


def _features(arch: str, fields: list[dict[str, str]]) -> frozenset[str]:
    first = fields[0] if fields else {}
    flags = set(first.get("flags", "").split())
    found = {f for f in X86_FEATURES if f in flags}
    arm = set(first.get("features", "").split())
    found |= {name for flag, name in ARM_FEATURES.items() if flag in arm}
    if arch.lower() in ("arm64", "aarch64"):
        found.add("neon")  # NOTE: baseline on 64-bit ARM (macOS has no /proc/cpuinfo to say so)
    return frozenset(found)


def _model_name(fields: list[dict[str, str]]) -> str:
    first = fields[0] if fields else {}
    for key in ("model name", "hardware", "cpu model"):
        if first.get(key):
            return first[key]
    return _stdlib_platform.processor() or _stdlib_platform.machine() or "unknown CPU"


def _physical_cores(fields: list[dict[str, str]]) -> int:
    cores = {(f.get("physical id"), f.get("core id")) for f in fields if "core id" in f}
    return len(cores) or os.cpu_count() or 1


def main() -> None:
    import json
    import sys

    if sys.argv[1:] == ["--runnable-isas"]:  # for .ci/run: the kernel levels this CPU can run
        print(" ".join(runnable_isas()))
        return
    print(summary_line())
    print(json.dumps(describe(), indent=2))
    print("auto dtype on the CPU:", choose_dtype("auto", "cpu"))


if __name__ == "__main__":
    main()
