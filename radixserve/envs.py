"""Every environment switch radixserve reads, declared once with its type, default and meaning.

Values are read when asked for (`envs.STRICT_CHECKS.get()`), not at import, so a test can set one
with `monkeypatch.setenv` and the next reader sees it. An unset or empty variable takes its
default. Booleans have one rule: 1/true/yes/on are true, 0/false/no/off are false, anything else is
an error naming the variable.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

T = TypeVar("T")

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class EnvError(ValueError):
    """An environment switch holds a value its type does not accept."""


def parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"expected one of {', '.join(_TRUE + _FALSE)}")


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    name: str
    default: T
    parse: Callable[[str], T]
    doc: str

    def get(self) -> T:
        raw = os.environ.get(self.name)
        if raw is None or raw.strip() == "":
            return self.default
        try:
            return self.parse(raw)
        except ValueError as e:
            raise EnvError(f"{self.name}={raw!r}: {e}") from None

    def is_set(self) -> bool:
        return self.name in os.environ


def _default_cache_dir() -> Path:
    return Path.home() / ".cache" / "radixserve"


def _choice(*allowed: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.strip().lower()
        if value not in allowed:
            raise ValueError(f"expected one of {', '.join(allowed)}")
        return value

    return parse


REGISTRY: list[EnvVar] = []


def _declare(name: str, default: T, parse: Callable[[str], T], doc: str) -> EnvVar[T]:
    var = EnvVar(name, default, parse, doc)
    REGISTRY.append(var)
    return var


CACHE_DIR = _declare("RADIXSERVE_CACHE_DIR", _default_cache_dir(), Path,
                     "converted GGUF folders and compiled kernels")
CPU_PREFILL_KERNEL = _declare("RADIXSERVE_CPU_PREFILL_KERNEL", True, parse_bool,
                              "0: extend attention on the CPU stays on torch's SDPA instead of the C kernel")
DECODE_STEP = _declare("RADIXSERVE_DECODE_STEP", True, parse_bool,
                       "0: decode batches run the decoder layers in Python instead of the one-call C loop, and "
                       "prefill's SiLU-and-mul and add + RMSNorm are the compiled ops")
BF16W_ONEDNN_PREFILL = _declare("RADIXSERVE_BF16W_ONEDNN_PREFILL", True, parse_bool,
                                "0: a prefill chunk over bf16 weights (float32 compute) multiplies the widened "
                                "weight with F.linear (MKL) instead of oneDNN's float32 product")
BF16W_PREFILL_COPY_MB = _declare("RADIXSERVE_BF16W_PREFILL_COPY_MB", -1, int,
                                 "budget in MB for the resident float32 copies (oneDNN's blocked order) that bf16-weight "
                                 "decoder layers under float32 compute keep for prefill chunks; 0: none, each chunk "
                                 "widens the weights; -1: an eighth of the machine's memory, at most 2048")
BF16W_BLOCKED_PREFILL = _declare("RADIXSERVE_BF16W_BLOCKED_PREFILL", True, parse_bool,
                                 "0: a prefill chunk over bf16 weights (float32 compute) widens the weight in plain "
                                 "order and oneDNN reorders it, instead of widening it straight into oneDNN's "
                                 "blocked order")
GEMV_MAX_ROWS = _declare("RADIXSERVE_GEMV_MAX_ROWS", None, int,
                         "most rows of a bf16 decode product our GEMV takes on CPUs without AMX, at most 64 "
                         "(unset: the row table's 32; oneDNN above; the C decoder takes batches up to it there)")
F32_GEMV_MAX_ROWS = _declare("RADIXSERVE_F32_GEMV_MAX_ROWS", None, int,
                             "most rows of a float32 product our float32 GEMV (f32_gemv) takes (unset: the row "
                             "table's; oneDNN above; the float32 C decoder takes batches up to it)")
CPU_MALLOC_TUNING = _declare("RADIXSERVE_CPU_MALLOC_TUNING", True, parse_bool,
                             "0: leave glibc's malloc alone: its thresholds, and no block mapped once the model is "
                             "loaded (large CPU tensors then fault pages in on every forward)")
CPU_ISA = _declare("RADIXSERVE_CPU_ISA", "auto", _choice("auto", "avx512_bf16", "avx512", "avx2", "portable"),
                    "auto: the best level of the C attention kernels this CPU runs; a lower level forces that "
                    "path (and hides the features above it from --dtype auto)")
WEIGHT_PREFETCH = _declare("RADIXSERVE_WEIGHT_PREFETCH", "auto", _choice("auto", "l1", "l2"),
                            "where the bf16-weight decode kernel prefetches the weights it streams: l2 (8 KiB ahead "
                            "into L2), l1 (4 KiB ahead into L1); auto: l2 on Intel CPUs, l1 elsewhere; products of one "
                            "row prefetch into L1 on every CPU")
STRICT_CHECKS = _declare("RADIXSERVE_STRICT_CHECKS", False, parse_bool,
                         "the idle KV conservation check raises instead of logging (the tests turn it on)")
CHECK_REQ_WRITES = _declare("RADIXSERVE_CHECK_REQ_WRITES", False, parse_bool,
                            "tests: every write of a request's field checks its writer (managers/req_owners.py; read "
                            "once, when the package is imported; the tests turn it on)")
DEBUG_ALLOC = _declare("RADIXSERVE_DEBUG_ALLOC", False, parse_bool,
                       "every free is checked at once: a double free raises (the tests turn it on)")
STARVATION_TIMEOUT_S = _declare("RADIXSERVE_STARVATION_TIMEOUT_S", 30.0, float,
                                "seconds after which a waiting request goes first, whatever its prefix match")
TEST_RETRACT_INTERVAL = _declare("RADIXSERVE_TEST_RETRACT_INTERVAL", 0, int,
                                 "tests: retract one request every N decode steps (0: never)")
DISABLE_WAR_BARRIER = _declare("RADIXSERVE_DISABLE_WAR_BARRIER", False, parse_bool,
                               "tests: remove the overlap loop's write-after-read barrier")
FORWARD_READ_DELAY_S = _declare("RADIXSERVE_FORWARD_READ_DELAY_S", 0.0, float,
                                "tests: the CPU forward stream sleeps this long before each task")
CHECK_FUTURE_MAP = _declare("RADIXSERVE_CHECK_FUTURE_MAP", False, parse_bool,
                            "debug: poison the future-token map and assert write-before-read, read-once")
EXPLORER_SCREENSHOT = _declare("RADIXSERVE_EXPLORER_SCREENSHOT", None, Path,
                               "tests: the browser test also saves its screenshot of /cache/view here")
GRAMMAR_MASK_ALL = _declare("RADIXSERVE_GRAMMAR_MASK_ALL", False, parse_bool,
                            "1: fill every grammar row's token mask before sampling, instead of sampling greedy "
                            "and plain-temperature rows first and masking only a refused token's row")
CHECK_READS = _declare("RADIXSERVE_CHECK_READS", False, parse_bool,
                       "debug: count forwards that read req_to_token rows overwritten after launch")


def describe() -> str:
    """One line per switch: name, default, meaning (for docs and --help epilogues)."""
    return "\n".join(f"{v.name} (default {v.default!s}): {v.doc}" for v in REGISTRY)
