"""Builds and loads the C attention kernels (csrc/*.c) with the system C compiler.

Decode attention (decode_attention.c), shared-prefix attention for cascade attention
(prefix_attention.c) and causal extend attention (extend_attention.c) go into one shared library.
It is compiled once per machine (-O3 -march=native -fopenmp) into
$RADIXSERVE_CACHE_DIR/kernels (default ~/.cache/radixserve/kernels), keyed by the sources and the
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

from radixserve import envs

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = (CSRC / "decode_attention.c", CSRC / "prefix_attention.c", CSRC / "extend_attention.c")
HEADERS = (CSRC / "attention_common.h", CSRC / "attention_lanes.h")
MAX_DIM, MAX_GROUP = 256, 16
_DTYPE_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}


class DecodeKernel:
    """Paged decode attention, attention of all queries over a prefix shared by the batch, and causal
    extend attention; all read K/V in place from the pool."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fns = {dtype: _bind(lib, f"decode_attention_{suffix}", pointers=8, sizes=5)
                     for dtype, suffix in _DTYPE_SUFFIX.items()}
        self._prefix_fns = {dtype: _bind(lib, f"prefix_attention_{suffix}", pointers=6, sizes=5)
                            for dtype, suffix in _DTYPE_SUFFIX.items()}
        self._extend_fns = {dtype: _bind(lib, f"extend_attention_{suffix}", pointers=9, sizes=4)
                            for dtype, suffix in _DTYPE_SUFFIX.items()}
        vectorized = lib.extend_attention_vectorized
        vectorized.restype, vectorized.argtypes = ctypes.c_int, [ctypes.c_int, ctypes.c_int64]
        self._extend_vectorized = functools.cache(lambda bf16, dim: bool(vectorized(bf16, dim)))

    def supports(self, q: torch.Tensor, num_kv_heads: int) -> bool:
        heads, dim = q.shape[1], q.shape[2]
        return (q.device.type == "cpu" and q.dtype in self._fns and dim <= MAX_DIM
                and heads % num_kv_heads == 0 and heads // num_kv_heads <= MAX_GROUP)

    def extend_supports(self, q: torch.Tensor, k_buf: torch.Tensor) -> bool:
        """Whether `extend` runs its vectorized (AVX-512) path here, the only one measured faster than SDPA."""
        heads, dim = q.shape[1], q.shape[2]
        return (q.device.type == "cpu" and q.dtype in self._extend_fns and k_buf.dtype == q.dtype
                and heads % k_buf.shape[1] == 0 and self._extend_vectorized(q.dtype == torch.bfloat16, dim))

    def __call__(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, kv_indices: torch.Tensor,
                 seq_lens: torch.Tensor, max_len: int, scale: float,
                 seed: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """q [bs, heads, dim]; k/v_buf [slots, kv_heads, dim]; kv_indices int32 [bs * max_len]; -> [bs, heads, dim].

        `seed`: (out [bs, heads, dim], float32 lse [bs, heads]) of each query head over other keys (the
        shared prefix); the result is then attention over those keys and kv_indices together."""
        q = q.contiguous()
        kv_indices = kv_indices.to(torch.int32).contiguous()  # NOTE: the kernel reads int32 slots
        seq_lens = seq_lens.to(torch.int64).contiguous()
        _check_buffers(q, k_buf, v_buf)
        seed_out, seed_lse = _seed(seed, q)
        out = torch.empty_like(q)
        bs, heads, dim = q.shape
        with torch.profiler.record_function("radixserve::decode_attention_cpu"):
            status = self._fns[q.dtype](
                q.data_ptr(), k_buf.data_ptr(), v_buf.data_ptr(), kv_indices.data_ptr(), seq_lens.data_ptr(),
                _ptr(seed_out), _ptr(seed_lse), out.data_ptr(), bs, max_len, heads, k_buf.shape[1], dim, scale,
                torch.get_num_threads())
        _check_status(status, q, k_buf)
        return out

    def shared_prefix(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, slots: torch.Tensor,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Every query token [n, heads, dim] over the same slots (int32 [prefix_len], no mask).

        Returns the output [n, heads, dim] and the log-sum-exp, float32 [n, heads]."""
        q, slots = q.contiguous(), slots.to(torch.int32).contiguous()
        _check_buffers(q, k_buf, v_buf)
        out, lse = torch.empty_like(q), torch.empty(q.shape[:2], dtype=torch.float32)
        n, heads, dim = q.shape
        with torch.profiler.record_function("radixserve::prefix_attention_cpu"):
            status = self._prefix_fns[q.dtype](
                q.data_ptr(), k_buf.data_ptr(), v_buf.data_ptr(), slots.data_ptr(), out.data_ptr(), lse.data_ptr(),
                n, slots.shape[0], heads, k_buf.shape[1], dim, scale, torch.get_num_threads())
        _check_status(status, q, k_buf)
        return out, lse

    def extend(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, kv_indices: torch.Tensor,
               reqs: torch.Tensor, scale: float, seed: tuple[torch.Tensor, torch.Tensor] | None = None,
               with_lse: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Causal attention of each request's new tokens over its context, read in place from the pool.

        q [tokens, heads, dim]; kv_indices int32 (the requests' context slots, concatenated); reqs int64
        [bs, 4], a row (q_start, q_len, kv_start, kv_len) per request, kv_len >= q_len >= 1: query i of the
        request sees its first kv_len - q_len + i + 1 context slots. `seed` as for decode. Returns the
        output [tokens, heads, dim] and, with `with_lse`, the float32 log-sum-exp [tokens, heads]."""
        q, kv_indices, reqs = q.contiguous(), kv_indices.to(torch.int32).contiguous(), reqs.contiguous()
        _check_buffers(q, k_buf, v_buf)
        if reqs.dtype != torch.int64 or reqs.dim() != 2 or reqs.shape[1] != 4:
            raise ValueError("extend kernel needs reqs as int64 [bs, 4]")
        seed_out, seed_lse = _seed(seed, q)
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:2], dtype=torch.float32) if with_lse else None
        with torch.profiler.record_function("radixserve::extend_attention_cpu"):
            status = self._extend_fns[q.dtype](
                q.data_ptr(), k_buf.data_ptr(), v_buf.data_ptr(), kv_indices.data_ptr(), reqs.data_ptr(),
                _ptr(seed_out), _ptr(seed_lse), out.data_ptr(), _ptr(lse), reqs.shape[0], q.shape[1], k_buf.shape[1],
                q.shape[2], scale, torch.get_num_threads())
        _check_status(status, q, k_buf)
        return out, lse


def _bind(lib: ctypes.CDLL, name: str, pointers: int, sizes: int):
    fn = getattr(lib, name)
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * pointers + [ctypes.c_int64] * sizes + [ctypes.c_float, ctypes.c_int]
    return fn


def _seed(seed: tuple[torch.Tensor, torch.Tensor] | None, q: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    if seed is None:
        return None, None
    out, lse = seed[0].contiguous(), seed[1].contiguous()
    if out.shape != q.shape or out.dtype != q.dtype or lse.dtype != torch.float32 or lse.shape != q.shape[:2]:
        raise ValueError("a kernel seed must be (out like the query, float32 lse [tokens, heads])")
    return out, lse


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _check_buffers(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor) -> None:
    if not (k_buf.is_contiguous() and v_buf.is_contiguous() and k_buf.dtype == v_buf.dtype == q.dtype):
        raise ValueError("attention kernels need contiguous K/V buffers of the query's dtype")


def _check_status(status: int, q: torch.Tensor, k_buf: torch.Tensor) -> None:
    if status != 0:
        raise ValueError(f"attention kernel rejected shapes heads={q.shape[1]} kv_heads={k_buf.shape[1]} "
                         f"dim={q.shape[2]}")


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
    source = b"".join(path.read_bytes() for path in (*SOURCES, *HEADERS))
    key = hashlib.sha256(source + _cpu_flags().encode() + compiler.encode()).hexdigest()[:16]
    target = _cache_dir() / f"attention-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        cmd = [compiler, "-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c11",
               *(str(path) for path in SOURCES), "-o", str(built), "-lm"]
        subprocess.run(cmd, check=True, capture_output=True, timeout=300)
        os.replace(built, target)  # NOTE: atomic, so concurrent builders never load a half-written file
    logger.info("built %s", target)
    return target


def _cache_dir() -> Path:
    return envs.CACHE_DIR.get() / "kernels"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""
