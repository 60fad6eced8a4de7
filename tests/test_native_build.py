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


def test_the_attention_kernels_build_one_level_when_asked(tmp_path, monkeypatch):
    """A first start builds only the level it runs (here on a background thread, which a load then waits for
    instead of compiling again); a lower level is built when asked, and no other."""
    from radixserve import platform
    from radixserve.kernels import attention

    try:
        native_build.c_compiler()
    except FileNotFoundError:
        pytest.skip("no C compiler here")
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path))
    attention._load.cache_clear()

    def built() -> list[str]:
        return sorted(p.name.split("-")[1] for p in (tmp_path / "kernels").iterdir() if p.suffix == ".so")

    try:
        attention.build_in_background()
        assert attention.load_decode_kernel().isa == platform.kernel_isa()
        assert built() == [platform.kernel_isa()]
        lower = platform.runnable_isas()[1:2]
        for level in lower:
            assert attention.load_decode_kernel(level).isa == level
        assert built() == sorted({platform.kernel_isa(), *lower})
        assert not [p for p in (tmp_path / "kernels").iterdir() if p.is_dir()]  # no build left half-done
    finally:
        attention._load.cache_clear()
