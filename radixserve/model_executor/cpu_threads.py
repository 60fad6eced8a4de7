"""One OpenMP thread pool per process: the model is built on a thread that then exits.

GNU OpenMP (torch's CPU runtime) keeps a pool of worker threads for every thread that has started a
parallel region, for as long as that thread lives. With two live pools and few cores it counts more
threads than cores and stops spinning between regions, so every op of a step waits for a sleeping
worker to wake: a batch-1 decode step of the embedded model took 23 ms on the thread that loaded
the model and 53 ms on another thread of the same process (2 cores, 2 threads). Loading runs big
parallel ops; the forward runs on the scheduler's or the forward stream's thread. Building on a
short-lived thread, and keeping the overlap loop's scheduler thread serial (its few large ops, such
as the allocator's free list, are fast on one core), leaves the forward's thread the only pool.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from functools import cache
from typing import Any, TypeVar

T = TypeVar("T")


def build_on_short_lived_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)` on a new thread that exits when it returns; its result or its exception."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            outcome["error"] = e

    # NOTE: daemon, so that Ctrl-C during a long load ends the process instead of waiting for it
    thread = threading.Thread(target=target, name="radixserve-build", daemon=True)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


@cache
def _openmp() -> ctypes.CDLL | None:
    lib = ctypes.CDLL(None)  # the runtime torch loaded, found among the process's global symbols
    return lib if hasattr(lib, "omp_set_num_threads") and hasattr(lib, "omp_get_max_threads") else None


def limit_openmp_threads(num_threads: int) -> int | None:
    """Parallel regions started by the calling thread use at most `num_threads` threads (OpenMP's
    setting is per thread; other threads keep theirs). Returns the previous count, to restore it, or
    None where no OpenMP runtime is loaded."""
    import torch

    lib = _openmp()
    if lib is None:
        return None
    torch.get_num_threads()  # NOTE: torch applies its own count to a thread once, lazily: let it do so first
    previous = lib.omp_get_max_threads()
    lib.omp_set_num_threads(num_threads)
    return previous
