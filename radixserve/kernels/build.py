"""The one builder of radixserve's native code: C sources (csrc/) + an ISA level -> a cached shared library.

`build_library` compiles one source with one level's flags; `build_level_library` compiles several sources at
one kernel level (platform.ISA_FLAGS) into one library whose symbols carry the level as a suffix. A library
lands in $RADIXSERVE_CACHE_DIR/kernels under a name keyed by the sources, the headers they include, the
flags and the compiler, so a change builds a new file and concurrent builders never load a half-written one.
Only this module runs the compiler; the bindings (the other modules of kernels/) load what it built.
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
from radixserve import platform as rs_platform

logger = logging.getLogger(__name__)

BUILD_ERRORS = (OSError, subprocess.CalledProcessError, FileNotFoundError, subprocess.TimeoutExpired)
CSRC = Path(__file__).parent / "csrc"  # every C source and header of the package


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

    def build(tmp: Path, built: Path) -> None:
        cmd = [compiler, "-O3", *flags, "-fopenmp", "-fPIC", "-shared", "-std=c11", str(source), "-o", str(built),
               "-lm"]
        subprocess.run(cmd, check=True, capture_output=True, timeout=300)

    return _cached(stem, (source, *headers), " ".join(flags).encode() + compiler.encode(), build)


def build_level_library(stem: str, sources: Sequence[Path], level: str, headers: Sequence[Path] = ()) -> Path:
    """`sources` compiled at one kernel level (platform.ISA_FLAGS[level], -DRS_ISA_SUFFIX=_<level>, so every
    symbol carries the level) into one library; raises one of BUILD_ERRORS, e.g. when the compiler rejects
    the level's flags. NOTE: one level per library, built when a process first asks for it: a first start
    compiles only the level it runs (a lower one, forced by RADIXSERVE_CPU_ISA or a test, is built then)."""
    compiler = c_compiler()

    def build(tmp: Path, built: Path) -> None:
        _compile_each([compiler, "-O3", "-fopenmp", "-fPIC", "-std=c11", *rs_platform.ISA_FLAGS[level],
                       f"-DRS_ISA_SUFFIX=_{level}"], sources, tmp)
        subprocess.run([compiler, "-shared", "-fopenmp", *map(str, sorted(tmp.glob("*.o"))), "-o", str(built),
                        "-lm"], check=True, capture_output=True, timeout=300)

    recipe = repr((level, rs_platform.ISA_FLAGS[level])).encode() + compiler.encode()
    return _cached(f"{stem}-{level}", (*sources, *headers), recipe, build)


def _cached(stem: str, inputs: Sequence[Path], recipe: bytes, build: Callable[[Path, Path], None]) -> Path:
    """$RADIXSERVE_CACHE_DIR/kernels/<stem>-<key>.so, the key hashing `inputs`' bytes and `recipe`; if absent,
    `build(tmp, built)` writes it as `built` inside a fresh folder `tmp` beside it, then it is moved in."""
    text = b"".join(path.read_bytes() for path in inputs)
    target = _cache_dir() / f"{stem}-{hashlib.sha256(text + recipe).hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        build(Path(tmp), built)
        os.replace(built, target)  # NOTE: atomic, so concurrent builders never load a half-written file
    logger.info("built %s", target)
    return target


def _compile_each(cmd: list[str], sources: Sequence[Path], cwd: Path) -> None:
    """`cmd -c <source>` for every source, all at once, objects into `cwd`; raises CalledProcessError (with the
    compiler's stderr) if any fails."""
    procs = [subprocess.Popen([*cmd, "-c", str(source)], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for source in sources]
    failed = None
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        if proc.returncode != 0 and failed is None:
            failed = subprocess.CalledProcessError(proc.returncode, proc.args, stderr=err)
    if failed is not None:
        raise failed


def _cache_dir() -> Path:
    return envs.CACHE_DIR.get() / "kernels"


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
    library's `amx_request`, csrc/amx_tiles.h); None, with a warning, if either fails."""
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
