"""Builds and loads the C attention kernels (csrc/*.c) with the system C compiler, one path per kernel level.

Decode attention (decode_attention.c), shared-prefix attention for cascade attention
(prefix_attention.c) and causal extend attention (extend_attention.c) go into one shared library,
compiled into $RADIXSERVE_CACHE_DIR/kernels (default ~/.cache/radixserve/kernels) once per machine and
kernel level (`platform.KERNEL_ISAS`: avx512_bf16, avx512, avx2 and portable on x86; portable elsewhere),
with that level's -m flags, never -march=native. The level to run is chosen at run time:
`platform.kernel_isa()`, the best level this CPU runs unless RADIXSERVE_CPU_ISA forces a lower one; only that
level's library is built, when first asked for (a first start compiles one level, not four). The library is
called through ctypes (which releases the GIL) and links the same libgomp as torch, so it runs on torch's
OpenMP thread pool.
Without a compiler, `load_decode_kernel` returns None and the caller keeps the torch path.

`SELECTED` says, per CPU class and dtype, which kernels measured faster than torch's own op at
SmolLM2-135M's shapes (docs/attention.md, "Kernel levels"); the backend's plan (registry.plan_attention) uses a
kernel only there. The kernels' `*_supports` say only whether a kernel can take a shape.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading

import torch

from radixserve import platform as rs_platform
from radixserve.kernels.build import BUILD_ERRORS, CSRC, build_level_library, call_profiled

logger = logging.getLogger(__name__)

SOURCES = (CSRC / "decode_attention.c", CSRC / "prefix_attention.c", CSRC / "extend_attention.c")
HEADERS = tuple(CSRC / name for name in ("attention_common.h", "simd.h", "attention_lanes.h", "attention_lane_block.h",
                                         "attention_lanes_dp.h", "decode_avx512.h"))
MAX_DIM, MAX_GROUP = 256, 16
_DTYPE_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}
# (query dtype, KV cache dtype) -> the C functions' suffix: the KV cache is in the compute dtype, or bf16 under
# float32 compute (--kv-cache-dtype bfloat16: half the bytes a decode step reads, widened as they are loaded)
_PAIR_SUFFIX = {(torch.bfloat16, torch.bfloat16): "bf16", (torch.float32, torch.float32): "f32",
                (torch.float32, torch.bfloat16): "f32_bf16kv"}
KERNELS = ("decode", "extend", "prefix")
# (kernel class, dtype) -> the kernels that measured faster than torch's op at SmolLM2-135M's shapes on
# that class of CPU (`platform.kernel_class()`; benchmarks/bench_kernels.py, 1 thread; docs/attention.md,
# "Kernel levels"). Elsewhere that part of attention stays on torch:
# - decode won on every class and dtype (1.2x-12x);
# - extend (batches whose requests have at most `RowTable.extend_kernel_new_tokens` new tokens) won on the AVX2 and
#   AVX-512 classes in float32 (1.2x-1.4x at 500 tokens) and in bf16 without AMX (1.1x-1.3x); it tied on
#   portable (0.96x-1.00x) and lost to torch's SDPA on AMX tiles in bf16 (0.50x). On avx512_bf16 in bf16 it
#   is chosen by a real Zen 4 (2.3x-4.6x faster than SDPA), though this Xeon's emulation measured 0.7x;
# - prefix (cascade's part (a)) lost to torch's CPU flash op on every class (0.3x-0.9x).
_SIMD_CLASSES = ("avx512_bf16", "avx512", "avx2")
# (kernel class, dtype) where cascade attention (a shared prefix attended once by torch's CPU flash op, the rest by
# the C kernels, merged; decode then on the Python layers, which the C decoder does not replace) measured
# slower end to end than the C kernels alone over the whole context (the C decoder included): on a Zen 4 EPYC
# in bf16, 32 requests of a shared prefix + 40 own tokens, 32 new tokens each, 3.46-3.50 s without against
# 4.04-4.40 s with at a 1,000-token prefix, 11.6-11.7 against 16.3-16.7 s at 3,000 (docs/attention.md, "When").
# Forced to the AVX2 class in float32 cascade won (6.6-6.8 against 7.4-7.7 s), at AVX-512 it tied. With AMX in bf16,
# where part (a) runs on the tiles and the C decoder takes cascade batches, it wins: 1.38-1.59 s against
# 1.93-2.26 s at a 1,000-token prefix (the AMX Xeon, 2026-12-05).
CASCADE_LOSES: frozenset[tuple[str, torch.dtype]] = frozenset({("avx512_bf16", torch.bfloat16)})
SELECTED: dict[tuple[str, torch.dtype], frozenset[str]] = {
    **{(cls, dtype): frozenset({"decode", "extend"}) for cls in _SIMD_CLASSES for dtype in _DTYPE_SUFFIX},
    ("amx", torch.float32): frozenset({"decode", "extend"}),
    ("amx", torch.bfloat16): frozenset({"decode"}),
    ("portable", torch.float32): frozenset({"decode"}),
    ("portable", torch.bfloat16): frozenset({"decode"}),
}


class DecodeKernel:
    """Paged decode attention, attention of all queries over a prefix shared by the batch, and causal
    extend attention; all read K/V in place from the pool."""

    def __init__(self, lib: ctypes.CDLL, isa: str, kernel_class: str | None = None) -> None:
        self.isa = isa  # the kernel level whose code this object calls
        self.kernel_class = kernel_class or isa  # what SELECTED is keyed by: the level, or amx
        self._fns = {pair: _bind(lib, f"decode_attention_{suffix}_{isa}", pointers=8, sizes=5)
                     for pair, suffix in _PAIR_SUFFIX.items()}
        self._prefix_fns = {pair: _bind(lib, f"prefix_attention_{suffix}_{isa}", pointers=7, sizes=5)
                            for pair, suffix in _PAIR_SUFFIX.items()}
        self._extend_fns = {pair: _bind(lib, f"extend_attention_{suffix}_{isa}", pointers=9, sizes=5)
                            for pair, suffix in _PAIR_SUFFIX.items()}
        width = getattr(lib, f"attention_simd_width_{isa}")
        width.restype, width.argtypes = ctypes.c_int, []
        self.simd_width = int(width())  # float32 lanes of the level's vector code; 1: portable loops only

    def decode_address(self, dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> int:
        """The decode kernel's C function for `dtype` queries over a `kv_dtype` cache (default: the same) (for C
        code that calls it itself: models/c_decoder.py)."""
        return ctypes.cast(self._fns[dtype, kv_dtype or dtype], ctypes.c_void_p).value

    def prefix_address(self, dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> int | None:
        """The prefix kernel's C function (cascade's part (a)) for `dtype` queries over a `kv_dtype` cache, or None
        (the C decoder calls it for cascade batches)."""
        fn = self._prefix_fns.get((dtype, kv_dtype or dtype))
        return None if fn is None else ctypes.cast(fn, ctypes.c_void_p).value

    def supports(self, q: torch.Tensor, num_kv_heads: int, kv_dtype: torch.dtype | None = None) -> bool:
        """Whether this kernel can run decode attention of `q` (shape and dtype) over a `kv_dtype` cache (default:
        q's dtype)."""
        heads, dim = q.shape[1], q.shape[2]
        return (q.device.type == "cpu" and (q.dtype, kv_dtype or q.dtype) in self._fns and dim <= MAX_DIM
                and heads % num_kv_heads == 0 and heads // num_kv_heads <= MAX_GROUP)

    def extend_supports(self, q: torch.Tensor, k_buf: torch.Tensor) -> bool:
        """Whether this kernel can run extend attention of `q` over `k_buf` (shape and dtype)."""
        heads, dim = q.shape[1], q.shape[2]
        return (q.device.type == "cpu" and (q.dtype, k_buf.dtype) in self._extend_fns
                and heads % k_buf.shape[1] == 0 and dim <= MAX_DIM)

    def prefix_supports(self, q: torch.Tensor, num_kv_heads: int, kv_dtype: torch.dtype | None = None) -> bool:
        """Whether this kernel can run cascade's part (a) (`shared_prefix`) for `q` over a `kv_dtype` cache."""
        heads, dim = q.shape[1], q.shape[2]
        return (q.device.type == "cpu" and (q.dtype, kv_dtype or q.dtype) in self._prefix_fns and dim <= MAX_DIM
                and heads % num_kv_heads == 0)

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
        status = call_profiled(
            "radixserve::decode_attention_cpu", self._fns[q.dtype, k_buf.dtype],
            q.data_ptr(), k_buf.data_ptr(), v_buf.data_ptr(), kv_indices.data_ptr(), seq_lens.data_ptr(),
            _ptr(seed_out), _ptr(seed_lse), out.data_ptr(), bs, max_len, heads, k_buf.shape[1], dim, scale,
            torch.get_num_threads())
        _check_status(status, q, k_buf)
        return out

    def shared_prefix(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, slots: torch.Tensor,
                      scale: float, first: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Every query token [n, heads, dim] over the same slots (int32 [prefix_len]).

        `first` (int32 [n], 0 .. prefix_len; None: no mask): query token i sees slots[first[i]:] only (a window
        layer's query sees the shared keys inside its window); a token with first == prefix_len sees none, and
        gets output 0 and log-sum-exp -inf. Returns the output [n, heads, dim] and the log-sum-exp, float32
        [n, heads]."""
        q, slots = q.contiguous(), slots.to(torch.int32).contiguous()
        _check_buffers(q, k_buf, v_buf)
        if first is not None:
            first = first.to(torch.int32).contiguous()
            if first.shape != q.shape[:1]:
                raise ValueError("shared_prefix needs `first` as one index per query token")
        out, lse = torch.empty_like(q), torch.empty(q.shape[:2], dtype=torch.float32)
        n, heads, dim = q.shape
        status = call_profiled(
            "radixserve::prefix_attention_cpu", self._prefix_fns[q.dtype, k_buf.dtype],
            q.data_ptr(), k_buf.data_ptr(), v_buf.data_ptr(), slots.data_ptr(), _ptr(first), out.data_ptr(),
            lse.data_ptr(), n, slots.shape[0], heads, k_buf.shape[1], dim, scale, torch.get_num_threads())
        _check_status(status, q, k_buf)
        return out, lse

    def extend(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, kv_indices: torch.Tensor,
               reqs: torch.Tensor, scale: float, seed: tuple[torch.Tensor, torch.Tensor] | None = None,
               with_lse: bool = False, window: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Causal attention of each request's new tokens over its context, read in place from the pool.

        q [tokens, heads, dim]; kv_indices int32 (the requests' context slots, concatenated); reqs int64
        [bs, 4], a row (q_start, q_len, kv_start, kv_len) per request, kv_len >= q_len >= 1: query i of the
        request sees its first kv_len - q_len + i + 1 context slots; with `window` W > 0 only the last W of
        them (a sliding window: the query at position p sees p - W + 1 .. p). `seed` as for decode. Returns
        the output [tokens, heads, dim] and, with `with_lse`, the float32 log-sum-exp [tokens, heads]."""
        q, kv_indices, reqs = q.contiguous(), kv_indices.to(torch.int32).contiguous(), reqs.contiguous()
        _check_buffers(q, k_buf, v_buf)
        if reqs.dtype != torch.int64 or reqs.dim() != 2 or reqs.shape[1] != 4:
            raise ValueError("extend kernel needs reqs as int64 [bs, 4]")
        seed_out, seed_lse = _seed(seed, q)
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:2], dtype=torch.float32) if with_lse else None
        status = call_profiled(
            "radixserve::extend_attention_cpu", self._extend_fns[q.dtype, k_buf.dtype],
            q.data_ptr(), k_buf.data_ptr(), v_buf.data_ptr(), kv_indices.data_ptr(), reqs.data_ptr(),
            _ptr(seed_out), _ptr(seed_lse), out.data_ptr(), _ptr(lse), reqs.shape[0], q.shape[1], k_buf.shape[1],
            q.shape[2], max(window, 0), scale, torch.get_num_threads())
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
    if not (k_buf.is_contiguous() and v_buf.is_contiguous() and k_buf.dtype == v_buf.dtype
            and (q.dtype, k_buf.dtype) in _PAIR_SUFFIX):
        raise ValueError("attention kernels need contiguous K/V buffers of the query's dtype (or bf16 under float32 "
                         f"queries); got {q.dtype} queries over {k_buf.dtype} / {v_buf.dtype}")


OUT_OF_MEMORY = 2  # decode_attention.c: the parts' scratch could not be allocated


def _check_status(status: int, q: torch.Tensor, k_buf: torch.Tensor) -> None:
    if status == OUT_OF_MEMORY:
        raise MemoryError("the decode attention kernel could not allocate its scratch for a long context's parts")
    if status != 0:
        raise ValueError(f"attention kernel rejected shapes heads={q.shape[1]} kv_heads={k_buf.shape[1]} "
                         f"dim={q.shape[2]}")


def load_decode_kernel(isa: str | None = None) -> DecodeKernel | None:
    """The compiled kernels of level `isa` (default `platform.kernel_isa()`), or None (logged once) when the
    library cannot be built here. A level the compiler could not build falls back to the next lower one.
    Their selection class is `amx` at avx512_bf16 where AMX-BF16 is visible now, else the level."""
    isa = isa or rs_platform.kernel_isa()
    amx = isa == "avx512_bf16" and rs_platform.kernel_class() == "amx"
    with _load_lock:  # NOTE: a caller waits for a build the background thread has begun (build_in_background)
        return _load(isa, "amx" if amx else None)


def build_in_background() -> threading.Thread:
    """Starts building (and loading) this process's attention kernels on a daemon thread; `load_decode_kernel`
    then waits for it instead of building again. Start it while other start-up work runs that no timing
    depends on (a compiler beside a timed choice would skew it)."""
    thread = threading.Thread(target=_build_quietly, name="attention-build", daemon=True)
    thread.start()
    return thread


def _build_quietly() -> None:
    try:
        load_decode_kernel()
    except Exception:  # noqa: BLE001 - the caller's own load_decode_kernel() reports it in its thread
        logger.debug("background attention build failed", exc_info=True)


_load_lock = threading.Lock()


@functools.cache
def _load(isa: str, kernel_class: str | None) -> DecodeKernel | None:
    levels = rs_platform.KERNEL_ISAS
    for level in levels[levels.index(isa):]:
        try:
            lib = ctypes.CDLL(str(build_level_library("attention", SOURCES, level, HEADERS)))
        except BUILD_ERRORS as e:
            if level == "portable":
                logger.warning("native CPU attention kernels unavailable (%s); using the torch attention paths", e)
                return None
            logger.info("the C compiler cannot build the %s attention kernels: %s", level, e)
            continue
        if level != isa:
            logger.warning("the C compiler could not build the %s kernels; using %s", isa, level)
        return DecodeKernel(lib, level, kernel_class if level == isa else None)
    return None
