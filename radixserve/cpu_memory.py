"""Large CPU tensors without page faults: glibc keeps freed blocks for the next forward.

glibc's malloc serves a block above its mmap threshold (128 KiB at first, raised as such blocks are
freed) from freshly mapped pages and unmaps it at free; the next allocation of that size faults in and
zeroes every page again. A prefill chunk's activations are blocks of a few MiB, allocated and freed in
every layer: a forward of 4 x 500 tokens of the embedded model took ~53,000 minor page faults (~200 MiB
of zeroed pages), ~10% of its time. Raising the mmap threshold to glibc's maximum (32 MiB) and the trim
threshold keeps such blocks in the heap for reuse; the process keeps its peak memory instead of giving it
back between forwards. Larger blocks stay in the heap too once the model is loaded (`serve_from_heap`), and an
MLP too wide for a thread's heap runs in pieces of rows (`in_row_pieces`). (vLLM preloads tcmalloc into its CPU
workers for the same reason.)
"""

from __future__ import annotations

import ctypes
import functools
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from radixserve import envs

if TYPE_CHECKING:
    import torch

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -2, -3, -4  # glibc's mallopt parameters
MMAP_THRESHOLD = 32 << 20  # glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD = 1 << 30
TOP_PAD = 64 << 20  # a thread arena's heaps hold 64 MiB at most (HEAP_MAX_SIZE)
DEFAULT_MMAP_MAX, DEFAULT_TOP_PAD = 65536, 128 << 10  # glibc's own


@functools.cache
def _mallopt() -> Callable[[int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt


@functools.cache
def keep_freed_memory() -> bool:
    """Sets glibc's thresholds once per process; False where switched off or not glibc on Linux."""
    mallopt = _mallopt() if envs.CPU_MALLOC_TUNING.get() else None
    # NOTE: musl has a mallopt that does nothing and returns 0
    return (mallopt is not None and mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
            and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1)


def serve_from_heap(on: bool = True) -> bool:
    """Once the weights and the KV pool are in place (`on`), no block is mapped afresh any more, however large;
    `on=False` while a model loads, whose large temporaries are better mapped and given back. Returns whether it
    is on.

    glibc's mmap threshold stops at 32 MiB, and a prefill chunk's widest products are larger: Qwen2.5-1.5B's
    gate_up output is 35 MiB at 1,024 bf16 rows, 9,000 page faults at every call and 250,000 in a forward (540
    against 640 tok/s on the AMX Xeon). The heap keeps such blocks for the next forward.

    A thread other than the main one allocates from an arena of its own, made of heaps of 64 MiB at most, and
    glibc gives a heap back (unmaps it) once nothing in it is in use, unless the heap before it lacks room for the
    top pad: with the pad at a whole heap, none is given back. Without it, the offline Engine's scheduler thread
    faulted in 43,000-250,000 pages a forward at the 0.5B and 1.5B shapes."""
    global _serving
    mallopt = _mallopt() if keep_freed_memory() else None
    _serving = (mallopt is not None and mallopt(M_MMAP_MAX, 0 if on else DEFAULT_MMAP_MAX) == 1
                and mallopt(M_TOP_PAD, TOP_PAD if on else DEFAULT_TOP_PAD) == 1 and on)
    return _serving


_serving = False


# NOTE: in a thread other than the main one, a block larger than a heap (64 MiB) is mapped afresh at every call
# whatever M_MMAP_MAX says. The offline Engine runs its scheduler in such a thread; the server, in the main thread
# of its scheduler process.
THREAD_PIECE_BYTES = 48 << 20


def rows_per_piece(rows: int, widest_row_bytes: int) -> int:
    """How many rows of a row-wise block (an MLP) to run at a time, in equal pieces, so that its widest
    intermediate (`widest_row_bytes` a row) is a block the heap keeps: any size in the main thread once
    `serve_from_heap` is on, THREAD_PIECE_BYTES in another thread (Qwen2.5-1.5B's gate_up at 2,048 bf16 rows, 70
    MiB, runs in two pieces there). Each piece reads the whole weight again, so pieces are as large as they can
    be; `rows` (one piece) where the heap keeps no block anyway."""
    # NOTE: the size first: a decode batch's MLP asks on every layer
    if rows * widest_row_bytes <= THREAD_PIECE_BYTES or not _serving \
            or threading.current_thread() is threading.main_thread():
        return rows
    pieces = -(-rows * widest_row_bytes // THREAD_PIECE_BYTES)
    return -(-rows // pieces)


def in_row_pieces(block: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, widest: Any,
                  last: Any) -> torch.Tensor:
    """`block(x)`, a block of row-wise products from the linear layer `widest` (the widest output) to `last`, on the
    CPU a piece of rows at a time (`rows_per_piece`) into one output. Whole with LoRA: its segments index the
    rows of the whole batch."""
    rows = x.shape[0]
    if x.device.type != "cpu" or x.dim() != 2 or widest.lora is not None or last.lora is not None:
        return block(x)
    step = rows_per_piece(rows, widest.out_features * x.element_size())
    if step >= rows:
        return block(x)
    first = block(x[:step])
    out = first.new_empty(rows, *first.shape[1:])
    out[:step] = first
    for start in range(step, rows, step):
        out[start:start + step] = block(x[start:start + step])
    return out
