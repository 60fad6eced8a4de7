"""What every benchmark shares: the machine's header line, torch's own ISA switches, and replacing a
benchmark's marked section of docs/benchmarks.md."""

from __future__ import annotations

import os
from pathlib import Path

from radixserve import platform

# The CPU classes a benchmark can emulate on a machine with AVX-512 BF16 and AMX, best first: our
# kernel level (RADIXSERVE_CPU_ISA; `amx` is the machine as it is) and torch's own switches for the same
# class: ATen's vectorized ops (ATEN_CPU_CAPABILITY), oneDNN's GEMMs (ONEDNN_MAX_CPU_ISA; bf16 ones
# included) and MKL's float32 GEMMs (MKL_ENABLE_INSTRUCTIONS). RADIXSERVE_CPU_ISA alone changes only ours.
CPU_CLASSES = ("amx", "avx512_bf16", "avx512", "avx2", "portable")
TORCH_ISA_ENV: dict[str, dict[str, str]] = {
    "amx": {},
    "avx512_bf16": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
    "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI",
               "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "portable": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41",
                 "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
}


def class_env(cpu_class: str, torch_follows: bool = True) -> dict[str, str]:
    """The environment that makes radixserve (and, with torch_follows, torch) run as on a `cpu_class` CPU."""
    ours = {} if cpu_class == "amx" else {"RADIXSERVE_CPU_ISA": cpu_class}
    return ours | (TORCH_ISA_ENV[cpu_class] if torch_follows else {})


def runnable_classes() -> list[str]:
    """The classes this CPU can emulate (amx only where it has AMX-BF16)."""
    isas = platform.runnable_isas()
    return [c for c in CPU_CLASSES if (c in isas) or (c == "amx" and "amx_bf16" in platform.cpu_info().features
                                                       and "avx512_bf16" in isas)]


def cpu_name() -> str:
    return platform.cpu_name()


def torch_isa_switches() -> str:
    """The torch ISA switches set in this process, e.g. `ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`."""
    names = sorted({name for env in TORCH_ISA_ENV.values() for name in env})
    return " ".join(f"{name}={os.environ[name]}" for name in names if os.environ.get(name))


def resolved_dtype(dtype: str) -> str:
    """The dtype `--dtype <dtype>` runs as on this CPU ("float32", "bfloat16"): what a peer engine is given."""
    return str(platform.choose_dtype(dtype, "cpu").dtype).replace("torch.", "")


def peer_version(python: str, module: str = "vllm") -> str:
    """`module.__version__` as the peer's own interpreter (its venv) reports it; empty if it cannot."""
    import subprocess

    return subprocess.run([python, "-c", f"import {module}; print({module}.__version__)"], capture_output=True,
                          text=True).stdout.strip()


def cpu_header(dtype: str | None = None) -> str:
    """One line for a benchmark's header: the CPU, its features, torch's and our kernel level, and the dtype
    (`auto` is resolved and its reason given)."""
    line = f"CPU: {platform.summary_line()}"
    switches = torch_isa_switches()
    if switches:
        line += f"; torch switches {switches}"
    if dtype is not None:
        choice = platform.choose_dtype(dtype, "cpu")
        line += f". Dtype: {choice.dtype}" + (f" (auto: {choice.reason})" if dtype == "auto" else "")
    return line


def write_doc_section(path: str | Path, start: str, end: str, body: str) -> None:
    """Replace the text between the `start` and `end` markers of `path`, or append a new marked section."""
    path = Path(path)
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    section = f"{start}\n{body.strip()}\n{end}"
    if start in text and end in text:
        before, rest = text.split(start, 1)
        text = before + section + rest.split(end, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
