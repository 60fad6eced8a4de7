"""radixserve/platform.py: reading the CPU, the kernel level and its switch, and `--dtype auto` by hardware.

The dtype decision is a pure function of the visible features (and a measured bf16 slowdown), tested as a
table; the end-to-end test starts a server that emulates a CPU without native bf16 and checks that the
start-up line and /get_server_info report the choice and its reason.
"""

from __future__ import annotations

import logging
import re

import pytest

from radixserve import envs, platform
from radixserve.platform import CpuInfo, auto_dtype

AVX2 = frozenset({"avx2", "fma", "f16c"})
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
ZEN4 = AVX512 | {"avx512_bf16"}
SAPPHIRE_RAPIDS = AVX512 | {"avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16"}
GRAVITON3 = frozenset({"neon", "sve", "arm_bf16"})
GRAVITON2 = frozenset({"neon"})
NO_NATIVE = "no native bf16 matrix products"

# (device, visible features, measured bf16 / float32 time or None) -> (dtype, words the reason must hold)
DECISIONS = [
    ("cuda", frozenset(), None, "bfloat16", "CUDA"),
    ("cpu", SAPPHIRE_RAPIDS, None, "bfloat16", "native here (amx_bf16, avx512_bf16)"),
    ("cpu", SAPPHIRE_RAPIDS, 3.0, "bfloat16", "native here (amx_bf16, avx512_bf16)"),  # AMX: trusted
    ("cpu", ZEN4, None, "bfloat16", "native here (avx512_bf16)"),
    ("cpu", ZEN4, 0.55, "bfloat16", "native here (avx512_bf16), measured 0.55x the float32 time"),
    ("cpu", ZEN4, 1.15, "bfloat16", "native here (avx512_bf16), measured 1.15x"),  # within the noise margin
    ("cpu", ZEN4, 1.7, "float32", "present (avx512_bf16), but bf16 matmuls measured 1.7x slower"),
    ("cpu", GRAVITON3, None, "bfloat16", "native here (arm_bf16)"),
    ("cpu", AVX512, 1.9, "float32", "measured 1.9x slower"),  # Skylake / Ice Lake class
    ("cpu", AVX2, 6.7, "float32", "measured 6.7x slower"),  # the reporter's AVX2-only EPYC
    ("cpu", AVX2, None, "float32", "not measured"),
    ("cpu", GRAVITON2, 3.0, "float32", "measured 3.0x slower"),
    ("cpu", frozenset({"sse4_2"}), 3.0, "float32", "measured 3.0x slower"),  # no AVX2: float32 weights too
    ("cpu", AVX2 | {"avx_ne_convert"}, 0.8, "bfloat16", "measured 1.25x as fast"),  # a measured win
    ("cpu", AVX2, 1.0, "bfloat16", "measured 1.00x as fast"),  # "at least as fast" includes a tie
]


@pytest.mark.parametrize("device, features, slowdown, dtype, words", DECISIONS)
def test_auto_dtype_decision_table(device, features, slowdown, dtype, words):
    choice = auto_dtype(device, features, slowdown)
    assert choice.dtype == dtype
    assert words in choice.reason
    native = device == "cuda" or bool(features & {"amx_bf16", "avx512_bf16", "arm_bf16"})
    assert (NO_NATIVE in choice.reason) == (not native)
    # float32 on a CPU with AVX2 + FMA keeps the linear weights in bf16 (computed in float32), and says so
    bf16_weights = dtype == "float32" and {"avx2", "fma"} <= features
    assert choice.weights == ("bfloat16" if bf16_weights else None)
    assert (platform.BF16_WEIGHTS_REASON in choice.reason) == bf16_weights


def _fake_cpu(monkeypatch: pytest.MonkeyPatch, features: frozenset[str], arch: str = "x86_64") -> CpuInfo:
    info = CpuInfo(arch, "test CPU", features, 4, 8, "AVX2")
    monkeypatch.setattr(platform, "cpu_info", lambda: info)
    return info


def test_kernel_level_follows_the_cpu_and_the_switch(monkeypatch):
    monkeypatch.delenv(envs.CPU_ISA.name, raising=False)
    _fake_cpu(monkeypatch, AVX2)
    assert platform.kernel_isa() == "avx2" and platform.runnable_isas() == ["avx2", "portable"]
    monkeypatch.setenv(envs.CPU_ISA.name, "portable")
    assert platform.kernel_isa() == "portable"
    monkeypatch.setenv(envs.CPU_ISA.name, "avx512")  # up is refused, naming what is missing
    with pytest.raises(envs.EnvError, match="lacks avx512bw, avx512dq, avx512f, avx512vl"):
        platform.kernel_isa()
    monkeypatch.setenv(envs.CPU_ISA.name, "sse9")
    with pytest.raises(envs.EnvError, match="RADIXSERVE_CPU_ISA='sse9'"):
        platform.kernel_isa()
    _fake_cpu(monkeypatch, GRAVITON3, arch="aarch64")
    monkeypatch.delenv(envs.CPU_ISA.name)
    assert platform.kernel_isa() == "portable" and platform.kernel_class() == "portable"


def test_forcing_a_level_hides_the_features_above_it(monkeypatch):
    _fake_cpu(monkeypatch, SAPPHIRE_RAPIDS)
    monkeypatch.delenv(envs.CPU_ISA.name, raising=False)
    assert platform.visible_features() == SAPPHIRE_RAPIDS and platform.kernel_class() == "amx"
    monkeypatch.setenv(envs.CPU_ISA.name, "avx512_bf16")  # a Zen 4: no AMX
    assert "amx_bf16" not in platform.visible_features() and platform.kernel_class() == "avx512_bf16"
    from radixserve.kernels.quant import best_quant_isa

    # every CPU with AVX512-BF16 has AVX512-VNNI too, so the packed kernels keep it; not the VEX form (Zen 4 lacks it)
    assert "avx512_vnni" in platform.visible_features() and "avx_vnni" not in platform.visible_features()
    assert best_quant_isa() == "avx512_vnni"
    monkeypatch.setenv(envs.CPU_ISA.name, "avx512")  # Skylake-SP: neither
    assert "avx512_vnni" not in platform.visible_features() and best_quant_isa() == "avx2"
    monkeypatch.setenv(envs.CPU_ISA.name, "avx2")
    assert platform.visible_features() == {"avx2", "fma", "f16c"}  # f16c: every AVX2 CPU has it
    assert best_quant_isa() == "avx2"  # the packed kernels follow the forced level (no VNNI of either width)
    monkeypatch.setattr(platform, "measure_bf16_slowdown", lambda: 4.0)
    choice = platform.choose_dtype("auto", "cpu")
    assert choice.dtype == "float32" and "measured 4.0x slower" in choice.reason


def test_explicit_bf16_without_native_support_warns_once_with_the_slowdown(monkeypatch, caplog):
    _fake_cpu(monkeypatch, AVX2)
    monkeypatch.delenv(envs.CPU_ISA.name, raising=False)
    monkeypatch.setattr(platform, "measure_bf16_slowdown", lambda: 6.7)
    platform._warn_slow_bf16.cache_clear()
    with caplog.at_level(logging.WARNING, logger="radixserve.platform"):
        for _ in range(3):
            choice = platform.choose_dtype("bfloat16", "cpu")
            assert choice.dtype == "bfloat16" and choice.reason == "explicit --dtype"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "6.7x slower than float32" in warnings[0]
    platform._warn_slow_bf16.cache_clear()
    caplog.clear()
    _fake_cpu(monkeypatch, SAPPHIRE_RAPIDS)  # native: no measurement, no warning
    monkeypatch.setattr(platform, "measure_bf16_slowdown", lambda: pytest.fail("measured on a native CPU"))
    assert platform.choose_dtype("bfloat16", "cpu").dtype == "bfloat16"
    assert platform.choose_dtype("auto", "cpu").dtype == "bfloat16"
    assert not caplog.records


def test_bf16_measurement_is_a_positive_ratio_cached_per_process():
    first = platform.measure_bf16_slowdown()
    assert first > 0 and platform.measure_bf16_slowdown() is first


X86_CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
physical id\t: 0
core id\t\t: 0
flags\t\t: fpu sse2 avx avx2 fma f16c bmi2

processor\t: 1
physical id\t: 0
core id\t\t: 0
flags\t\t: fpu sse2 avx avx2 fma f16c bmi2

processor\t: 2
physical id\t: 0
core id\t\t: 1
flags\t\t: fpu sse2 avx avx2 fma f16c bmi2
"""
ARM_CPUINFO = """processor\t: 0
BogoMIPS\t: 2100.00
Features\t: fp asimd evtstrm aes sve bf16 i8mm

processor\t: 1
Features\t: fp asimd evtstrm aes sve bf16 i8mm
"""


def test_cpuinfo_parsing(monkeypatch):
    monkeypatch.setattr(platform, "_read_cpuinfo", lambda: X86_CPUINFO)
    fields = platform._cpuinfo_fields()
    assert platform._features("x86_64", fields) == AVX2
    assert platform._model_name(fields) == "AMD EPYC 7B13"
    assert platform._physical_cores(fields) == 2  # two hyperthreads of core 0, one of core 1
    monkeypatch.setattr(platform, "_read_cpuinfo", lambda: ARM_CPUINFO)
    assert platform._features("aarch64", platform._cpuinfo_fields()) == GRAVITON3
    monkeypatch.setattr(platform, "_read_cpuinfo", lambda: "")
    assert platform._features("arm64", platform._cpuinfo_fields()) == {"neon"}  # macOS: no /proc/cpuinfo


def test_this_machine_is_described():
    info = platform.cpu_info()
    described = platform.describe()
    assert described["kernel_isa"] in platform.runnable_isas() and described["physical_cores"] >= 1
    assert set(described["visible_features"]) <= set(described["features"])
    assert described["torch_cpu_capability"] == info.torch_capability
    assert info.model in platform.summary_line()


def test_only_platform_reads_proc_cpuinfo():
    from pathlib import Path

    import radixserve

    root = Path(radixserve.__file__).parent
    readers = sorted(str(p.relative_to(root)) for p in root.rglob("*.py") if "/proc/cpuinfo" in p.read_text())
    assert readers == ["platform.py"]


@pytest.mark.slow
def test_server_reports_the_auto_dtype_and_why():
    """A server emulating a CPU without native bf16 (our level and torch's forced down) picks by measurement
    and says so in its start-up line and in /get_server_info."""
    from server_harness import start_server

    from radixserve.bench.docs import class_env

    level = "avx2" if "avx2" in platform.runnable_isas() else "portable"
    server = start_server("--dtype", "auto", "--max-total-tokens", "512", "--log-level", "info",
                          env=class_env(level))
    try:
        report = server.info()["platform"]
        dtype, reason = report["dtype"], report["dtype_reason"]
        assert NO_NATIVE in reason and ("slower than float32" in reason) == (dtype == "float32")
        assert server.info()["model"]["dtype"] == dtype
        linear = {part: e["choice"] for part, e in report["execution_plan"].items() if part.startswith("linear ")}
        bf16_weights = dtype == "float32" and level == "avx2"
        assert linear and all(("bf16_weights" in choice) == bf16_weights for choice in linear.values())
        assert report["cpu"]["kernel_isa"] == level and report["cpu"]["kernel_isa_forced"] is True
        assert report["attention_kernels"]["level"] == level and "decode" in report["attention_kernels"]["used"]
        line = next(ln for ln in server.log_tail(200_000).splitlines() if "| dtype " in ln)
        assert f"dtype {dtype} ({reason})" in line
        assert re.search(rf"radixserve kernels {level} \(forced by RADIXSERVE_CPU_ISA", line)
    finally:
        server.stop()


def test_bench_header_and_class_environments(monkeypatch):
    from radixserve.bench.docs import CPU_CLASSES, class_env, cpu_header, runnable_classes

    assert class_env("amx") == {} and class_env("avx2", torch_follows=False) == {"RADIXSERVE_CPU_ISA": "avx2"}
    assert class_env("avx2")["ONEDNN_MAX_CPU_ISA"] == "AVX2" and class_env("avx2")["ATEN_CPU_CAPABILITY"] == "avx2"
    assert set(runnable_classes()) <= set(CPU_CLASSES) and "portable" in runnable_classes()
    monkeypatch.setattr(platform, "measure_bf16_slowdown", lambda: 2.5)
    monkeypatch.setenv(envs.CPU_ISA.name, "portable")
    header = cpu_header("auto")
    assert "radixserve kernels portable (forced by RADIXSERVE_CPU_ISA" in header
    assert "Dtype: float32 (auto: no native bf16 matrix products" in header and "2.5x slower" in header
