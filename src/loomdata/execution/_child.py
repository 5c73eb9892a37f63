"""Short-lived child interpreters that import this loomdata and nothing from the working directory.

The serving process hands work it must not keep the imports of (certificates: `cryptography`; plan checks: pydantic)
to a child. The child sees secrets (storage options) or writes what the caller trusts (credential files, a pickled
answer), so what it imports matters: `-c` puts the working directory first on `sys.path`, where a planted `pickle.py`
or `pathlib.py` would run with them in hand. `PATH_FIX` runs before any import that is not already loaded at start-up
and drops it; `SAME_LOOMDATA` refuses a `loomdata` imported from anywhere but the caller's (a copy ahead of it on
PYTHONPATH).
"""

from __future__ import annotations

import sys
from pathlib import Path

__all__ = ["PATH_FIX", "SAME_LOOMDATA", "child_argv"]

PATH_FIX = """
import sys
root = sys.argv[1]
import os
real = os.path.realpath(root)
if real not in {os.path.realpath(p) for p in sys.path if p}:
    sys.path.insert(0, root)
sys.path[:] = [p for p in sys.path if p]  # not the working directory (-c puts it first)
"""
"""A child's first lines: `sys.argv[1]` (the folder holding the caller's `loomdata`) on the path, the working
directory off it; `sys` and `os` are loaded at start-up, so nothing is imported from the working directory before."""

SAME_LOOMDATA = """
import loomdata
if os.path.commonpath([real, os.path.realpath(loomdata.__file__)]) != real:
    raise SystemExit(f"the child imported loomdata from {loomdata.__file__}, not from {root}")
"""
"""Imports `loomdata` and exits with a message naming both folders if it is not the caller's (after `PATH_FIX`)."""


def child_argv(body: str, *args: str) -> list[str]:
    """The command running `PATH_FIX` then `body` in this interpreter: `sys.argv[1]` is the folder holding this
    `loomdata` package, `args` follow from `sys.argv[2]`."""
    package_root = str(Path(__file__).resolve().parents[2])
    return [sys.executable, "-c", PATH_FIX + body, package_root, *args]
