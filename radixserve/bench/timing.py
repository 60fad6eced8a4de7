"""The timing loop the side-by-side benchmarks share: every candidate once to warm up, then the calls alternating
round by round, so that the machine's drift falls on all of them alike."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_times(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Median seconds per call of each fn, the calls alternating."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}
