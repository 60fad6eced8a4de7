"""Builds and loads the C decode-attention kernel (csrc/decode_attention.c) with the system C compiler.

The shared library is compiled once per machine (-O3 -march=native -fopenmp) into
$RADIXSERVE_CACHE_DIR/kernels (default ~/.cache/radixserve/kernels), keyed by the source and the
CPU's flags, and called through ctypes (which releases the GIL). It links the same libgomp as
torch, so it runs on torch's OpenMP thread pool. Without a compiler, `load_decode_kernel` returns
None and the caller keeps the torch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "decode_attention.c"
MAX_DIM, MAX_GROUP = 256, 16
_FUNCTIONS = {torch.bfloat16: "decode_attention_bf16", torch.float32: "decode_attention_f32"}


class DecodeKernel:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fns = {}
        for dtype, name in _FUNCTIONS.items():
            fn = getattr(lib, name)
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 5 + [ctypes.c_float, ctypes.c_int]
            self._fns[dtype] = fn

    def supports(self, q: torch.Tensor, num_kv_heads: int) -> bool:
        heads, dim = q.shape[1], q.shape[2]
        return (q.device.type == "cpu" and q.dtype in self._fns and dim <= MAX_DIM
                and heads % num_kv_heads == 0 and heads // num_kv_heads <= MAX_GROUP)

    def __call__(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, kv_indices: torch.Tensor,
                 seq_lens: torch.Tensor, max_len: int, scale: float) -> torch.Tensor:
        """q [bs, heads, dim]; k/v_buf [slots, kv_heads, dim]; kv_indices int32 [bs * max_len]; -> [bs, heads, dim]."""
        q = q.contiguous()
        kv_indices = kv_indices.to(torch.int32).contiguous()  # NOTE: the kernel reads int32 slots
        seq_lens = seq_lens.to(torch.int64).contiguous()
        if not (k_buf.is_contiguous() and v_buf.is_contiguous() and k_buf.dtype == v_buf.dtype == q.dtype):
            raise ValueError("decode kernel needs contiguous K/V buffers of the query's dtype")
        out = torch.empty_like(q)
        bs, heads, dim = q.shape
        with torch.profiler.record_function("radixserve::decode_attention_cpu"):
            status = self._fns[q.dtype](
                q.data_ptr(), k_buf.data_ptr(), v_buf.data_ptr(), kv_indices.data_ptr(), seq_lens.data_ptr(),
                out.data_ptr(), bs, max_len, heads, k_buf.shape[1], dim, scale, torch.get_num_threads())
        if status != 0:
            raise ValueError(f"decode kernel rejected shapes heads={heads} kv_heads={k_buf.shape[1]} dim={dim}")
        return out


@functools.cache
def load_decode_kernel() -> DecodeKernel | None:
    """The compiled kernel, or None (logged once) when it cannot be built here."""
    try:
        return DecodeKernel(ctypes.CDLL(str(_build())))
    except (OSError, subprocess.CalledProcessError, FileNotFoundError) as e:
        logger.warning("native CPU decode kernel unavailable (%s); using the torch decode path", e)
        return None


def _build() -> Path:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise FileNotFoundError("no C compiler (cc/gcc) on PATH")
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + _cpu_flags().encode() + compiler.encode()).hexdigest()[:16]
    target = _cache_dir() / f"decode_attention-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        cmd = [compiler, "-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c11", str(SOURCE),
               "-o", str(built), "-lm"]
        subprocess.run(cmd, check=True, capture_output=True, timeout=300)
        os.replace(built, target)  # NOTE: atomic, so concurrent builders never load a half-written file
    logger.info("built %s", target)
    return target


def _cache_dir() -> Path:
    root = os.environ.get("RADIXSERVE_CACHE_DIR") or Path.home() / ".cache" / "radixserve"
    return Path(root) / "kernels"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""
