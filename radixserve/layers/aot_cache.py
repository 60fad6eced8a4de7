"""Small torch functions compiled ahead of time by inductor's C++ backend (AOTInductor), cached on disk.

`compile_aot_op` exports a module with torch.export (the dimensions named in `dynamic` stay symbolic),
compiles it with `torch._inductor.aoti_compile_and_package` into
$RADIXSERVE_CACHE_DIR/aoti/<name>-<key>.pt2 and loads it. The key covers the module's source, the
example inputs' static shapes and dtypes, torch's version and the CPU's capability, so a change to any
of them compiles anew; a later start only loads the file (milliseconds). Compiling takes seconds per
op and is logged, since the first start waits for it.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import os
import shutil
import tempfile
import threading
import time
import warnings
from pathlib import Path

import torch
from torch import nn

from radixserve import envs

logger = logging.getLogger(__name__)

DynamicDims = dict[int, tuple[str, int]]  # input index -> (dimension name, axis)
MAX_DYNAMIC = 1 << 30
# NOTE: emulate_precision_casts rounds every intermediate to the model dtype as eager torch does, so a
# compiled op follows the eager layers' bf16 rounding; dynamic_threads reads OpenMP's thread count at
# run time (the default bakes in torch's count at compile time, and the file outlives that setting).
COMPILE_OPTIONS = {"emulate_precision_casts": True, "cpp.dynamic_threads": True}
_lock = threading.Lock()
_loaded: dict[str, AotOp] = {}  # key -> op: one load per process however many runners ask


class AotOp:
    """A compiled op: `op(*tensors)` returns its output tensor, or a tuple of them."""

    def __init__(self, name: str, path: Path, loader) -> None:
        self.name, self.path = name, path
        self._run = loader.run  # NOTE: straight into the compiled code, no pytree handling

    def __call__(self, *args: torch.Tensor):
        if torch.autograd._profiler_enabled():  # NOTE: compiled code is invisible to torch.profiler otherwise
            with torch.profiler.record_function(f"radixserve::fused::{self.name}"):
                out = self._run(list(args))
        else:
            out = self._run(list(args))
        return out[0] if len(out) == 1 else tuple(out)

    def __repr__(self) -> str:
        return f"AotOp({self.name}, {self.path.name})"


def compile_aot_op(name: str, module: nn.Module, example_inputs: tuple[torch.Tensor, ...],
                   dynamic: DynamicDims) -> AotOp:
    """The module compiled for inputs like `example_inputs` (the `dynamic` dimensions may vary)."""
    key = cache_key(module, example_inputs, dynamic)
    # NOTE: torch.export and inductor warn about their own internals (deprecations) on first use
    with _lock, warnings.catch_warnings():
        warnings.simplefilter("ignore", (DeprecationWarning, FutureWarning))
        if key not in _loaded:
            path = envs.CACHE_DIR.get() / "aoti" / f"{name}-{key}.pt2"
            if not path.exists():
                _compile(name, module, example_inputs, dynamic, path)
            _loaded[key] = AotOp(name, path, _load_package(path))
        return _loaded[key]


def _load_package(path: Path):
    """The compiled package's runner. NOTE: straight through torch's C++ loader: `aoti_load_package` imports
    inductor and dynamo (~1.2 s) and asks inductor which vector ISA this CPU has, which it answers by building
    and dlopen-probing a test library per ISA in subprocesses (~1.6 s); a warm start needs neither."""
    # NOTE: the loader unpacks the package into $TMPDIR/aotinductor_XXXXXX and removes that folder only
    # when it is destroyed, which a process ended by a signal (a server's scheduler) never does: every
    # such start left ~1.6 MB per op in /tmp. So it unpacks into a folder of ours, removed as soon as the
    # library is mapped (the mapping outlives the file; the loader's own removal then finds nothing).
    unpack = tempfile.mkdtemp(prefix="radixserve-aoti-")
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = unpack  # NOTE: read by the C++ loader's mkdtemp; start-up only, under _lock
    try:
        return torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
    finally:
        if before is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = before
        shutil.rmtree(unpack, ignore_errors=True)


def cache_key(module: nn.Module, example_inputs: tuple[torch.Tensor, ...], dynamic: DynamicDims) -> str:
    settings = sorted((k, v) for k, v in vars(module).items() if isinstance(v, (bool, int, float, str)))
    parts = [inspect.getsource(type(module)), repr(settings), repr(sorted(COMPILE_OPTIONS.items())), torch.__version__,
             torch.backends.cpu.get_cpu_capability()]
    for i, t in enumerate(example_inputs):
        dims = [("*" if i in dynamic and dynamic[i][1] == axis else str(n)) for axis, n in enumerate(t.shape)]
        parts.append(f"{i}:{t.dtype}:{'x'.join(dims)}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _compile(name: str, module: nn.Module, example_inputs: tuple[torch.Tensor, ...], dynamic: DynamicDims,
             path: Path) -> None:
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in example_inputs if t.is_floating_point()})
    logger.info("compiling fused op %s (%s) with inductor's C++ backend; first start only, cached in %s",
                name, "/".join(dtypes), path.parent)
    import torch._inductor  # noqa: F401 (heavy: only to compile; loading does not need it)
    import torch.export

    start = time.perf_counter()
    dims: dict[str, torch.export.Dim] = {}
    shapes = []
    for i in range(len(example_inputs)):
        if i in dynamic:
            dim_name, axis = dynamic[i]
            dims.setdefault(dim_name, torch.export.Dim(dim_name, min=1, max=MAX_DYNAMIC))
            shapes.append({axis: dims[dim_name]})
        else:
            shapes.append(None)
    with torch.no_grad():
        exported = torch.export.export(module, example_inputs, dynamic_shapes=tuple(shapes))
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        built = Path(tmp) / path.name
        with torch._inductor.config.patch(COMPILE_OPTIONS):
            torch._inductor.aoti_compile_and_package(exported, package_path=str(built))
        os.replace(built, path)  # NOTE: atomic: a concurrent starter never loads a half-written package
    logger.info("compiled %s in %.1f s", name, time.perf_counter() - start)
