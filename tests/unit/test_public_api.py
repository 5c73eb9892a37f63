"""Every name loomdata exports resolves, and importing the package loads no Dask."""

from __future__ import annotations

import subprocess
import sys

import loomdata


def test_every_exported_name_resolves() -> None:
    for name in loomdata.__all__:
        assert getattr(loomdata, name) is not None, name


def test_import_is_light() -> None:
    code = "import sys, loomdata; print('distributed' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]
