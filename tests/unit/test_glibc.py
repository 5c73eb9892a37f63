"""One handle on glibc's allocator: the heap thresholds and malloc_trim, each saying whether it took (Linux glibc)."""

from __future__ import annotations

import ast
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from loomdata import _glibc

_ON_GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
glibc_only = pytest.mark.skipif(not _ON_GLIBC, reason="not glibc")


@glibc_only
def test_the_c_library_is_found_once() -> None:
    libc = _glibc.glibc()
    assert libc is not None
    assert _glibc.glibc() is libc


def _in_a_fresh_process(code: str) -> str:
    """Thresholds are process-wide: set them where they cannot change this test run's allocator."""
    return subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.strip()


@glibc_only
def test_setting_both_heap_thresholds_takes() -> None:
    out = _in_a_fresh_process("from loomdata import _glibc; print(_glibc.set_heap_thresholds(32 << 20))")
    assert out == "True"


@glibc_only
def test_setting_the_mmap_threshold_alone_takes() -> None:
    out = _in_a_fresh_process("from loomdata import _glibc; print(_glibc.set_mmap_threshold(32 << 20))")
    assert out == "True"


class _Libc:
    """A C library whose mallopt refuses the parameters named (returns 0), as glibc does for a value it rejects."""

    def __init__(self, refused: set[int]) -> None:
        self.refused = refused
        self.calls: list[tuple[int, int]] = []

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return 0 if param in self.refused else 1


@pytest.mark.parametrize("refused", [{-3}, {-1}, {-3, -1}])
def test_a_threshold_glibc_refuses_is_reported_and_both_are_still_tried(
    monkeypatch: pytest.MonkeyPatch, refused: set[int]
) -> None:
    libc = _Libc(refused)
    monkeypatch.setattr(_glibc, "glibc", lambda: libc)
    assert _glibc.set_heap_thresholds(1 << 20) is False
    assert libc.calls == [(-3, 1 << 20), (-1, 1 << 20)]  # M_MMAP_THRESHOLD, then M_TRIM_THRESHOLD
    assert _glibc.set_mmap_threshold(1 << 20) is (-3 not in refused)


@glibc_only
def test_trim_runs() -> None:
    assert _glibc.trim() is True


def test_elsewhere_than_glibc_nothing_is_done(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_glibc, "glibc", lambda: None)
    assert _glibc.trim() is False
    assert _glibc.set_heap_thresholds(32 << 20) is False
    assert _glibc.set_mmap_threshold(32 << 20) is False


def test_the_module_imports_only_ctypes_and_functools() -> None:
    """A training rank and the planner import it: nothing of loomdata, nothing heavy."""
    tree = ast.parse(Path(_glibc.__file__).read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert names == {"__future__", "ctypes", "functools"}, names
