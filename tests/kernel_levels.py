"""Kernel tests run once per kernel level (platform.KERNEL_ISAS); a level this CPU cannot run is skipped
with the features it lacks, and under RADIXSERVE_CPU_ISA=<level> (how .ci/run emulates a smaller CPU)
the levels above it are skipped too."""

from __future__ import annotations

import pytest

from radixserve import envs, platform
from radixserve.kernels.attention import DecodeKernel, load_decode_kernel

LEVELS = [pytest.param(isa, id=isa) for isa in platform.KERNEL_ISAS]


def skip_unless_runnable(isa: str) -> None:
    """Skips, naming why, when this CPU (or the level RADIXSERVE_CPU_ISA forces) cannot run `isa`."""
    info = platform.cpu_info()
    if isa not in platform.runnable_isas(info):
        lacking = platform.missing_features(isa, info.features) if info.is_x86 else [f"x86 (this is {info.arch})"]
        pytest.skip(f"this CPU cannot run the {isa} kernels: it lacks {', '.join(lacking)}")
    forced = envs.CPU_ISA.get()
    if forced != "auto" and platform.KERNEL_ISAS.index(isa) < platform.KERNEL_ISAS.index(forced):
        pytest.skip(f"{envs.CPU_ISA.name}={forced} emulates a CPU without the {isa} level")


def kernel_at(isa: str) -> DecodeKernel:
    """The C kernels of level `isa`, or a skip that names what is missing."""
    skip_unless_runnable(isa)
    kernel = load_decode_kernel(isa)
    if kernel is None:
        pytest.skip("no C compiler here, so the native kernels cannot be built")
    if kernel.isa != isa:
        pytest.skip(f"the C compiler here cannot build the {isa} kernels")
    return kernel


def force_level(isa: str, monkeypatch: pytest.MonkeyPatch) -> DecodeKernel:
    """Makes backends built from now on use level `isa` (RADIXSERVE_CPU_ISA); returns its kernels."""
    kernel = kernel_at(isa)
    monkeypatch.setenv(envs.CPU_ISA.name, isa)
    return kernel


def select_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lets the backend use every C kernel whatever native.SELECTED says, so that tests reach the C paths."""
    from radixserve.kernels import attention as native

    everything = frozenset(native.KERNELS)
    monkeypatch.setattr(native, "SELECTED", {key: everything for key in native.SELECTED})
