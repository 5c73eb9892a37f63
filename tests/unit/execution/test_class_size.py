"""No class in execution/ grows past about 250 lines: a class that long does more than one job."""

from __future__ import annotations

import ast
from pathlib import Path

import loomdata.execution

LIMIT = 250


def test_no_execution_class_is_over_250_lines() -> None:
    root = Path(loomdata.execution.__file__).parent
    sizes = {
        f"{p.name}:{n.name}": n.end_lineno - n.lineno + 1  # type: ignore[operator]
        for p in sorted(root.glob("*.py"))
        for n in ast.walk(ast.parse(p.read_text()))
        if isinstance(n, ast.ClassDef)
    }
    assert len(sizes) > 10
    assert {k: v for k, v in sizes.items() if v > LIMIT} == {}
