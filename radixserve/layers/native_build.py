"""Compiling one C source into a shared library, cached by source, flags and compiler; calling into it.

The library lands in $RADIXSERVE_CACHE_DIR/kernels under a name keyed by all three, so a changed
source or flag builds a new file and concurrent builders never load a half-written one.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from radixserve import envs

logger = logging.getLogger(__name__)

BUILD_ERRORS = (OSError, subprocess.CalledProcessError, FileNotFoundError, subprocess.TimeoutExpired)


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def c_compiler() -> str:
    """$CC, else cc or gcc on PATH; raises FileNotFoundError without one."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise FileNotFoundError("no C compiler (cc/gcc) on PATH")
    return compiler


def build_library(source: Path, stem: str, flags: Sequence[str], headers: Sequence[Path] = ()) -> Path:
    """The path of `source` built with `flags` (-O3 -fopenmp -fPIC added); raises one of BUILD_ERRORS.

    `headers`: the files `source` includes, so that a changed header builds a new library too."""
    compiler = c_compiler()
    text = b"".join(path.read_bytes() for path in (source, *headers))
    key = hashlib.sha256(text + " ".join(flags).encode() + compiler.encode()).hexdigest()[:16]
    target = envs.CACHE_DIR.get() / "kernels" / f"{stem}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        cmd = [compiler, "-O3", *flags, "-fopenmp", "-fPIC", "-shared", "-std=c11", str(source), "-o", str(built),
               "-lm"]
        subprocess.run(cmd, check=True, capture_output=True, timeout=300)
        os.replace(built, target)  # NOTE: atomic, so concurrent builders never load a half-written file
    logger.info("built %s", target)
    return target


def load_library(source: Path, stem: str, flags: Sequence[str], what: str, fallback: str,
                 headers: Sequence[Path] = ()) -> ctypes.CDLL | None:
    """`source` built (build_library) and loaded, or None with a warning naming `what` and the `fallback`."""
    try:
        return ctypes.CDLL(str(build_library(source, stem, flags, headers)))
    except BUILD_ERRORS as e:
        logger.warning("%s unavailable (%s); %s", what, e, fallback)
        return None


def load_amx_library(source: Path, stem: str, flags: Sequence[str], what: str, fallback: str,
                     headers: Sequence[Path] = ()) -> ctypes.CDLL | None:
    """load_library for a kernel on AMX tiles, which also asks the OS for this process's AMX state (the
    library's `amx_request`, layers/csrc/amx_tiles.h); None, with a warning, if either fails."""
    lib = load_library(source, stem, flags, what, fallback, headers)
    if lib is None:
        return None
    lib.amx_request.restype = ctypes.c_int
    if lib.amx_request() != 0:
        logger.warning("the OS refused this process AMX state (arch_prctl); %s", fallback)
        return None
    return lib


def call_profiled(name: str, fn: Callable[..., int], *args) -> int:
    """fn(*args) (a ctypes function); named `name` for torch.profiler while one records (a ctypes call is
    invisible to it otherwise). NOTE: record_function costs ~5 us even with no profiler, hence the check."""
    if torch.autograd._profiler_enabled():
        with torch.profiler.record_function(name):
            return fn(*args)
    return fn(*args)
