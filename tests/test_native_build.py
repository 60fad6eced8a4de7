"""Building a kernel library: the cache key covers the source, its headers, the flags and the compiler,
so a changed header builds (and loads) a new library instead of reusing the stale one."""

from __future__ import annotations

import ctypes

import pytest

from radixserve.kernels import build as native_build


def test_a_changed_header_builds_a_new_library(tmp_path, monkeypatch):
    try:
        native_build.c_compiler()
    except FileNotFoundError:
        pytest.skip("no C compiler here")
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    header, source = tmp_path / "value.h", tmp_path / "answer.c"
    source.write_text('#include "value.h"\nint answer(void) { return VALUE; }\n')
    built = []
    for value in (7, 7, 8):
        header.write_text(f"#define VALUE {value}\n")
        path = native_build.build_library(source, "answer", (), headers=(header,))
        built.append((path, ctypes.CDLL(str(path)).answer()))
    assert built[0] == built[1]  # unchanged: the cached library, not a rebuild
    assert built[2][0] != built[0][0] and [value for _, value in built] == [7, 7, 8]
