"""Large CPU tensors without page faults: glibc keeps freed blocks for the next forward.

glibc's malloc serves a block above its mmap threshold (128 KiB at first, raised as such blocks are
freed) from freshly mapped pages and unmaps it at free; the next allocation of that size faults in and
zeroes every page again. A prefill chunk's activations are blocks of a few MiB, allocated and freed in
every layer: a forward of 4 x 500 tokens of the embedded model took ~53,000 minor page faults (~200 MiB
of zeroed pages), ~10% of its time. Raising the mmap threshold to glibc's maximum (32 MiB) and the trim
threshold keeps such blocks in the heap for reuse; the process keeps its peak memory instead of giving it
back between forwards. (vLLM's CPU guide asks for tcmalloc to be preloaded for the same reason.)
"""

from __future__ import annotations

import ctypes
import functools
import sys

from radixserve import envs

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
MMAP_THRESHOLD = 32 << 20  # glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD = 1 << 30


@functools.cache
def keep_freed_memory() -> bool:
    """Sets glibc's thresholds once per process; False where switched off or not glibc on Linux."""
    if not envs.CPU_MALLOC_TUNING.get() or not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # NOTE: musl has a mallopt that does nothing and returns 0
    return mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
